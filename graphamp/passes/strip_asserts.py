"""Drop export's ``_assert_tensor_metadata`` nodes, whose dtype facts the cast passes change."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["strip_asserts"]


def strip_asserts(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Erase ``aten._assert_tensor_metadata`` calls (export's checks that ``.to()`` is a no-op or not)."""
    asserts = gm.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default)
    for node in asserts:
        gm.graph.erase_node(node)
    if asserts:
        gm.recompile()
    return PassResult(gm, bool(asserts))
