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
import sys
import types
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.backend.eager_dtypes import graph_break_resume, graph_break_site, instruction_offsets
from graphamp.backend.observe import Frame, TracingMode, fake_float_dtypes, float_dtypes, frame_name, refused_for_two_dtypes, run_frame
from graphamp.errors import GraphBreakError
from graphamp.spec import ambient_autocast

__all__ = ["changed_handover", "check_handover", "handover_error"]


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
    site = graph_break_resume(traced)
    if frame is None or site is None:
        return
    at = site.resume
    line = (at.filename, at.lineno)
    changed = changed_handover(traced, rewritten)
    low = _low_precision_arguments(frame)
    if not changed and not low:
        return
    columns = (at.colno, at.end_colno) if getattr(at, "colno", None) is not None else None
    until = (site.again.filename, site.again.lineno) if site.again is not None else None
    error = handover_error(frame, line, columns=columns, until=until, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
    if error is None:
        return
    first = next((text.strip() for text in str(error).splitlines() if text.strip()), "")
    handed = ", ".join(
        [f"output {i} in {b} (traced as {a})" for i, a, b in changed[:3]]
        + [f"argument {name!r} in {d}" for name, d in low[:3] if not changed]
    )
    where = graph_break_site(traced)
    if site.again is not None:  # a break below a call the frame makes
        where = f"{where}, so its graph ends before the call on {line[0]}:{line[1]}"
    raise GraphBreakError(
        f"dynamo broke {frame_name(frame)} into several graphs at {where}. Called outside "
        f"torch.autocast, the code from there on is traced and run without autocast, and it fails on the "
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


def handover_error(
    frame: Frame, site: tuple[str, int], *, columns: tuple[int, int] | None = None, until: tuple[str, int] | None = None,
    device_type: str, dtype: torch.dtype, cache_enabled: bool = True,
) -> Exception | None:
    """The error dynamo's trace of the code after a graph break on ``site`` (file, line) meets
    outside autocast, where the graph before the break hands over autocast's dtypes; else None.

    The frame's code runs eagerly as ``torch.compile`` runs it: autocast on up to the first time the
    line runs (the graph's program), off from there (dynamo traces the rest without autocast); where
    dynamo recorded the ``columns`` of the instruction it broke at, off from that instruction on the
    line instead (``decoder(backbone(x))``: the backbone is in the graph, the decoder after it).
    Where the break is below that call, dynamo's trace of the callee breaks again at the line
    ``until``: from there to the callee's return, its own graphs (with their own check) run, in
    autocast's dtypes, so this run runs that part under autocast, unwatched, and watches again from
    the return on, with the values it returns. While watched, each call also runs on fake tensors, as dynamo's trace propagates it, and the first
    that fake propagation refuses because its tensors have two floating dtypes (it passes with them
    cast to one) is the answer, as is an error the model's Python raises from the line on (it runs
    in dynamo's trace too). A call fake propagation takes but the real run refuses (a linear on a
    bf16 input and fp32 weights) runs as graphamp's rewrite of the later graph runs it, under
    autocast, its result carried on in the dtypes fake propagation gives. The run stops, answering
    None, where a call runs otherwise than fake propagation says (it fails both ways, or returns
    another dtype), and where it cannot watch lines (a debugger or tracer holds ``sys.settrace``).
    Without grad, buffers, Python caches and random state restored after, as :func:`eager_run`.
    """
    if sys.gettrace() is not None:
        return None
    watch = _LikeDynamoAfter(site, columns, until, device_type, dtype, cache_enabled)
    try:
        run_frame(frame, ambient_autocast(device_type, dtype, cache_enabled=cache_enabled), watch)
    except _MixedDtypes as e:
        return e.__cause__ if isinstance(e.__cause__, Exception) else e
    except _Diverged:  # the run left dynamo's trace: nothing to say
        return None
    except Exception as e:
        # Raised by the model's Python after the line (nn.LSTM's dtype check, which autocast
        # skips): dynamo's trace runs that Python too. Before it, the frame cannot run here.
        return e if watch.reached and not watch.paused else None
    return None


class _MixedDtypes(Exception):
    """Fake propagation refused a call for its tensors' two floating dtypes (the cause)."""


class _Diverged(Exception):
    """A call ran otherwise than fake propagation says: the run no longer follows dynamo's trace."""


class _LikeDynamoAfter(TracingMode):
    """From the first time the line ``site`` runs (the instruction at ``columns`` on it, where given):
    ``device_type``'s autocast off (the enclosing region restores it), and each call checked on fake
    tensors before it runs; from the line ``until`` (where given) to the return of the call it is
    below, autocast on again, unwatched."""

    def __init__(
        self, site: tuple[str, int], columns: tuple[int, int] | None, until: tuple[str, int] | None,
        device_type: str, dtype: torch.dtype, cache_enabled: bool = True,
    ) -> None:
        super().__init__()
        self.filename, self.lineno = site
        self.columns, self.until = columns, until
        self.paused = False  # from the line ``until`` to the return of the call the break is below
        self.root: types.FrameType | None = None  # the frame that makes that call
        self.device_type, self.dtype, self.cache_enabled = device_type, dtype, cache_enabled
        self.reached = False
        self.fake = FakeTensorMode()

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.reached:
            return self._on_event if self.until is not None and frame.f_code.co_filename == self.until[0] else None
        if frame.f_code.co_filename != self.filename:
            return None
        if self._break_offsets(frame.f_code):
            frame.f_trace_opcodes = True
        return self._on_event

    def _on_event(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if not self.reached:
            offsets = self._break_offsets(frame.f_code)
            if (event == "opcode" and frame.f_lasti in offsets) or (event == "line" and frame.f_lineno == self.lineno and not offsets):
                frame.f_trace_opcodes = False
                self.reached, self.root = True, frame
                torch.set_autocast_enabled(self.device_type, False)
        elif self.paused:
            if frame is self.root and event == "opcode":  # the callee returned: dynamo traces the frame again
                frame.f_trace_opcodes, self.paused = False, False
                torch.set_autocast_enabled(self.device_type, False)
        elif event == "line" and frame is not self.root and (frame.f_code.co_filename, frame.f_lineno) == self.until:
            # The callee's own break: its graph's values, as graphamp's graph runs it, up to its return.
            self.paused = True
            torch.set_autocast_enabled(self.device_type, True)
            if self.root is not None:
                self.root.f_trace_opcodes = True
        return self._on_event if not self.reached or self.until is not None else None

    def _break_offsets(self, code: types.CodeType) -> frozenset[int]:
        """The offsets of ``code``'s instructions at the break (none where no columns were recorded
        or none match: the line's start is the break)."""
        return instruction_offsets(code, self.lineno, self.columns)

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.reached or self.paused:
            return func(*args, **kwargs)
        expected = self._fake_dtypes(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if expected is None:
                raise _Diverged from e
            # Fake propagation takes it (a linear on a bf16 input and fp32 weights), so dynamo's
            # trace goes on: the value in autocast's dtypes, as graphamp's rewrite runs it, carried
            # on in the dtype dynamo's trace gives it.
            try:
                with ambient_autocast(self.device_type, self.dtype, cache_enabled=self.cache_enabled):
                    out = _as_dtypes(func(*args, **kwargs), expected)
            except Exception as again:
                raise _Diverged from again
        if expected is not None and float_dtypes(out) != expected:
            raise _Diverged
        return out

    def _fake_dtypes(self, func: Any, args: tuple, kwargs: dict) -> list[torch.dtype] | None:
        """The floating dtypes the call returns on fake tensors; None where fake propagation cannot
        say (an op it does not run, a value it cannot know). Raises :class:`_MixedDtypes`."""
        try:
            return fake_float_dtypes(self.fake, func, args, kwargs)
        except Exception as e:
            if refused_for_two_dtypes(self.fake, func, args, kwargs, e):
                raise _MixedDtypes from e
            return None


def _as_dtypes(value: Any, dtypes: list[torch.dtype]) -> Any:
    """``value`` with its floating tensors cast to ``dtypes``, in order (as many as there are)."""
    leaves, spec = pytree.tree_flatten(value)
    wanted = iter(dtypes)
    cast = [t.to(next(wanted, t.dtype)) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]
    return pytree.tree_unflatten(cast, spec)
