"""Gradient analysis: which nodes run without grad, and which can never carry a gradient."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Node

from graphamp.passes.graph_edit import attr_of
from graphamp.node_info import GradFrame, region_of

__all__ = ["grad_free_nodes", "in_no_grad"]


def in_no_grad(node: Node) -> bool:
    """Whether ``node`` sits in a ``no_grad`` region written in forward (the innermost grad frame)."""
    frames = [f for f in region_of(node) if isinstance(f, GradFrame)]
    return bool(frames) and not frames[-1].enabled


def grad_free_nodes(gm: GraphModule, *, no_grad: bool = False) -> set[Node]:
    """Nodes whose value can never require grad, whatever inputs the module is called with."""
    if no_grad:
        return set(gm.graph.nodes)
    free: set[Node] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                free.add(node)
        elif node.op == "get_attr":
            attr = attr_of(gm, node.target)
            if not (isinstance(attr, nn.Parameter) and attr.requires_grad):
                free.add(node)
        elif node.op == "call_function":
            if in_no_grad(node) or all(a in free for a in node.all_input_nodes):
                free.add(node)
    return free
