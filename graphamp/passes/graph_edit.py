"""Editing graphs: fake values, cast nodes, inlining subgraphs, reading attributes."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from graphamp.node_info import NodeInfo, peek
from graphamp.policy import short_dtype
from graphamp.errors import CaptureError

__all__ = [
    "CAST_TARGET", "ancestors", "attr_of", "carried_meta", "cast_source", "dtypes_of", "fake_mode_of", "has_mutating_user",
    "inline_subgraph", "input_dependent", "insert_cast", "is_graphamp_cast", "is_mutating", "next_node", "recompute_val",
    "tensor_dtype", "val_of",
]

aten = torch.ops.aten
CAST_TARGET = aten._to_copy.default
# What a node made from another (a cast for it, a node of its decomposition) inherits from it.
_CARRIED = ("nn_module_stack", "stack_trace")


def ancestors(node: Node) -> set[Node]:
    """Every node ``node`` is computed from (not ``node`` itself)."""
    seen: set[Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def input_dependent(value: Any) -> bool:
    """Whether a graph value is computed from a tensor input's values, not only from its sizes and
    constants (ATen graphs: ``val`` metadata, ``sym_size``; dynamo's: ``example_value``, ``size()``)."""
    if not isinstance(value, Node):
        return False
    seen, stack = set(), [value]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and isinstance(node.meta.get("val", node.meta.get("example_value")), torch.Tensor):
            return True
        if node.op == "call_method" and node.target in ("size", "dim", "numel"):
            continue
        if node.op == "call_function" and node.target in (getattr, aten.sym_size.int):
            continue
        stack.extend(node.all_input_nodes)
    return False


def next_node(node: Node) -> Node | None:
    """The node after ``node`` in graph order, None after the last (the graph's sentinel has op "root")."""
    after = node.next
    return None if after.op == "root" else after


def carried_meta(node: Node, **fields: Any) -> dict[str, Any]:
    """Meta for a node made from ``node``: its module path and source line, and a fresh
    :class:`NodeInfo` in the same regions with ``fields`` set."""
    meta = {k: v for k, v in node.meta.items() if k in _CARRIED}
    record = peek(node)
    meta["graphamp"] = NodeInfo(region=record.region if record is not None else (), **fields)
    return meta


def fake_mode_of(gm: GraphModule) -> FakeTensorMode:
    # The graph's own mode, not detect_fake_mode's: a caller may be running inside another fake
    # mode (fake CUDA models), and detect_fake_mode insists that the two agree.
    vals = pytree.tree_leaves([n.meta.get("val") for n in gm.graph.nodes])
    mode = next((v.fake_mode for v in vals if isinstance(v, torch._subclasses.fake_tensor.FakeTensor)), None)
    if mode is None:
        raise RuntimeError("graphamp passes need node.meta['val'] fake tensors; capture the graph first")
    return mode


def val_of(arg: Any) -> Any:
    """Replace every Node in ``arg`` by its fake value."""
    return torch.fx.node.map_arg(arg, lambda n: n.meta.get("val"))


def tensor_dtype(node: Any) -> torch.dtype | None:
    if isinstance(node, Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.dtype
    return None


def dtypes_of(val: Any) -> tuple:
    return tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(val))


def is_mutating(op: Any) -> bool:
    """In-place and ``out=`` overloads write to an argument; autocast never touches them."""
    return isinstance(op, torch._ops.OpOverload) and any(
        a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
    )


def is_graphamp_cast(node: Node) -> bool:
    record = peek(node)
    return node.op == "call_function" and record is not None and record.cast


def cast_source(node: Node) -> tuple[Node, torch.dtype] | None:
    """(source, dtype) if ``node`` converts one tensor's dtype and nothing else, else None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.target is CAST_TARGET and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        return node.args[0], node.kwargs["dtype"]
    if node.target is aten.to.dtype and len(node.args) == 2 and not any(node.kwargs.get(k) for k in ("copy", "non_blocking")) and node.kwargs.get("memory_format") is None:
        return node.args[0], node.args[1]
    return None


def has_mutating_user(node: Node) -> bool:
    return any(is_mutating(u.target) for u in node.users)


def recompute_val(node: Node, fake_mode: FakeTensorMode) -> Any:
    """Run ``node`` on its inputs' fake values to refresh ``meta['val']`` after an edit."""
    if node.target is operator.getitem:
        return operator.getitem(val_of(node.args[0]), node.args[1])
    args, kwargs = val_of(node.args), val_of(node.kwargs)
    # The python dispatcher routes symbolic shapes through the decompositions export used.
    with fake_mode, enable_python_dispatcher():
        return node.target(*args, **kwargs)


def insert_cast(graph: torch.fx.Graph, src: Node, dtype: torch.dtype, before: Node, fake_mode: FakeTensorMode, reason: str) -> Node:
    with graph.inserting_before(before):
        cast = graph.create_node("call_function", CAST_TARGET, (src,), {"dtype": dtype}, name=f"{src.name}_{short_dtype(dtype)}")
    cast.meta.update(carried_meta(before, cast=True, reason=reason))
    cast.meta["val"] = recompute_val(cast, fake_mode)
    return cast


def inline_subgraph(graph: torch.fx.Graph, node: Node, sub: torch.fx.Graph, inputs: list, meta_for: Any) -> list[Node]:
    """Replace ``node`` by a copy of ``sub`` (placeholders bound to ``inputs``); returns the copies.

    The copies go where ``node`` was, each with ``meta_for(original)`` as meta. A node returning
    several values is used through ``getitem``; each of those is rewired to the matching output.
    """
    env: dict[Node, Any] = dict(zip(sub.find_nodes(op="placeholder"), inputs))
    copies: list[Node] = []
    outputs: Any = None
    with graph.inserting_before(node):
        for n in sub.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":
                raise CaptureError(f"cannot inline {node.format_node()}: its subgraph reads attribute {n.target!r}")
            env[n] = copy = graph.node_copy(n, lambda a: env[a])
            copy.meta = meta_for(n)
            copies.append(copy)
    if isinstance(outputs, (list, tuple)):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise CaptureError(f"cannot inline {node.format_node()}: it is used other than through getitem")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs)
    graph.erase_node(node)
    return copies


def attr_of(gm: GraphModule, target: str) -> object:
    """The attribute ``target`` ("a.b.weight") of ``gm``."""
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
