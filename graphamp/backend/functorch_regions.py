"""Keep a ``torch.vmap`` (or ``torch.func.jvp``, ``torch.func.grad``) region of dynamo's graph whole, under eager's
autocast state there.

Where the model's code calls ``torch.vmap`` (transformers' ``associative_scan`` in Jamba and
FalconMamba, ``torch.func`` in user code), dynamo's graph holds the function being vmapped between
functorch's markers (``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting``). Inside them,
eager autocast does not follow one policy per op: a batching rule runs in place of the op, and
autocast casts the ops it calls one by one. Under vmap CPU autocast gives ``F.linear(x, w, b)`` in
fp32 (the rule's bf16 ``mm`` plus an fp32 ``add`` of the bias) and ``x @ w`` in bf16; a per-node
policy cannot express that. So the backend keeps the region as one call that runs dynamo's own
nodes under the autocast state eager has at that point: AOTAutograd traces it with that state on,
as its own path does, and records autocast's casts inside explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from graphamp.runtime import AutocastState, autocast_state

__all__ = ["REGION_STARTS", "KeptRegion", "region_module", "region_nodes", "run_region"]

_PAIRS = {
    torch._functorch.predispatch._vmap_increment_nesting: torch._functorch.predispatch._vmap_decrement_nesting,
    torch._functorch.predispatch._jvp_increment_nesting: torch._functorch.predispatch._jvp_decrement_nesting,
    torch._C._functorch._grad_increment_nesting: torch._C._functorch._grad_decrement_nesting,
}

# The markers that open a region kept whole.
REGION_STARTS = frozenset(_PAIRS)


class KeptRegion(nn.Module):
    """A functorch region of dynamo's graph, run whole under the autocast state recorded for it."""

    def __init__(self, body: GraphModule, autocast: tuple[AutocastState, ...], cache_enabled: bool = True) -> None:
        super().__init__()
        self.body = body
        self.autocast = tuple(autocast)
        self.cache_enabled = cache_enabled

    def forward(self, *operands: Any) -> Any:
        return run_region(self, *operands)


def run_region(kept: KeptRegion, *operands: Any) -> tuple[Any, ...]:
    """Run the region's nodes under eager's autocast state there; tracing records autocast's casts."""
    with autocast_state(kept.autocast, kept.cache_enabled):
        return kept.body(*operands)


def region_nodes(start: Node) -> list[Node]:
    """The nodes from the marker ``start`` through the marker that closes it, in graph order.

    >>> g = Graph()
    >>> x = g.placeholder("x")
    >>> open_ = g.call_function(torch._functorch.predispatch._vmap_increment_nesting, (2, "error"))
    >>> y = g.call_function(torch.neg, (x,))
    >>> close = g.call_function(torch._functorch.predispatch._vmap_decrement_nesting, ())
    >>> _ = g.output(y)
    >>> assert region_nodes(open_) == [open_, y, close]
    """
    closes = {start.target: _PAIRS[start.target]}
    depth, nodes, node = 0, [], start
    while True:
        nodes.append(node)
        if node.op == "call_function" and node.target is start.target:
            depth += 1
        elif node.op == "call_function" and node.target is closes[start.target]:
            depth -= 1
            if depth == 0:
                return nodes
        if node.op == "output":
            raise RuntimeError(f"functorch region opened at {start.format_node()} is never closed")
        node = node.next


def region_module(gm: GraphModule, nodes: Sequence[Node]) -> tuple[GraphModule, list[Node], list[Node]]:
    """The region as a GraphModule, the outside nodes it reads (its inputs) and those of its nodes
    read outside it (its outputs)."""
    inside = set(nodes)
    inputs: list[Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(user not in inside for user in n.users)]
    graph = Graph()
    env: dict[Node, Node] = {}
    for arg in inputs:
        env[arg] = graph.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return GraphModule(gm, graph), inputs, outputs
