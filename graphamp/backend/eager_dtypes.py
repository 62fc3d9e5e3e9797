"""Give dynamo's graph the dtype constants eager autocast's Python passes, where it traced fp32's.

Outside ``torch.autocast`` dynamo traces the model's Python in fp32, so code that reads a tensor's
dtype bakes fp32's answer into the graph as a constant: RMSNorm's ``h.to(input_dtype)``, a router's
``weights.to(hidden.dtype)``, DeBERTa's ``masked_fill(mask, torch.finfo(scores.dtype).min)``. Under
eager autocast the same lines read bf16 and pass bf16 and its limits. The backend runs the frame
eagerly without and with autocast (:func:`graphamp.backend.observe.dtype_calls`), matches the
graph's calls that pass such constants to the fp32 run's calls in order (a sequence alignment on
the call's name and constants: the graph may hold calls eager skips, such as a mask built only
when compiling, and miss calls made after a graph break), and gives each matched call the
constants of the autocast run. Where the frame cannot run without autocast (after a graph break,
its arguments carry autocast's dtypes), the graph's calls match the autocast run's by name and
line. A constant eager changes that no graph call matches cannot be followed: that is an
``EagerPathWarning`` with the way out.
"""

from __future__ import annotations

import difflib
import dis
import functools
import traceback
import types
import warnings
from typing import NamedTuple

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from graphamp.backend.observe import DtypeCall, EagerRun, Frame, call_name, node_call_site, dtype_calls, dtype_constants, dtype_limits, frame_name
from graphamp.errors import EagerPathWarning

__all__ = ["follow_eager_dtypes", "BreakSite", "graph_break_resume", "graph_break_site", "graph_dtype_calls", "align", "instruction_offsets"]


def graph_dtype_calls(gm: GraphModule) -> list[tuple[Node, DtypeCall]]:
    """The graph's calls that pass dtype constants, in graph order."""
    calls = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            constants = dtype_constants(node.args, node.kwargs)
            if constants:
                calls.append((node, DtypeCall(call_name(node.target), constants, node_call_site(node))))
    return calls


def align(graph: list[DtypeCall], eager: list[DtypeCall]) -> dict[int, int]:
    """Which eager call each graph call is, by the longest matching runs of equal calls.

    >>> a, b, c = DtypeCall("to", (torch.float32,)), DtypeCall("zeros", (torch.float32,)), DtypeCall("full", (torch.float32,))
    >>> align([a, c, b], [a, b])
    {0: 0, 2: 1}
    """
    matcher = difflib.SequenceMatcher(None, graph, eager, autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks() for k in range(block.size)}


def _with_constants(node: Node, constants: tuple) -> None:
    """Replace the node's dtype constants, in order, by ``constants``."""
    remaining = iter(constants)

    def swap(leaf):
        return next(remaining) if dtype_constants((leaf,), {}) else leaf

    node.args, node.kwargs = map_aggregate((node.args, node.kwargs), swap)


def follow_eager_dtypes(
    gm: GraphModule, frame: Frame | None, *, device_type: str, dtype: torch.dtype, low: EagerRun | None = None,
) -> bool:
    """Rewrite the constants of ``gm`` (traced outside autocast) to those eager autocast's Python
    passes; warn about those it cannot match. ``low`` is the frame's eager run under autocast if
    it was made already. Returns whether the graph changed."""
    if frame is None:
        return False
    fp32 = dtype_calls(frame, device_type=device_type, dtype=None)
    low = low.calls if low is not None else dtype_calls(frame, device_type=device_type, dtype=dtype)
    if low is None or fp32 == low:
        return False
    if fp32 is None:
        return _follow_by_site(gm, low, frame, device_type=device_type, dtype=dtype)
    if [(c.name, len(c.constants)) for c in fp32] != [(c.name, len(c.constants)) for c in low]:
        _warn(frame, device_type, dtype, "under autocast it takes another path (other calls pass dtypes)")
        return False
    graph = graph_dtype_calls(gm)
    matched = align([call for _, call in graph], fp32)
    for i, j in matched.items():
        if low[j] != fp32[j]:
            _with_constants(graph[i][0], low[j].constants)
    followed = set(matched.values())
    # A graph that ends at a graph break holds the frame's calls up to its last match; the graph
    # after the break follows the rest itself. A changed call in the graph's span that no node
    # matched is lost.
    span = max(followed, default=-1) + 1 if _ends_at_graph_break(gm) else len(fp32)
    missed = [fp32[j] for j in range(span) if low[j] != fp32[j] and j not in followed]
    if missed:
        _warn(frame, device_type, dtype, f"it passes {_describe(missed, low)} where the graph holds no matching call")
    if matched:
        gm.recompile()
    return bool(matched)


def _follow_by_site(gm: GraphModule, low: list[DtypeCall], frame: Frame, *, device_type: str, dtype: torch.dtype) -> bool:
    """Where the frame cannot run eagerly without autocast, give each graph call the constants of
    the autocast run's call of the same name at the same line. That happens after a graph break:
    the graph before it handed over autocast's dtypes (a bf16 hidden state), which dynamo's fake
    propagation takes into an fp32 linear and an eager run does not. A call at a line that passes
    the low dtype in the autocast run and that no graph call matches is lost (warned)."""
    graph = graph_dtype_calls(gm)
    matched = align([_by_site(call) for _, call in graph], [_by_site(call) for call in low])
    changed = False
    for i, j in matched.items():
        if graph[i][1].constants != low[j].constants:
            _with_constants(graph[i][0], low[j].constants)
            changed = True
    followed = set(matched.values())
    span = max(followed, default=-1) + 1 if _ends_at_graph_break(gm) else len(low)
    limits = dtype_limits(dtype)
    missed = [low[j] for j in range(span) if j not in followed and any(c is dtype or c in limits for c in low[j].constants)]
    if missed:
        _warn(frame, device_type, dtype, f"it passes {_describe(missed, low)} where the graph holds no matching call")
    if changed:
        gm.recompile()
    return changed


def _by_site(call: DtypeCall) -> tuple[str, int, str]:
    return call.name, len(call.constants), call.site


def _ends_at_graph_break(gm: GraphModule) -> bool:
    reason = getattr(gm, "compile_subgraph_reason", None)  # dynamo's, on the graphs it hands over
    return bool(getattr(reason, "graph_break", False))


def graph_break_site(gm: GraphModule) -> str | None:
    """Where and why dynamo broke off the graph ``gm``, for messages: the user's line and the first
    line of dynamo's reason (``"model.py:12 in forward (Failed to trace builtin operator)"``);
    None where the graph ends at the frame's return."""
    if not _ends_at_graph_break(gm):
        return None
    why = next((line.strip() for line in str(gm.compile_subgraph_reason.reason).splitlines() if line.strip()), "no reason given")
    at = _break_frame(gm)
    where = f"{at.filename}:{at.lineno} in {at.name}" if at is not None else "a line dynamo did not record"
    return f"{where} ({why})"


class BreakSite(NamedTuple):
    """Where the frame's code after a graph break begins (``resume``: file, line and, where dynamo
    recorded them, the instruction's columns), and, where that is a call the break is below, the
    line where dynamo's trace of that call breaks again (``again``; None where the break is the
    frame's own)."""

    resume: traceback.FrameSummary
    again: traceback.FrameSummary | None


def graph_break_resume(gm: GraphModule) -> BreakSite | None:
    """Where the frame's code after the break dynamo broke off the graph ``gm`` begins; None where
    the graph ends at the frame's return or dynamo recorded no line.

    A break inside a function the frame calls ends the graph before that call, in the frame itself:
    the call runs as a new frame, traced from its first line (OneFormer's pixel decoder, called with
    the backbone's bf16 features, breaks in a helper far below), up to the same break. So the line is
    the frame's own, the outermost of the user's stack, unless dynamo resumes inside nested calls
    (``torch._dynamo.config.nested_graph_breaks``)."""
    if not _ends_at_graph_break(gm):
        return None
    stack = list(getattr(gm.compile_subgraph_reason, "user_stack", None) or ())
    if not stack:
        return None
    if len(stack) == 1 or bool(getattr(torch._dynamo.config, "nested_graph_breaks", False)):
        return BreakSite(stack[-1], None)
    return BreakSite(stack[0], stack[-1])


@functools.lru_cache(maxsize=256)
def instruction_offsets(code: types.CodeType, lineno: int, columns: tuple[int, int] | None) -> frozenset[int]:
    """The offsets of ``code``'s instructions on line ``lineno`` whose columns are ``columns`` (as
    dynamo records them for the instruction it broke at); empty where ``columns`` is None."""
    if columns is None:
        return frozenset()
    return frozenset(
        i.offset for i in dis.get_instructions(code)
        if i.positions is not None and i.positions.lineno is not None
        and i.positions.lineno <= lineno <= (i.positions.end_lineno or i.positions.lineno)
        and (i.positions.col_offset, i.positions.end_col_offset) == columns
    )


def _break_frame(gm: GraphModule) -> traceback.FrameSummary | None:
    """The innermost frame of the user's stack dynamo recorded at the break, or None."""
    stack = list(getattr(gm.compile_subgraph_reason, "user_stack", None) or ())
    return stack[-1] if stack else None


def _describe(missed: list[DtypeCall], low: list[DtypeCall]) -> str:
    return ", ".join(f"{c.name}(..., {', '.join(map(str, c.constants))})" for c in missed[:3])


def _warn(frame: Frame, device_type: str, dtype: torch.dtype, what: str) -> None:
    warnings.warn(
        f"{frame_name(frame)} reads tensor dtypes to choose its program, and {what}: dynamo, tracing "
        "without autocast, traced the fp32 program there (e.g. RMSNorm's x.to(input_dtype) as a no-op), "
        "so the compiled values may differ from eager autocast's. Way out: call the compiled model inside "
        f"torch.autocast({device_type!r}, dtype={dtype}); graphamp's casts stay the only ones applied.",
        EagerPathWarning,
        stacklevel=4,
    )
