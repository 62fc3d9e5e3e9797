"""Keep one cast per (value, dtype): eager autocast recasts an activation for every consumer."""

from __future__ import annotations

from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes._infra import has_mutating_user, is_graphamp_cast
from graphamp.passes.inline_regions import GradFrame, region_of

__all__ = ["dedupe_casts"]


def _grad_frames(node: Node) -> tuple:
    # A cast made under no_grad carries no autograd history; it must not serve a consumer outside.
    return tuple(f for f in region_of(node) if isinstance(f, GradFrame))


def dedupe_casts(gm: GraphModule) -> PassResult:
    """Merge graphamp casts of the same value to the same dtype into the first one."""
    first: dict[tuple, Node] = {}
    modified = False
    for node in list(gm.graph.nodes):
        if not is_graphamp_cast(node) or has_mutating_user(node):
            continue
        key = (node.args[0], node.kwargs["dtype"], _grad_frames(node))
        kept = first.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
