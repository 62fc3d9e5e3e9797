"""Give dynamo's graph the ``autocast(enabled=False)`` regions eager autocast's Python enters.

Model code may switch autocast off only where it is on: transformers' ``maybe_autocast(...,
enabled=False)`` enters ``torch.autocast(enabled=False)`` when autocast is enabled and does nothing
otherwise, to keep attention scores or a router in fp32 (Flint, Inkling, HunYuan-VL). Outside
``torch.autocast`` dynamo traces that code with no region at all, so graphamp's policy would run
the region's matmul in low precision where eager autocast runs it in fp32. The backend's eager run
under autocast (:func:`graphamp.backend.observe.eager_run`) records the model code's call sites
that ran only with autocast off; here the graph's nodes traced from those sites are wrapped in
``_enter_autocast(device, None, False, None)`` ... ``_exit_autocast`` markers, as dynamo records a
region it sees, so the re-trace runs them with autocast off, as eager did.
"""

from __future__ import annotations

from collections.abc import Set

import torch
from torch.fx import GraphModule, Node

from graphamp.backend.observe import node_call_site

__all__ = ["follow_eager_regions"]

_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


def _runs_off(gm: GraphModule, off_sites: Set[str]) -> list[list[Node]]:
    """The graph's consecutive calls traced from ``off_sites``, outside any region the graph holds."""
    runs: list[list[Node]] = []
    current: list[Node] = []
    depth = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.target is _ENTER:
            depth += 1
        elif node.target is _EXIT:
            depth -= 1
        if depth == 0 and node.target is not _EXIT and node_call_site(node) in off_sites:
            current.append(node)
            continue
        if current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def follow_eager_regions(gm: GraphModule, off_sites: Set[str], *, device_type: str) -> bool:
    """Wrap the nodes of ``gm`` traced from code eager autocast ran with autocast off in an
    ``autocast(enabled=False)`` region; returns whether the graph changed."""
    if not off_sites:
        return False
    runs = _runs_off(gm, off_sites)
    for run in runs:
        with gm.graph.inserting_before(run[0]):
            enter = gm.graph.call_function(_ENTER, (device_type, None, False, None))
        with gm.graph.inserting_after(run[-1]):
            gm.graph.call_function(_EXIT, (enter,))
    if runs:
        gm.recompile()
    return bool(runs)
