"""Flatten autocast and grad-mode regions into the main graph, recording each node's region in meta.

A region the user wrote in ``forward`` (``with torch.autocast(...)``, ``with torch.no_grad()``, the
``autocast(enabled=False)`` of ``custom_fwd``) reaches graphamp in one of two forms:

* export: a ``wrap_with_autocast`` / ``wrap_with_set_grad_enabled`` higher-order op over a subgraph;
* make_fx pre-dispatch and dynamo: ``_enter_autocast`` ... ``_exit_autocast`` marker nodes.

Both become plain nodes tagged with ``node.meta["graphamp_region"]``, a tuple of frames, outermost
first. Autocast frames are dropped from the code (the casts will carry the policy; no runtime
autocast remains). Grad-mode frames stay as explicit ``torch._C._set_grad_enabled`` calls.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.errors import CaptureError

__all__ = ["AutocastFrame", "GradFrame", "inline_regions", "region_of", "set_grad_enabled"]

REGION = "graphamp_region"


class AutocastFrame(NamedTuple):
    device_type: str
    dtype: torch.dtype | None
    enabled: bool


class GradFrame(NamedTuple):
    enabled: bool


def set_grad_enabled(enabled: bool) -> bool:
    """Set grad mode and return the previous one; the graph calls it around a grad-mode region."""
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enabled)
    return prev


def region_of(node: Node) -> tuple[AutocastFrame | GradFrame, ...]:
    return node.meta.get(REGION, ())


_hop = torch.ops.higher_order
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


def _is_hop(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _inline_subgraph(gm: GraphModule, hop: Node, sub: GraphModule, operands: tuple, frame) -> None:
    """Copy ``sub``'s nodes before ``hop`` under one more region frame, rewiring hop's getitems."""
    graph = gm.graph
    env: dict[Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, operands))
    outer = region_of(hop)
    outputs = None
    with graph.inserting_before(hop):
        if isinstance(frame, GradFrame):
            prev = graph.call_function(set_grad_enabled, (frame.enabled,))
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":
                raise CaptureError(f"unexpected attribute {n.target!r} inside the region subgraph of {hop.format_node()}")
            new = graph.node_copy(n, lambda a: env[a])
            new.meta = dict(n.meta)
            new.meta[REGION] = outer + (frame,) + region_of(n)
            env[n] = new
        if isinstance(frame, GradFrame):
            graph.call_function(set_grad_enabled, (prev,))
    for user in list(hop.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise CaptureError(f"{hop.format_node()} is used other than through getitem")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(hop)


def _inline_hops(gm: GraphModule) -> bool:
    modified = False
    for node in list(gm.graph.nodes):
        if not _is_hop(node):
            continue
        if node.target is _hop.wrap_with_autocast:
            device_type, dtype, enabled, _cache, sub_node, *operands = node.args
            frame = AutocastFrame(device_type, dtype, bool(enabled))
        elif node.target is _hop.wrap_with_set_grad_enabled:
            enabled, sub_node, *operands = node.args
            frame = GradFrame(bool(enabled))
        else:
            raise CaptureError(
                f"graphamp cannot rewrite inside the higher-order op {node.target.name()} "
                f"({node.format_node()}); its subgraph would escape the cast policy. Way out: "
                "express the control flow without it, or keep that part outside the converted model"
            )
        sub = getattr(gm, sub_node.target)
        _inline_hops(sub)  # innermost first, so the copied nodes hold no nested region ops
        _inline_subgraph(gm, node, sub, tuple(operands), frame)
        if not sub_node.users:
            gm.graph.erase_node(sub_node)
            delattr(gm, sub_node.target)
        modified = True
    return modified


def _inline_markers(gm: GraphModule) -> bool:
    stack: list[AutocastFrame] = []
    markers: list[Node] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _ENTER:
            device_type, dtype, enabled, *_ = node.args
            stack.append(AutocastFrame(device_type, dtype, bool(enabled)))
            markers.append(node)
        elif node.op == "call_function" and node.target is _EXIT:
            stack.pop()
            markers.append(node)
        elif stack:
            node.meta[REGION] = tuple(stack) + region_of(node)
    for node in reversed(markers):
        gm.graph.erase_node(node)
    return bool(markers)


def inline_regions(gm: GraphModule) -> PassResult:
    """Replace region higher-order ops and autocast markers by region-tagged plain nodes."""
    modified = _inline_hops(gm)
    modified |= _inline_markers(gm)
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
