"""Check the code dynamo skips: outside ``torch.autocast`` it runs eagerly, in fp32.

Dynamo runs some of a compiled model's code as plain Python, outside any graph: a frame with a graph
break inside a loop, from the break's function on (transformers' GLM-4V vision tower, Encodec's
encoder), or a frame whose graph break it cannot resume from. Called outside ``torch.autocast``,
that code runs its ops in fp32 where eager autocast runs them in mixed precision, on the values
graphamp's graphs hand over in autocast's dtypes: the model's output can come back in fp32, or an op
fails on two dtypes.

When a graph compiles below such a frame, the backend replays the whole compiled call twice from the
arguments ``torch.compile`` received: under eager autocast, and as the compiled model runs it (the
model's Python reading autocast off, as dynamo traced it; each op of code dynamo compiles in
autocast's dtypes, as graphamp's graphs give them; the ops of skipped code, and of torch's modules it
calls, without autocast). Where the second run fails, :class:`graphamp.GraphBreakError`; where it
returns other values and the skipped code ran an op autocast would have run in another dtype, an
``EagerPathWarning`` naming the outputs. Once per skipped code and model. Where no graph compiles
below the skipped rest of a frame, dynamo skips it on the first call, after the graph before its
break ran: that graph checks it as that first call returns (:func:`rest_checker`,
:func:`after_compiled_call`), or on its second call where a profiler holds ``sys.setprofile``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from graphamp.backend.eager_check import output_difference
from graphamp.backend.observe import Frame, dtype_constants, dtype_limits, fake_float_dtypes, refused_for_two_dtypes, run_frame
from graphamp.errors import CheckSkippedWarning, EagerPathWarning, GraphBreakError
from graphamp.spec import ambient_autocast, autocast_off

__all__ = ["after_compiled_call", "check_skipped_code", "rest_checker", "skipped_frames"]

# Code of these directories is not the model's: an op called from torch's modules (nn.Conv2d.forward)
# runs as the model code that called it does.
_NOT_MODEL = tuple(
    os.path.dirname(p) + os.sep
    for p in (torch.__file__, os.path.dirname(__file__), sysconfig.get_paths()["stdlib"] + os.sep + "x")
)

# The skipped codes already checked, per compiled model (the model, or the compiled function).
_checked: weakref.WeakKeyDictionary[Any, set[types.CodeType]] = weakref.WeakKeyDictionary()


def _dynamo_codes() -> tuple[Any, Any, Callable[[types.CodeType], list[Any]]]:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.convert_frame import input_codes, output_codes

    return input_codes, output_codes, _debug_get_cache_entry_list


def _model_code(code: types.CodeType) -> bool:
    return not code.co_filename.startswith(_NOT_MODEL)


def skipped_frames(current: types.CodeType | None) -> list[types.FrameType]:
    """The model's frames on the Python stack that dynamo saw and runs eagerly (it skipped them, or the
    rest of them from a graph break), innermost first; ``current``: the code being compiled now."""
    try:
        input_codes, output_codes, _ = _dynamo_codes()
    except ImportError:  # private to torch
        return []
    found = []
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code is not current and _model_code(code) and code in input_codes and code not in output_codes:
            found.append(f)
        f = f.f_back
    return found


def _entry_frame() -> types.FrameType | None:
    """The frame of ``torch.compile``'s wrapper for the call running now."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "compile_wrapper" and f.f_code.co_filename.endswith(os.path.join("_dynamo", "eval_frame.py")):
            loc = f.f_locals
            if callable(loc.get("fn")) and isinstance(loc.get("args"), tuple) and isinstance(loc.get("kwargs"), dict):
                return f
        f = f.f_back
    return None


def _compile_entry() -> tuple[Callable[..., Any], tuple, dict[str, Any]] | None:
    """The callable ``torch.compile`` wrapped and the arguments of the call being compiled now."""
    f = _entry_frame()
    return None if f is None else (f.f_locals["fn"], f.f_locals["args"], f.f_locals["kwargs"])


def after_compiled_call(check: Callable[[], None]) -> bool:
    """Run ``check`` as the ``torch.compile``'d call running now returns, after dynamo has run (and
    decided to skip) the rest of its frames: a one-shot ``sys.setprofile`` hook on that call's entry
    frame, in this thread, removed before ``check`` runs. False, and nothing set, where there is no
    such frame or a profiler already holds ``sys.setprofile``."""
    entry = _entry_frame()
    if entry is None or sys.getprofile() is not None:
        return False

    def on_return(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "return" and frame is entry:
            sys.setprofile(None)
            check()

    sys.setprofile(on_return)
    return True


def check_skipped_code(current: Frame | None, *, device_type: str, dtype: torch.dtype, cache_enabled: bool = True) -> None:
    """Raise :class:`GraphBreakError`, or warn, where code dynamo runs eagerly above the frame being
    compiled changes what the compiled model gives outside autocast (see the module's docstring)."""
    code = getattr(getattr(current, "fn", None), "__code__", None)
    frames = skipped_frames(code)
    if frames:
        _check({f.f_code: _name(f.f_code, f.f_locals.get("self")) for f in frames}, code,
               device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)


def rest_checker(current: Frame | None, *, device_type: str, dtype: torch.dtype, cache_enabled: bool = True) -> Callable[[], None] | None:
    """For a graph that ends at a graph break: what checks, once the compiled call that ran this graph
    has returned, the rest of its frame where dynamo runs that rest eagerly and no graph compiles
    below it (dynamo decides on the first call, after this graph ran). Raises or warns as
    :func:`check_skipped_code`."""
    code = getattr(getattr(current, "fn", None), "__code__", None)
    if code is None:
        return None
    owner = current.args[0] if current.args and isinstance(current.args[0], nn.Module) else None

    def check() -> None:
        rest = {c: _name(c, owner) for _, c in _resumed_parts().get(code, ()) if _skipped(c, None)}
        if rest:
            _check(rest, None, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)

    return check


def _check(skipped: dict[types.CodeType, str], current: types.CodeType | None, *, device_type: str, dtype: torch.dtype, cache_enabled: bool) -> None:
    """Replay the compiled call under eager autocast and as the compiled model runs it, once per
    ``skipped`` code (its name) and model; raise or warn on what the skipped code changes."""
    entry = _compile_entry()
    if entry is None:
        warnings.warn(
            f"dynamo runs {', '.join(dict.fromkeys(skipped.values()))} eagerly, outside its graphs, which outside "
            "torch.autocast runs in fp32; graphamp could not find the compiled call to check what that changes.",
            CheckSkippedWarning,
            stacklevel=5,
        )
        return
    fn, args, kwargs = entry
    key = getattr(fn, "__self__", fn)
    try:
        checked = _checked.setdefault(key, set())
    except TypeError:  # not weakly referable: checked on every compile
        checked = set()
    new = [c for c in skipped if c not in checked]
    if not new:
        return
    checked.update(new)
    names = ", ".join(dict.fromkeys(skipped[c] for c in new))
    modules = [m for m in (fn, getattr(fn, "__self__", None)) if isinstance(m, nn.Module)]
    frame = Frame(fn, args, kwargs)
    want = _replay(frame, modules, None, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
    if isinstance(want, BaseException):
        return  # eager autocast itself cannot run the call here: nothing to compare with
    mode = _AsCompiled(current, device_type, dtype, cache_enabled)
    got = _replay(frame, modules, mode, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
    way_out = (
        f"Way out: call the compiled model inside torch.autocast({device_type!r}, dtype={dtype}) (graphamp's casts stay "
        "the only ones applied), or remove the graph break (torch._dynamo.explain names it)."
    )
    where = (f"dynamo runs {names} eagerly, outside its graphs (a graph break in a loop, or one it cannot "
             "resume from). Called outside torch.autocast, that code runs its ops without autocast, in fp32")
    if isinstance(got, BaseException):
        first = next((line.strip() for line in str(got).splitlines() if line.strip()), "")
        raise GraphBreakError(
            f"{where}, and it fails on the values graphamp's graphs hand over in autocast's dtypes: "
            f"{type(got).__name__}: {first[:300].rstrip('.')}. {way_out}"
        ) from got
    differs = _differences(got, want)
    if differs and mode.changed:
        warnings.warn(
            f"{where}, where eager autocast runs {mode.changed} in {dtype}. The compiled model's "
            f"{'; '.join(differs[:4])}. {way_out}",
            EagerPathWarning,
            stacklevel=5,
        )


def _replay(frame: Frame, modules: list[nn.Module], mode: _AsCompiled | None, *, device_type: str, dtype: torch.dtype, cache_enabled: bool) -> Any:
    """The compiled call's result run eagerly: under autocast (``mode`` None), else as ``mode`` runs
    it; the exception where it fails. Without grad, the model's state and random state restored."""
    try:
        if mode is None:
            return run_frame(frame, ambient_autocast(device_type, dtype, cache_enabled=cache_enabled), modules=modules)
        return run_frame(frame, autocast_off((device_type,)), mode, modules=modules)
    except Exception as e:
        return e


class _AsCompiled(TorchFunctionMode):
    """Run each op as the compiled model does outside autocast: without autocast where the model code
    calling it runs eagerly (dynamo skipped it), else under autocast to ``dtype``, as graphamp's graph
    of that code gives it. ``changed``: the first op of eagerly run code whose dtype autocast changes."""

    def __init__(self, current: types.CodeType | None, device_type: str, dtype: torch.dtype, cache_enabled: bool) -> None:
        super().__init__()
        self.device_type, self.dtype, self.cache_enabled = device_type, dtype, cache_enabled
        self.current = current
        self.changed: str | None = None
        self.fake = FakeTensorMode()
        self.nesting = 0
        self.eager_from = _eager_regions(current)
        self.break_lines = {code: {line for line, _ in starts} for code, starts in self.eager_from.items()}  # where dynamo resumed each code
        self.limits = dtype_limits(dtype)
        self.skipped: dict[types.CodeType, bool] = {}  # dynamo compiles nothing while the replay runs
        self.outside: set[int] = set()
        # Each tensor computed in a frame dynamo has yet to trace: (that frame, its dtype in the trace).
        self.traced: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __enter__(self) -> Any:
        self.nesting = _autocast_nesting()
        self.outside = set(map(id, _stack(sys._getframe(1))))  # frames above the replay
        return super().__enter__()

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _autocast_nesting() > self.nesting:
            return func(*args, **kwargs)  # inside the model's own torch.autocast region: as it says
        caller = _model_caller(sys._getframe(1))
        if caller is not None and self._runs_eagerly(caller):
            if self.changed is None and self._autocast_changes(func, args, kwargs):
                self.changed = f"{getattr(func, '__name__', func)} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
            return func(*args, **kwargs)
        root = self._unseen_root(caller)
        traced = self._traced_dtypes(func, args, kwargs, root, caller) if root is not None else None
        with ambient_autocast(self.device_type, self.dtype, cache_enabled=self.cache_enabled):
            out = func(*args, **kwargs)
        if root is not None:  # each tensor it returns: its traced dtype, or None where not known
            floating = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            for t, d in zip(floating, traced if traced is not None and len(traced) == len(floating) else [None] * len(floating)):
                self.traced[t] = (root, d)
        return out

    def _unseen_root(self, caller: types.FrameType | None) -> types.FrameType | None:
        """The frame dynamo will trace ``caller``'s code in, where dynamo has not seen it yet; None
        where that code runs eagerly, dynamo saw the frame's code already (it traced it, with its
        graphs and checks), or there is none. From the replay's top down: a frame called from code
        run eagerly, or from a traced frame at one of its graph breaks, is a frame of its own (traced,
        or run eagerly where dynamo skips its code); one a traced frame calls elsewhere is inlined."""
        frames = []
        f = caller
        while f is not None and id(f) not in self.outside:
            if _model_code(f.f_code):
                frames.append(f)
            f = f.f_back
        root: types.FrameType | None = None
        parent: types.FrameType | None = None
        for f in reversed(frames):
            if parent is None or root is None or parent.f_lineno in self.break_lines.get(parent.f_code, ()):
                root = None if self._runs_eagerly(f) else f
            parent = f
        input_codes, _, _ = _dynamo_codes()
        return root if root is not None and root.f_code not in input_codes else None

    def _traced_dtypes(self, func: Any, args: tuple, kwargs: dict, root: types.FrameType, caller: types.FrameType) -> list[torch.dtype] | None:
        """The floating dtypes the call returns in dynamo's trace of ``root`` (without autocast, each
        tensor computed in that frame in the dtype the trace gave it, others as they are); None where
        this run cannot say: fake propagation cannot, a tensor's traced dtype is not known, or the call
        passes autocast's dtype as a constant (the model's Python read it from a tensor here, where the
        trace reads fp32). Raises :class:`_TraceRefuses` where the trace refuses the call for its
        tensors' two dtypes, as dynamo's will."""
        known = True

        def as_traced(t: torch.Tensor) -> torch.Tensor:
            nonlocal known
            at, dtype = self.traced.get(t, (None, t.dtype))
            if at is not root:
                return t
            if dtype is None:
                known = False
                return t
            return t.to(dtype) if dtype != t.dtype else t

        if any(c is self.dtype or (type(c) is float and c in self.limits) for c in dtype_constants(args, kwargs)):
            return None
        traced_args, traced_kwargs = pytree.tree_map_only(torch.Tensor, as_traced, (args, kwargs))
        if not known:
            return None
        try:
            return fake_float_dtypes(self.fake, func, traced_args, traced_kwargs)
        except Exception as e:
            if refused_for_two_dtypes(self.fake, func, traced_args, traced_kwargs, e):
                first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
                raise _TraceRefuses(
                    f"dynamo's trace of {_name(root.f_code, root.f_locals.get('self'))}, called from that code and traced "
                    f"without autocast, refuses {getattr(func, '__name__', func)} on {os.path.basename(caller.f_code.co_filename)}:"
                    f"{caller.f_lineno}: {first}"
                ) from e
            return None

    def _runs_eagerly(self, f: types.FrameType) -> bool:
        code = f.f_code
        starts = self.eager_from.get(code)
        if starts:
            eager = None
            for line, skipped in starts:
                if line <= f.f_lineno:
                    eager = skipped
            if eager is not None:
                return eager
        if code not in self.skipped:
            self.skipped[code] = _skipped(code, self.current)
        return self.skipped[code]

    def _autocast_changes(self, func: Any, args: tuple, kwargs: dict) -> bool:
        try:
            off = fake_float_dtypes(self.fake, func, args, kwargs)
            with ambient_autocast(self.device_type, self.dtype):
                on = fake_float_dtypes(self.fake, func, args, kwargs)
        except Exception:  # fake propagation cannot say
            return False
        return off != on


class _TraceRefuses(RuntimeError):
    """Dynamo's trace, without autocast, of code the skipped code calls refuses a call for its
    tensors' two floating dtypes: torch.compile will raise there."""


def _stack(f: types.FrameType | None) -> list[types.FrameType]:
    found = []
    while f is not None:
        found.append(f)
        f = f.f_back
    return found


def _skipped(code: types.CodeType, current: types.CodeType | None) -> bool:
    """Whether dynamo runs ``code`` eagerly: it saw the code and holds no compiled entry for it."""
    input_codes, output_codes, entries = _dynamo_codes()
    return code is not current and code in input_codes and code not in output_codes and not entries(code)


def _eager_regions(current: types.CodeType | None) -> dict[types.CodeType, list[tuple[int, bool]]]:
    """For each function dynamo resumed after a graph break: (the line each resumed part starts at,
    whether dynamo runs that part eagerly), by line."""
    return {
        origin: sorted((line, _skipped(code, current)) for line, code in parts)
        for origin, parts in _resumed_parts().items()
    }


def _resumed_parts() -> dict[types.CodeType, list[tuple[int, types.CodeType]]]:
    """For each function dynamo resumed after a graph break: (the line it resumes at, the resume
    function's code), by line."""
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache
    except ImportError:  # private to torch
        return {}
    cache = ContinueExecutionCache.cache  # dynamo's ExactWeakKeyDictionary: the code each resumes
    parent: dict[types.CodeType, types.CodeType] = {}
    for idx, ref in list(getattr(cache, "refs", {}).items()):
        origin = ref()
        for code in (cache.values.get(idx) or {}).values() if origin is not None else ():
            parent[code] = origin
    parts: dict[types.CodeType, list[tuple[int, types.CodeType]]] = {}
    for code, origin in parent.items():
        while origin in parent:
            origin = parent[origin]
        parts.setdefault(origin, []).append((code.co_firstlineno, code))
    return {origin: sorted(found, key=lambda part: part[0]) for origin, found in parts.items()}


def _model_caller(f: types.FrameType | None) -> types.FrameType | None:
    while f is not None and not _model_code(f.f_code):
        f = f.f_back
    return f


def _autocast_nesting() -> int:
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level - 1


def _differences(got: Any, want: Any) -> list[str]:
    """Each output where ``got`` differs from ``want``: ``output<path> (tensor #i): how``."""
    got_leaves = pytree.tree_flatten_with_path(got)[0]
    want_leaves = pytree.tree_flatten_with_path(want)[0]
    if len(got_leaves) != len(want_leaves):
        return ["output: another structure than eager autocast's"]
    found = []
    tensors = 0
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        if not isinstance(a, torch.Tensor):
            continue
        how = output_difference(a, b)
        if how:
            found.append(f"output{pytree.keystr(path)} (tensor #{tensors}): {how}")
        tensors += 1
    return found


def _name(code: types.CodeType, owner: Any) -> str:
    """``Owner.function (file from line N)``: the function a (resume) code runs, on ``owner``'s type."""
    name = code.co_name
    start = ""
    if name.startswith("torch_dynamo_resume_in_"):
        base, _, line = name[len("torch_dynamo_resume_in_"):].rpartition("_at_")
        name, start = base, f" from line {line}"
    qual = f"{type(owner).__name__}.{name}" if owner is not None and not isinstance(owner, type) else name
    return f"{qual} ({os.path.basename(code.co_filename)}{start})"
