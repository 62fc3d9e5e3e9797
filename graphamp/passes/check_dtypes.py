"""Check every op's output dtype against the one eager autocast produced during capture.

Capture runs under the same autocast as eager, so ``NodeInfo.captured`` holds eager's
dtypes. After the cast passes, an exact conversion with the built-in policy must agree on every
node; a disagreement means the tables drifted from the installed torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.errors import PolicyDriftError
from graphamp.passes.graph_edit import dtypes_of
from graphamp.node_info import info, peek

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["record_dtypes", "check_dtypes"]


def record_dtypes(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Remember each node's captured (eager-autocast) output dtypes in its ``NodeInfo.captured``."""
    for node in gm.graph.nodes:
        if "val" in node.meta:
            info(node).captured = dtypes_of(node.meta["val"])
    return PassResult(gm, False)


def check_dtypes(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Raise PolicyDriftError at the first node whose dtype differs from eager autocast's."""
    # Where graphamp follows the kernel path eager runs (an LSTM on oneDNN) and capture's fake
    # tensors took another, capture knows nothing of eager's dtypes for those nodes and what is
    # computed from them (the tests compare those with eager directly).
    unknown: set = set()
    for node in gm.graph.nodes:
        record = peek(node)
        if (record is not None and record.eager_kernel) or any(a in unknown for a in node.all_input_nodes):
            unknown.add(node)
            continue
        if record is None or record.captured is None or "val" not in node.meta:
            continue
        now = dtypes_of(node.meta["val"])
        if now != record.captured:
            raise PolicyDriftError(
                f"node {node.name} ({node.format_node()}) has dtypes {now} after graphamp's casts, but "
                f"eager autocast gave {record.captured} (graphamp's reason: {record.reason or 'n/a'}). "
                "graphamp's op lists disagree with the installed torch; please report it. Way out: "
                "pin the op with Config(op_overrides=...), which also turns this check off."
            )
    return PassResult(gm, False)
