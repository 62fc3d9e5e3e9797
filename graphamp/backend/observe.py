"""Observe the eager program of the frame dynamo compiles, for choices its graph cannot see.

Model code may read ``torch.compiler.is_compiling()`` and run another, forward-equivalent program
when compiled (transformers materialises the causal mask and repeats grouped key/value heads),
whose gradients round differently. ``graphamp.convert`` traces with eager's flags; dynamo folds
``is_compiling()`` to True while tracing, and a backend only sees the graph afterwards. So, as
``convert`` does with :func:`graphamp.probe.eager_sdpa_calls`, the backend runs the code dynamo is
compiling once eagerly on the frame's own arguments (no grad, autocast on, the compiling flags
off, buffers and random state restored) and records what :mod:`graphamp.passes.follow_eager_attention`
asks for. It does so only when the graph holds the attention that needs it: other graphs pay nothing.

The frame comes from dynamo's tracer (its code, globals, closure and argument values at entry),
which is private to torch; if it is not there, or the eager run fails, the graph keeps the program
dynamo traced.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.fx import GraphModule
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from graphamp.errors import EagerPathWarning
from graphamp.passes.follow_eager_attention import EAGER_SDPA, SDPA, repeated_heads
from graphamp.probe import SdpaCall, _state_restored, eager_sdpa_calls
from graphamp.spec import ambient_autocast

__all__ = ["Frame", "compiled_frame", "dtype_arguments", "observe_eager_frame", "warn_if_fp32_program"]


class Frame(NamedTuple):
    """The function dynamo is compiling and the arguments it was entered with."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]


def compiled_frame() -> Frame | None:
    """The frame dynamo is compiling now, rebuilt as a callable and its arguments; None outside
    a dynamo compile or where the frame cannot be rebuilt."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, f_locals = tx.f_code, tx.f_locals
        fn = types.FunctionType(code, tx.f_globals, code.co_name, None, tx.closure)
        return Frame(fn, *frame_arguments(code, f_locals))
    except Exception:  # private to torch: a frame that is not there just skips the observation
        return None


def frame_arguments(code: types.CodeType, f_locals: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments that call ``code``'s function as it was entered.

    >>> def f(a, *rest, k=1, **more): pass
    >>> frame_arguments(f.__code__, {"a": 1, "rest": (2, 3), "k": 4, "more": {"m": 5}})
    ((1, 2, 3), {'k': 4, 'm': 5})
    """
    names = code.co_varnames
    positional = tuple(f_locals[name] for name in names[: code.co_argcount])
    end = code.co_argcount + code.co_kwonlyargcount
    keywords = {name: f_locals[name] for name in names[code.co_argcount : end]}
    if code.co_flags & inspect.CO_VARARGS:
        positional += tuple(f_locals[names[end]])
        end += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        keywords.update(f_locals[names[end]])
    return positional, keywords


class _EagerCall(nn.Module):
    """The frame as a module: the modules it reaches are submodules, so the probe restores their
    buffers; the compiling flags read False inside, as they do in eager."""

    def __init__(self, fn: Callable[..., Any], modules: list[nn.Module]) -> None:
        super().__init__()
        self.fn = fn
        # Borrowed, not modified: registering a module as a child leaves the module itself alone.
        self.reached = nn.ModuleList(modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        saved = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
        torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = False
        try:
            return self.fn(*args, **kwargs)
        finally:
            torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = saved


def _modules_reached(frame: Frame) -> list[nn.Module]:
    closure = [cell.cell_contents for cell in getattr(frame.fn, "__closure__", None) or () if _filled(cell)]
    values = [*frame.args, *frame.kwargs.values(), *closure]
    found: dict[int, nn.Module] = {}
    for value in values:
        if isinstance(value, nn.Module):
            found.setdefault(id(value), value)
    return list(found.values())


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _fresh(value: Any) -> Any:
    """An argument the eager run may change, copied: a Hugging Face key/value cache grows when the
    frame runs, and dynamo's guards on it would then fail ("Guard failed on the same frame")."""
    if value is None or isinstance(value, (torch.Tensor, nn.Module, int, float, bool, str, bytes, torch.dtype, torch.device)) or callable(value):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied is passed as it is
        return value


def _fresh_arguments(frame: Frame) -> tuple[tuple, dict[str, Any]]:
    return pytree.tree_map(_fresh, (tuple(frame.args), dict(frame.kwargs)))


def eager_frame_sdpa_calls(frame: Frame, *, device_type: str, dtype: torch.dtype) -> list[SdpaCall] | None:
    """The SDPA calls the frame makes under eager autocast, in order; None if it cannot run."""
    call = _EagerCall(frame.fn, _modules_reached(frame))
    args, kwargs = _fresh_arguments(frame)
    return eager_sdpa_calls(call, args, kwargs, device_type=device_type, dtype=dtype)


def observe_eager_frame(gm: GraphModule, *, device_type: str, dtype: torch.dtype, frame: Frame | None) -> None:
    """Record in ``gm.meta`` eager's SDPA calls for the graph's own, where the graph repeats
    key/value heads (the only program choice graphamp follows so far).

    The graph holds the frame's program from its entry up to the end or the first graph break,
    so its SDPA calls are the first of the frame's eager calls.
    """
    nodes = gm.graph.find_nodes(op="call_function", target=SDPA)
    if frame is None or not any(repeated_heads(n.args[1]) for n in nodes):
        return
    calls = eager_frame_sdpa_calls(frame, device_type=device_type, dtype=dtype)
    if calls is not None and len(calls) >= len(nodes):
        gm.meta[EAGER_SDPA] = calls[: len(nodes)]


class _RecordDtypes(TorchFunctionMode):
    """Every (function, dtype) pair the code passes a ``torch.dtype`` to: ``x.to(input_dtype)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: set[tuple[str, torch.dtype]] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.dtype):
                self.calls.add((getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func)), leaf))
        return func(*args, **kwargs)


def dtype_arguments(frame: Frame, *, device_type: str, dtype: torch.dtype | None) -> set[tuple[str, torch.dtype]] | None:
    """The (function, dtype) pairs the frame's code passes when run eagerly, under autocast to
    ``dtype`` (None: without autocast); None if it cannot run.

    A set, not a sequence: how often a loop runs may depend on values (which experts a router
    picks), and those differ between the two runs without the code choosing another program.
    """
    call = _EagerCall(frame.fn, _modules_reached(frame))
    recorder = _RecordDtypes()
    region = ambient_autocast(device_type, dtype) if dtype is not None else contextlib.nullcontext()
    try:
        args, kwargs = _fresh_arguments(frame)
        with _state_restored(call), torch.no_grad(), region, recorder:
            call(*args, **kwargs)
    except Exception:  # advisory, as the attention probe: code that cannot run here is not judged
        return None
    return recorder.calls


def _name_of(frame: Frame) -> str:
    modules = _modules_reached(frame)
    return f"{type(modules[0]).__name__}.forward" if modules else frame.fn.__qualname__


def warn_if_fp32_program(frame: Frame | None, *, device_type: str, dtype: torch.dtype) -> bool:
    """Warn if the frame's code, which dynamo traced without autocast, passes other dtypes under
    autocast (``x.to(input_dtype)`` after reading a tensor's dtype): the graph holds the fp32
    program's choices, so its values may differ from eager autocast's. Returns whether it warned.
    """
    if frame is None:
        return False
    low = dtype_arguments(frame, device_type=device_type, dtype=dtype)
    fp32 = dtype_arguments(frame, device_type=device_type, dtype=None)
    if low is None or fp32 is None or low == fp32:
        return False
    only_low = sorted(f"{name}(..., {d})" for name, d in low - fp32)
    warnings.warn(
        f"{_name_of(frame)} reads tensor dtypes to choose its program: under autocast it calls "
        f"{', '.join(only_low[:4]) or 'other dtype arguments'}, which dynamo, tracing without autocast, "
        "did not see (it traced the fp32 program, e.g. RMSNorm's x.to(input_dtype) as a no-op), so the "
        "compiled values may differ from eager autocast's. Way out: call the compiled model inside "
        f"torch.autocast({device_type!r}, dtype={dtype}); graphamp's casts stay the only ones applied.",
        EagerPathWarning,
        stacklevel=3,
    )
    return True
