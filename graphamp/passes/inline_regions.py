"""Flatten autocast and grad-mode regions into the main graph, recording each node's region in meta.

A region the user wrote in ``forward`` (``with torch.autocast(...)``, ``with torch.no_grad()``, the
``autocast(enabled=False)`` of ``custom_fwd``) reaches graphamp in one of two forms:

* export: a ``wrap_with_autocast`` / ``wrap_with_set_grad_enabled`` higher-order op over a subgraph;
* make_fx pre-dispatch and dynamo: ``_enter_autocast`` ... ``_exit_autocast`` marker nodes, and
  bare ``torch._C._set_grad_enabled`` switches for grad-mode regions.

Both become plain nodes whose ``NodeInfo.region`` holds a tuple of frames, outermost first. Autocast frames are dropped from the code (the casts will carry the policy; no runtime
autocast remains). Grad-mode frames stay as explicit grad-mode calls.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.errors import CaptureError
from graphamp.passes.graph_edit import inline_subgraph
from graphamp.node_info import AutocastFrame, GradFrame, NodeInfo, info, peek, region_of
from graphamp.runtime import set_grad_enabled

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["AutocastFrame", "GradFrame", "inline_regions", "region_of"]

_hop = torch.ops.higher_order
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast
_SET_GRAD_ENABLED = torch._C._set_grad_enabled


def _is_hop(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _inline_subgraph(gm: GraphModule, hop: Node, sub: GraphModule, operands: tuple, frame) -> None:
    """Copy ``sub``'s nodes in place of ``hop``, under one more region frame."""
    graph = gm.graph
    outer = region_of(hop)
    if isinstance(frame, GradFrame):
        with graph.inserting_before(hop):
            prev = graph.call_function(set_grad_enabled, (frame.enabled,))
        info(prev).region = outer
    copies = inline_subgraph(graph, hop, sub.graph, list(operands), lambda n: _in_region(n, outer + (frame,)))
    if isinstance(frame, GradFrame):
        with graph.inserting_after(copies[-1] if copies else prev):
            restore = graph.call_function(set_grad_enabled, (prev,))
        info(restore).region = outer


def _in_region(node: Node, frames: tuple) -> dict:
    """``node``'s meta for a copy inside ``frames``, its own record (if any) copied, not shared."""
    record = dataclasses.replace(peek(node) or NodeInfo())
    record.region = frames + record.region
    return {**node.meta, "graphamp": record}


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
    # make_fx pre-dispatch and dynamo record `with torch.no_grad()` as bare grad-mode switches,
    # each setting the mode until the next; they stay in the code and tag the nodes after them.
    grad: tuple[GradFrame, ...] = ()
    tagged = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _ENTER:
            device_type, dtype, enabled, *_ = node.args
            stack.append(AutocastFrame(device_type, dtype, bool(enabled)))
            markers.append(node)
        elif node.op == "call_function" and node.target is _EXIT:
            stack.pop()
            markers.append(node)
        elif node.op == "call_function" and node.target is _SET_GRAD_ENABLED:
            # A switch an earlier run applied has tagged the nodes after it already.
            if not info(node).grad_switch:
                info(node).grad_switch = True
                grad = (GradFrame(bool(node.args[0])),)
                tagged = True
        elif stack or grad:
            info(node).region = tuple(stack) + grad + region_of(node)
    for node in reversed(markers):
        gm.graph.erase_node(node)
    return bool(markers) or tagged


def inline_regions(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Replace region higher-order ops and autocast markers by region-tagged plain nodes."""
    modified = _inline_hops(gm)
    modified |= _inline_markers(gm)
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
