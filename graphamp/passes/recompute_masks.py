"""Keep boolean masks out of the tensors a compiled forward saves for its backward.

Inductor's CPU kernels move ``bool`` tensors to and from memory element by element (through a
generic ``VecMask`` conversion): on the machine this was found on, a compiled ``x <= 0`` over 1M
floats takes 7-13 ms against 0.45 ms eager, and a compiled ``where(mask, 0, g)`` reading a stored
mask 4.5 ms against 0.2 ms when the mask is computed in the kernel. Going through ``float32`` is
fast both ways: ``(x <= 0).float().to(torch.uint8)`` is stored in 0.11 ms and
``where(m.float() != 0, 0, g)`` reads it in 0.21 ms. AOTAutograd's partitioner likes saving masks
(they are small), so every ReLU's ``threshold_backward`` mask and every dropout mask becomes such
a slow store in the compiled forward and a slow load in the backward.

This pass runs on the joint forward-backward graph before the partition (inductor's
``joint_custom_pre_pass``). For each mask the forward computes and the backward reads, it saves a
``uint8`` copy made through ``float32`` (the same byte per element as the bool) and has every use,
forward and backward, read the mask back from it through ``float32`` (``!= 0``): in-register
conversions inductor fuses into the kernels around them. The values are those of the mask: nothing
computed changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

__all__ = ["RecomputeMasks", "recompute_masks"]

_CONVERT = torch.ops.prims.convert_element_type.default
_NE = torch.ops.aten.ne.Scalar


def _is_mask(node: Node) -> bool:
    """A bool tensor an op computes; not a view of one (``expand`` of a small mask), which reads
    the mask it views and would otherwise be saved at its own, larger, size."""
    v = node.meta.get("val")
    return node.op == "call_function" and isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() > 0 and not _is_view(node)


def _is_view(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _backward_nodes(graph: Graph) -> set[Node]:
    """The nodes that depend on a tangent: the backward's part of the joint graph."""
    backward: set[Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def _read_in_backward(mask: Node, backward: set[Node]) -> bool:
    """Whether the backward reads ``mask``, directly or through ops of the forward."""
    seen, todo = set(), list(mask.users)
    while todo:
        node = todo.pop()
        if node in backward:
            return True
        if node not in seen and node.op != "output":
            seen.add(node)
            todo.extend(node.users)
    return False


def _call(graph: Graph, target: Any, args: tuple, val: torch.Tensor, policy: Any) -> Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    if policy is not None:
        node.meta["recompute"] = policy
    return node


def recompute_masks(graph: Graph) -> int:
    """Have the joint graph save each forward mask its backward reads as uint8; returns how many."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = _backward_nodes(graph)
    changed = 0
    for mask in [n for n in graph.nodes if _is_mask(n) and n not in backward]:
        if not _read_in_backward(mask, backward):
            continue
        val = mask.meta["val"]
        with graph.inserting_after(mask):
            as_float = _call(graph, _CONVERT, (mask, torch.float32), val.to(torch.float32), None)
        with graph.inserting_after(as_float):
            saved = _call(graph, _CONVERT, (as_float, torch.uint8), val.to(torch.uint8), CheckpointPolicy.MUST_SAVE)
        with graph.inserting_after(saved):
            read = _call(graph, _CONVERT, (saved, torch.float32), val.to(torch.float32), CheckpointPolicy.PREFER_RECOMPUTE)
        with graph.inserting_after(read):
            again = _call(graph, _NE, (read, 0), val.clone(), CheckpointPolicy.PREFER_RECOMPUTE)
        mask.replace_all_uses_with(again, delete_user_cb=lambda user: user is not as_float)
        changed += 1
    return changed


class RecomputeMasks(CustomGraphPass):
    """:func:`recompute_masks` as inductor's ``joint_custom_pre_pass`` (a ``CustomGraphPass``, so
    inductor's FX graph cache keys on this file's contents)."""

    def __call__(self, graph: Graph) -> None:
        recompute_masks(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
