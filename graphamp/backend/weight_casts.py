"""Share a parameter's low-precision cast between its uses in one graph, as autocast's cache does.

Eager autocast caches the cast of an fp32 leaf that requires grad for the length of its region,
so two low-precision uses of one weight share one cast, and autograd sums their gradients in the
low dtype before casting back once. ``dedupe_casts`` shares casts of parameters it sees as graph
attributes; dynamo lifts parameters to graph inputs, so there they are inputs, whose later casts
are :func:`graphamp.runtime.autocast_cached` calls that ask, when run, whether the input is such
a leaf. AOTAutograd runs them once, while tracing, on its functional wrappers, which are never
leaves, so every use would get its own cast. In the backend the answer is known while compiling:
an input whose example is an fp32 ``nn.Parameter`` that requires grad is a leaf on every call
dynamo lets through (its guards check each input's type, dtype and ``requires_grad``). Those
calls are replaced by the first cast itself. Other inputs keep the call: whether a tensor is a
leaf is not guarded, so it cannot be decided once for every call.

With ``cache_enabled=False`` (``Config``, the backend's option, or the enclosing autocast region)
eager caches nothing and ``dedupe_casts`` leaves no cached call behind: there is nothing to share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.runtime import autocast_cached

__all__ = ["share_parameter_casts"]


def _is_cached_by_eager(value: Any) -> bool:
    return isinstance(value, nn.Parameter) and value.requires_grad and value.dtype is torch.float32


def share_parameter_casts(gm: GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Replace each later cast of a parameter input by its first cast, where eager's cache would.

    >>> from graphamp.backend import rewrite
    >>> from graphamp.spec import AmpSpec
    >>> w, x = nn.Parameter(torch.randn(4, 4)), torch.randn(2, 4)
    >>> gm = torch.fx.symbolic_trace(lambda w, x: torch.nn.functional.linear(torch.nn.functional.linear(x, w), w))
    >>> amp = rewrite(gm, [w, x], AmpSpec("cpu", torch.bfloat16, target="aot"))
    >>> assert not amp.graph.find_nodes(op="call_function", target=autocast_cached)
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    cached = {node for node, value in zip(placeholders, example_inputs) if _is_cached_by_eager(value)}
    modified = False
    for node in list(gm.graph.find_nodes(op="call_function", target=autocast_cached)):
        src, first, _ = node.args
        if src in cached:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
