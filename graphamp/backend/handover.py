"""Refuse a graph whose hand-over at a graph break makes the code after the break fail.

Outside ``torch.autocast``, dynamo traces and runs the code after a graph break without autocast,
while the graph before it, rewritten by graphamp, hands over its values in eager autocast's dtypes.
Most code takes them as eager autocast does (type promotion picks the same dtype), but an op that
needs one dtype for all its tensors fails where autocast would have cast them: an attention whose
query went through an fp32 rotary embedding and whose value came straight from a bf16 linear; or
a convolution after the break in a layer whose input an earlier graph returned in bf16 (transformers'
Mimi: each layer's graph returns bf16 to the loop that calls the next layer).
Dynamo would raise its own error from the next trace, naming neither graphamp nor the way out; the
backend runs the frame eagerly the way torch.compile will (autocast on up to the break, off after)
and raises :class:`graphamp.GraphBreakError` instead, when that run fails.
"""

from __future__ import annotations

import inspect

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.backend.eager_dtypes import graph_break_line, graph_break_site
from graphamp.backend.observe import Frame, frame_name, handover_error
from graphamp.errors import GraphBreakError

__all__ = ["changed_handover", "check_handover"]


def changed_handover(traced: GraphModule, rewritten: GraphModule) -> list[tuple[int, torch.dtype, torch.dtype]]:
    """The graph outputs whose dtype graphamp's rewrite changed: (index, dynamo's dtype, graphamp's)."""
    before = _output_dtypes(traced, "example_value")
    after = _output_dtypes(rewritten, "val")
    return [(i, a, b) for i, (a, b) in enumerate(zip(before, after)) if a is not None and b is not None and a != b]


def check_handover(
    traced: GraphModule, rewritten: GraphModule, frame: Frame | None, *, device_type: str, dtype: torch.dtype, cache_enabled: bool = True,
) -> None:
    """Raise :class:`GraphBreakError` where ``traced`` ends at a graph break, the frame's code after
    the break gets values in autocast's dtypes (its rewrite hands over values in other dtypes than
    dynamo traced, or the frame was called with low-precision tensors an earlier graph returned) and
    fails on them."""
    line = graph_break_line(traced)
    if frame is None or line is None:
        return
    changed = changed_handover(traced, rewritten)
    low = _low_precision_arguments(frame)
    if not changed and not low:
        return
    error = handover_error(frame, line, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
    if error is None:
        return
    first = next((text.strip() for text in str(error).splitlines() if text.strip()), "")
    handed = ", ".join(
        [f"output {i} in {b} (traced as {a})" for i, a, b in changed[:3]]
        + [f"argument {name!r} in {d}" for name, d in low[:3] if not changed]
    )
    raise GraphBreakError(
        f"dynamo broke {frame_name(frame)} into several graphs at {graph_break_site(traced)}. Called outside "
        f"torch.autocast, the code after that line is traced and run without autocast, and it fails on the "
        f"values in autocast's dtypes it gets ({handed}): {type(error).__name__}: "
        f"{first[:300].rstrip('.')}. Way out: call the compiled model inside torch.autocast({device_type!r}, dtype={dtype}) "
        "(graphamp's casts stay the only ones applied), or remove the graph break (torch._dynamo.explain names it)."
    ) from error


def _low_precision_arguments(frame: Frame) -> list[tuple[str, torch.dtype]]:
    """The frame's floating tensor arguments in a dtype below fp32, by parameter name."""
    try:
        named = list(inspect.signature(frame.fn).bind(*frame.args, **frame.kwargs).arguments.items())
    except (TypeError, ValueError):  # no signature to bind: by position
        named = [*((f"args[{i}]", a) for i, a in enumerate(frame.args)), *frame.kwargs.items()]
    return [
        (name, t.dtype) for name, value in named for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() < 4
    ]


def _output_dtypes(gm: GraphModule, key: str) -> list[torch.dtype | None]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = torch.fx.node.map_arg(output.args[0], lambda n: n.meta.get(key))
    return [getattr(v, "dtype", None) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(values)]
