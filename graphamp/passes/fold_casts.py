"""Remove casts that cannot change a value: same-dtype casts and low -> fp32 -> low round trips.

fp16 -> fp32 -> fp16 and bf16 -> fp32 -> bf16 reproduce every non-NaN bit pattern, so the round
trip's forward is the identity; fp32 -> low -> fp32 rounds, so it is always kept. The backward of
a round trip is an identity too, but only a linear chain keeps autograd's gradient sums in the
same dtype and order; a branching one is folded only where no gradient can flow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.grad_analysis import grad_free_nodes
from graphamp.passes.graph_edit import cast_source, has_mutating_user, is_graphamp_cast, tensor_dtype
from graphamp.policy import LOW_DTYPES

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["fold_casts"]

_EXACT_UP = (torch.float32, torch.float64)


def _folded_source(node: Node, free: set[Node]) -> Node | None:
    """The value ``node`` can be replaced by, if its cast is a no-op."""
    cast = cast_source(node)
    if cast is None or has_mutating_user(node):
        return None
    src, dtype = cast
    if tensor_dtype(src) == dtype and (is_graphamp_cast(node) or node.target is torch.ops.aten.to.dtype):
        return src  # to.dtype to the same dtype already returns its input
    inner = cast_source(src)
    if inner is not None and dtype in LOW_DTYPES and inner[1] in _EXACT_UP and tensor_dtype(inner[0]) == dtype:
        origin = inner[0]
        linear = len(src.users) == 1 and len(origin.users) == 1
        if origin in free or linear:
            return origin
    return None


def fold_casts(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Replace no-op casts by their source and drop casts left without users.

    ``spec.inference`` declares the module will never be differentiated, so every round trip folds.
    """
    free = grad_free_nodes(gm, no_grad=spec.inference)
    modified = False
    for node in list(gm.graph.nodes):
        src = _folded_source(node, free)
        if src is not None:
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            modified = True
    for node in reversed(list(gm.graph.nodes)):
        if cast_source(node) is not None and not node.users:
            gm.graph.erase_node(node)
            modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
