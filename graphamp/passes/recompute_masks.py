"""Keep boolean masks out of the tensors a compiled forward saves for its backward.

Inductor's CPU kernels store a ``bool`` tensor element by element through a generic vector
conversion (``VecMask<float,1>::store(bool*)``): on the machine this was found on, a compiled
``x <= 0`` over 1M floats takes 11-13 ms against 0.45 ms eager, while ``(x <= 0).float()`` takes
0.12 ms. AOTAutograd's partitioner prefers saving masks because they are small, so every ReLU's
``threshold_backward`` mask and every dropout mask becomes such a store in the compiled forward
(and a load in the backward). This pass runs on the joint forward-backward graph before the
partition (inductor's ``joint_custom_pre_pass``) and changes no value:

- a mask computed from non-random values (``le(relu_out, 0)``) is marked ``MUST_RECOMPUTE``: the
  backward computes it again, fused into the kernel that uses it, from what it saves instead;
- a mask drawn at random (dropout's ``rand(...) > p``) cannot be recomputed; where it is used only
  through ``mul`` and ``convert_element_type`` to one floating dtype, every use reads one conversion
  (the value ``mul`` would promote the bool to anyway), marked ``MUST_SAVE``: the saved mask is
  that floating tensor, stored at vector speed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

__all__ = ["RecomputeMasks", "recompute_masks"]

aten = torch.ops.aten
prims = torch.ops.prims
_CONVERT = (prims.convert_element_type.default, torch.ops.prims.convert_element_type.default)
_RANDOM = {aten.rand.default, aten.rand_like.default, aten.bernoulli.default, aten.bernoulli.p, aten.randn.default,
           aten.randn_like.default, aten.native_dropout.default}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_mask(node: Node) -> bool:
    v = _val(node)
    return node.op == "call_function" and isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() > 0


def _random_input(node: Node) -> bool:
    return any(isinstance(a, Node) and a.target in _RANDOM for a in node.all_input_nodes)


def _float_use(mask: Node) -> tuple[Node, torch.dtype] | None:
    """The mask's conversion to one floating dtype, if every use is that conversion or a ``mul``
    by a tensor of that dtype (which promotes the bool to it)."""
    dtypes, convert = set(), None
    for user in mask.users:
        if user.target in _CONVERT and user.args[0] is mask:
            dtypes.add(user.args[1])
            convert = convert or user
        elif user.target is aten.mul.Tensor:
            other = user.args[1] if user.args[0] is mask else user.args[0]
            ov = _val(other)
            if not isinstance(ov, torch.Tensor) or _val(user).dtype != ov.dtype:
                return None
            dtypes.add(ov.dtype)
        else:
            return None
    if convert is None or len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        return None
    return convert, next(iter(dtypes))


def recompute_masks(graph: Graph) -> int:
    """Mark the joint graph's masks for recomputation (or save them as floats); returns how many."""
    from torch.utils.checkpoint import CheckpointPolicy

    changed = 0
    for node in list(graph.nodes):
        if not _is_mask(node):
            continue
        if not _random_input(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            changed += 1
            continue
        found = _float_use(node)
        if found is None:
            continue
        convert, dtype = found
        node.append(convert)  # right after the mask, before its forward uses
        for user in list(node.users):
            if user is convert:
                continue
            if user.target in _CONVERT:
                user.replace_all_uses_with(convert)
                graph.erase_node(user)
            else:
                user.replace_input_with(node, convert)
        convert.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        changed += 1
    return changed


class RecomputeMasks(CustomGraphPass):
    """:func:`recompute_masks` as inductor's ``joint_custom_pre_pass`` (a ``CustomGraphPass``, so
    inductor's FX graph cache keys on this file's contents)."""

    def __call__(self, graph: Graph) -> None:
        recompute_masks(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
