"""Name the torch calls dynamo runs eagerly at a graph break that autocast would run otherwise.

At a graph break dynamo ends the graph, runs the instruction it could not trace as plain Python, and
traces the code after it as a new graph, which graphamp rewrites and checks as any other. Called
outside ``torch.autocast``, that one instruction runs without autocast: where it makes a torch call
autocast casts (a matmul in a function marked ``torch.compiler.disable``, an op dynamo cannot
trace), its result differs from eager autocast's. Most breaks make no such call (``.item()``,
``print``, a branch on a tensor's value). The backend runs the frame eagerly under autocast and
replays each torch call the instruction makes without autocast, on copies of its arguments and with
the same random state: the calls whose results differ are the ones to name.
"""

from __future__ import annotations

import sys
import traceback
import types
import warnings
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.backend.eager_check import output_difference, say_skipped
from graphamp.backend.eager_dtypes import graph_break_resume, graph_break_site, instruction_offsets
from graphamp.backend.observe import Frame, TracingMode, call_name, eager_call_site, frame_name, run_frame
from graphamp.eager import RngState
from graphamp.errors import EagerPathWarning
from graphamp.spec import ambient_autocast, autocast_off

__all__ = ["break_call_differences", "check_break_calls"]


def break_call_differences(
    frame: Frame, at: traceback.FrameSummary, *, device_type: str, dtype: torch.dtype, cache_enabled: bool = True,
) -> list[str] | None:
    """The torch calls the instruction dynamo broke at (``at``: its file, line and columns) makes
    whose results differ without autocast, each described (``"matmul on model.py:12 gives
    torch.float32 where eager autocast gives torch.bfloat16 (...)"``); ``[]`` where none differs; None where that cannot be
    observed: dynamo recorded no columns (python < 3.11), a tracer holds ``sys.settrace``, or the
    frame's eager run under autocast does not reach the instruction. Without grad, buffers, Python
    caches and random state restored after, as :func:`graphamp.backend.observe.eager_run`."""
    columns = (getattr(at, "colno", None), getattr(at, "end_colno", None))
    if None in columns or at.lineno is None or sys.gettrace() is not None:
        return None
    watch = _AtInstruction(at.filename, at.lineno, columns, device_type)  # type: ignore[arg-type]
    try:
        run_frame(frame, ambient_autocast(device_type, dtype, cache_enabled=cache_enabled), watch)
    except Exception:  # noqa: S110 - judged by what ran: an instruction that ran whole is observed
        pass
    return watch.differences if watch.done else None


class _AtInstruction(TracingMode):
    """Replays without autocast each torch call made while the first frame that reaches the
    instruction at (``filename``, ``lineno``, ``columns``) runs it, the first time, and keeps the
    calls whose results differ."""

    def __init__(self, filename: str, lineno: int, columns: tuple[int, int], device_type: str) -> None:
        super().__init__()
        self.filename, self.lineno, self.columns = filename, lineno, columns
        self.device_type = device_type
        self.frame: types.FrameType | None = None  # the frame running the instruction
        self.recording = False
        self.done = False
        self.differences: list[str] = []

    def _offsets(self, code: types.CodeType) -> frozenset[int]:
        return instruction_offsets(code, self.lineno, self.columns) if code.co_filename == self.filename else frozenset()

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.done or self.frame is not None or not self._offsets(frame.f_code):
            return None
        frame.f_trace_opcodes = True
        return self._on_event

    def _on_event(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.done or (self.frame is not None and frame is not self.frame):
            return None
        if event == "opcode":
            at = frame.f_lasti in self._offsets(frame.f_code)
            if at and self.frame is None:
                self.frame = frame
            elif not at and self.recording:  # the instruction ran whole
                self.done, frame.f_trace_opcodes = True, False
            self.recording = at and not self.done
        elif event == "return" and self.recording:
            self.done = True
        return None if self.done else self._on_event

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.recording:
            return func(*args, **kwargs)
        copies = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        before = RngState()
        out = func(*args, **kwargs)
        after = RngState()
        before.restore()
        try:
            with autocast_off((self.device_type,)):
                again = func(*copies[0], **copies[1])
        except Exception as e:  # runs under autocast only: as compiled, the call fails
            self.differences.append(f"{self._call(func)} raises {type(e).__name__} without autocast")
            return out
        finally:
            after.restore()
        said = _difference(again, out)
        if said:
            self.differences.append(f"{self._call(func)} gives {said}")
        return out

    @staticmethod
    def _call(func: Any) -> str:
        site = eager_call_site()
        return f"{call_name(func)} on {site}" if site else call_name(func)


def _difference(without: Any, under: Any) -> str:
    """How the call's result without autocast differs from its result under it; empty if equal."""
    a, b = pytree.tree_leaves(without), pytree.tree_leaves(under)
    if len(a) != len(b):
        return f"{len(a)} values where eager autocast gives {len(b)}"
    return next((said for said in map(output_difference, a, b) if said), "")


def check_break_calls(gm: GraphModule, frame: Frame | None, *, device_type: str, dtype: torch.dtype, cache_enabled: bool = True) -> None:
    """Where ``gm`` ends at a graph break: warn (EagerPathWarning) naming the calls the instruction
    dynamo runs eagerly there makes whose results differ without autocast; say (CheckSkippedWarning,
    reason ``"break_instruction"``) where that cannot be observed; nothing where none differs."""
    site, at = graph_break_site(gm), graph_break_resume(gm)
    if site is None:
        return
    name = frame_name(frame) if frame is not None else "the frame dynamo compiles"
    where = (at.again or at.resume) if at is not None else None
    differences = (
        break_call_differences(frame, where, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
        if frame is not None and where is not None else None
    )
    if differences is None:
        say_skipped(name, "break_instruction", frame=frame, message=(
            f"dynamo broke it into several graphs at {site} and runs that instruction eagerly, without autocast "
            "where the model is called outside torch.autocast; graphamp could not observe it (no frame to run, "
            "no instruction columns before python 3.11, a tracer holding sys.settrace, or a run that does not reach it) "
            "to compare its torch calls with eager autocast's."
        ))
        return
    if differences:
        warnings.warn(
            f"dynamo broke {name} into several graphs at {site} and runs that instruction eagerly, between its "
            f"graphs. Called outside torch.autocast it runs without autocast, where eager autocast casts: "
            f"{'; '.join(differences[:3])}{'; ...' if len(differences) > 3 else ''}. Values computed from it differ from "
            f"eager autocast's. Way out: call the compiled model inside torch.autocast({device_type!r}, dtype={dtype}) "
            "(graphamp's casts stay the only ones applied), or remove the graph break (torch._dynamo.explain names it).",
            EagerPathWarning,
            stacklevel=4,
        )
