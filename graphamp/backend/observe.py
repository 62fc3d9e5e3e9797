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
import os
import re
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.fx import GraphModule
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from graphamp.eager import fresh_tensor, state_restored
from graphamp.node_info import graph_info
from graphamp.passes.follow_eager_attention import SDPA, repeated_heads
from graphamp.probe import SdpaCall, eager_sdpa_calls
from graphamp.spec import ambient_autocast, autocast_off

__all__ = [
    "DtypeCall", "EagerRun", "Frame", "eager_backward", "eager_run", "fake_float_dtypes", "float_dtypes", "refused_for_two_dtypes", "call_name", "compiled_frame", "dtype_calls", "dtype_constants", "dtype_limits",
    "Returned", "TracingMode", "frame_name", "observe_eager_frame", "returned_outputs", "run_frame", "under_dynamo",
]


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


def under_dynamo() -> bool:
    """Whether dynamo is compiling a frame now (the backend was called by ``torch.compile``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx() is not None
    except Exception:  # private to torch
        return False


class Returned(NamedTuple):
    """Where the frame returns the outputs of dynamo's graph (:func:`returned_outputs`): ``paths``,
    the pytree key path of each output's first place in the return value, by output index; and
    ``unread``, the types of the objects in it whose contents dynamo's tracer does not list (a
    transformers ``DynamicCache``, a Python number the graph computes), whose outputs have no path."""

    paths: dict[int, tuple[Any, ...]]
    unread: tuple[str, ...]


def returned_outputs(traced: GraphModule) -> Returned | None:
    """Where in the frame's return value each output of dynamo's graph ``traced`` is returned.
    Outputs the frame does not return (a tensor it stores on an attribute) have no path, nor do
    returned tensors the frame received (they are no graph's), nor those inside an object the tracer
    does not list (``Returned.unread`` names it). Read from dynamo's tracer while it compiles the
    frame's ``return``; None where the tracer is not there.

    The graph's outputs are the return value's tensors deduplicated and side effects' tensors, in
    the order dynamo's code generation meets them; reading the return value's variables is what
    pairs each with its place, so outputs are compared by position, not by value.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        reason = tx.output.compile_subgraph_reason
        if reason is None or reason.reason != "return_value" or reason.graph_break or not tx.stack:
            return None
        returned = tx.stack[-1]
        outputs = traced.graph.output_node().args[0]
        nodes = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        index = {id(n): j for j, n in reversed(list(enumerate(nodes))) if isinstance(n, torch.fx.Node)}
        names = {n.name: j for j, n in reversed(list(enumerate(nodes))) if isinstance(n, torch.fx.Node)}
        found: dict[int, tuple[Any, ...]] = {}
        unread: list[str] = []
        _walk_returned(returned, (), index, names, found, unread)
        return Returned(found, tuple(dict.fromkeys(unread)))
    except Exception:  # private to torch: pair otherwise
        return None


def _walk_returned(
    vt: Any, path: tuple[Any, ...], index: dict[int, int], names: dict[str, int], found: dict[int, tuple[Any, ...]], unread: list[str],
) -> None:
    from torch._dynamo.variables import ConstantVariable, ConstDictVariable, SymNodeVariable, TensorVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker
    from torch._dynamo.variables.lists import BaseListVariable

    if isinstance(vt, LazyVariableTracker):
        if not vt.is_realized():
            return  # a value the frame received, untouched: loaded from its source, no graph's output
        vt = vt.realize()
    if isinstance(vt, TensorVariable):
        if type(vt) is not TensorVariable:
            unread.append("Python number or NumPy array")  # one the graph computes: no tensor in the return value
            return
        node = vt.as_proxy().node
        j = index.get(id(node), names.get(node.name) if node.op != "placeholder" else None)
        if j is not None:
            found.setdefault(j, path)
        return
    if isinstance(vt, (ConstantVariable, SymNodeVariable)):
        return
    base = getattr(vt, "_base_vt", None)  # a user-defined dict, tuple or list (ModelOutput, a namedtuple)
    if isinstance(base, (ConstDictVariable, BaseListVariable)):
        vt = base
    if isinstance(vt, BaseListVariable):
        for i, item in enumerate(vt.items):
            _walk_returned(item, (*path, pytree.SequenceKey(i)), index, names, found, unread)
        return
    if isinstance(vt, ConstDictVariable):
        for key, item in vt.items.items():
            _walk_returned(item, (*path, pytree.MappingKey(key.vt.as_python_constant())), index, names, found, unread)
        return
    if getattr(vt, "source", None) is not None and not vt.is_mutable():
        return  # an object the frame received and returns unchanged
    value = getattr(vt, "value", None)  # the Python object, where the variable tracks one
    unread.append(type(value).__name__ if value is not None else type(vt).__name__)


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


def _fresh(value: Any, storages: dict[Any, Any]) -> Any:
    """An argument the eager run may change, copied: a Hugging Face key/value cache grows when the
    frame runs, and dynamo's guards on it would then fail ("Guard failed on the same frame"); a
    tensor may be written in place (``hidden_states[mask] += x``), and the call that compiles the
    frame then runs it on the same tensor (:func:`graphamp.eager.fresh_tensor`)."""
    if isinstance(value, torch.Tensor):
        return fresh_tensor(value, storages)
    if value is None or isinstance(value, (nn.Module, int, float, bool, str, bytes, torch.dtype, torch.device)) or callable(value):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied is passed as it is
        return value


def _fresh_arguments(frame: Frame) -> tuple[tuple, dict[str, Any]]:
    """The frame's arguments for an eager run, copied where it could change them (the substitutes
    of :func:`eager_backward` are leaves that require grad: passed as they are)."""
    storages: dict[Any, Any] = {}
    return pytree.tree_map(lambda v: _fresh(v, storages), (tuple(frame.args), dict(frame.kwargs)))


def eager_frame_sdpa_calls(frame: Frame, *, device_type: str, dtype: torch.dtype) -> list[SdpaCall] | None:
    """The SDPA calls the frame makes under eager autocast, in order; None if it cannot run."""
    call = _EagerCall(frame.fn, _modules_reached(frame))
    args, kwargs = _fresh_arguments(frame)
    return eager_sdpa_calls(call, args, kwargs, device_type=device_type, dtype=dtype)


def observe_eager_frame(
    gm: GraphModule, *, device_type: str, dtype: torch.dtype, frame: Frame | None, calls: list[SdpaCall] | None = None,
) -> None:
    """Record in the graph's GraphInfo eager's SDPA calls for the graph's own, where the graph repeats
    key/value heads (the program choice :mod:`graphamp.passes.follow_eager_attention` follows);
    ``calls``: the frame's eager calls, already observed (the frame is then not run again).

    The graph holds the frame's program from its entry up to the end or the first graph break,
    so its SDPA calls are the first of the frame's eager calls.
    """
    nodes = gm.graph.find_nodes(op="call_function", target=SDPA)
    if (frame is None and calls is None) or not any(repeated_heads(n.args[1]) for n in nodes):
        return
    if calls is None:
        calls = eager_frame_sdpa_calls(frame, device_type=device_type, dtype=dtype)
    if calls is not None and len(calls) >= len(nodes):
        graph_info(gm).eager_sdpa = calls[: len(nodes)]


class DtypeCall(NamedTuple):
    """One call that passes a floating dtype (or a constant read from one): ``x.to(input_dtype)``."""

    name: str
    constants: tuple[Any, ...]
    # Where the model's code makes the call (file:line). Calls alike in name and constants (a
    # literal x.to(torch.float32) and an x.to(input_dtype) that fp32 reads as float32) align
    # only at the same line, so a call eager makes alone (a branch dynamo does not take) cannot
    # lend its constants to another.
    site: str = ""


# Frames in these directories are not the model's call site: torch's, and the backend's own
# (the recorder, the eager call). graphamp's other modules may hold models (graphamp.testing).
_LIBRARIES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
_STACK_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def eager_call_site() -> str:
    """``file:line`` of the innermost frame outside torch and graphamp's backend: the model code's call."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


def node_call_site(node: Any) -> str:
    """``file:line`` of the model code's call a graph node was traced from: the innermost frame of
    its stack trace outside torch and graphamp's backend, as :func:`eager_call_site` finds it."""
    frames = [f for f in _STACK_FRAME.findall(node.meta.get("stack_trace") or "") if not f[0].startswith(_LIBRARIES)]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


def dtype_constants(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The floating dtypes, and floats that are a floating dtype's ``finfo`` limit, among a call's
    arguments, in pytree order: the values code derives from a tensor's dtype.

    >>> dtype_constants((1, torch.float32), {"value": torch.finfo(torch.float32).min, "k": 2.0})
    (torch.float32, -3.4028234663852886e+38)
    """
    return tuple(leaf for leaf in pytree.tree_leaves((args, kwargs)) if _dtype_constant(leaf))


def dtype_limits(dtype: torch.dtype) -> frozenset[float]:
    """The floats code derives from ``dtype``'s ``finfo``: its min, max, eps and tiny, of either sign."""
    info = torch.finfo(dtype)
    return frozenset(getattr(info, a) * s for a in ("min", "max", "eps", "tiny") for s in (1, -1))


_FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LIMITS = frozenset().union(*(dtype_limits(d) for d in _FLOATING))


def _dtype_constant(leaf: Any) -> bool:
    if isinstance(leaf, torch.dtype):
        return leaf in _FLOATING
    return type(leaf) is float and leaf in _LIMITS


def call_name(func: Any) -> str:
    """A function's short name, the same for a torch function and dynamo's node of it ("to", "zeros")."""
    name = func if isinstance(func, str) else getattr(func, "__name__", None) or str(func)
    return name.rsplit(".", 1)[-1]


class _RecordDtypeCalls(TorchFunctionMode):
    """Every call that passes dtype constants, in order; with ``device_type``, also the call sites
    that run with that device's autocast on and those that run with it off."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.calls: list[DtypeCall] = []
        self.device_type = device_type
        self.sites: dict[bool, set[str]] = {True: set(), False: set()}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        constants = dtype_constants(args, kwargs)
        site = eager_call_site() if constants or self.device_type is not None else ""
        if constants:
            self.calls.append(DtypeCall(call_name(func), constants, site))
        if self.device_type is not None:
            self.sites[torch.is_autocast_enabled(self.device_type)].add(site)
        return func(*args, **kwargs)


class TracingMode(TorchFunctionMode):
    """A TorchFunctionMode that also watches the Python frames that run while it is on: each new
    frame goes to ``_on_call`` (``sys.settrace``'s global function), whose answer traces it."""

    def __enter__(self) -> Any:
        sys.settrace(self._on_call)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        sys.settrace(None)
        return super().__exit__(*exc)

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        return None


class EagerRun(NamedTuple):
    """What one eager run of the frame did: its calls passing dtype constants, its result, and the
    model code's call sites (file:line) that ran only with autocast switched off inside the
    autocast run (``with torch.autocast(..., enabled=False)``: transformers' ``maybe_autocast``)."""

    calls: list[DtypeCall]
    result: Any
    autocast_off_sites: frozenset[str] = frozenset()


def eager_run(frame: Frame, *, device_type: str, dtype: torch.dtype | None, cache_enabled: bool = True, grad: bool = False) -> EagerRun | None:
    """Run the frame's code eagerly once, without grad, under autocast to ``dtype`` (None: without
    autocast), buffers, Python caches and random state restored after and the seed fixed; None
    if it cannot run here. ``grad``: the result is the one eager gives with grad enabled (where
    the modules' fused inference paths are off for weights that require grad)."""
    recorder = _RecordDtypeCalls(device_type if dtype is not None else None)

    def region() -> contextlib.AbstractContextManager:
        return ambient_autocast(device_type, dtype, cache_enabled=cache_enabled) if dtype is not None else contextlib.nullcontext()

    try:
        result = run_frame(frame, region(), recorder)
        if _takes_fast_paths(frame):
            # The recorder is a TorchFunctionMode, which turns torch.nn's fused inference paths off
            # ("some Tensor argument has_torch_function"): the result is eager's from a run without it.
            result = run_frame(frame, region(), torch.enable_grad() if grad else contextlib.nullcontext())
            result = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, result)
    except Exception:  # advisory, as the attention probe: code that cannot run here is not judged
        return None
    off = frozenset(recorder.sites[False] - recorder.sites[True] - {""})
    return EagerRun(recorder.calls, result, off)


# The modules whose forward picks a fused kernel in eval mode without grad, unless a torch
# function mode is on (torch.overrides.has_torch_function).
_FAST_PATH_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


def _takes_fast_paths(frame: Frame) -> bool:
    """Whether the frame's code may reach a module that takes a fused inference path in eager."""
    return any(isinstance(m, _FAST_PATH_MODULES) for top in _modules_reached(frame) for m in top.modules())


def run_frame(frame: Frame, *regions: contextlib.AbstractContextManager, modules: list[nn.Module] | None = None) -> Any:
    """The frame's result, its code run eagerly once without grad inside ``regions`` (entered in
    order); buffers, Python caches and random state restored after, the seed fixed. Raises what the
    code raises. ``modules``: the modules the code reaches (default: those among the frame's
    arguments and closure), whose buffers are restored."""
    call = _EagerCall(frame.fn, _modules_reached(frame) if modules is None else modules)
    _clear_method_caches(call)
    args, kwargs = _fresh_arguments(frame)
    with state_restored(call, seed=0), torch.no_grad(), contextlib.ExitStack() as stack:
        for region in regions:
            stack.enter_context(region)
        return call(*args, **kwargs)


def fake_float_dtypes(fake: FakeTensorMode, func: Any, args: tuple, kwargs: dict) -> list[torch.dtype]:
    """The floating dtypes ``func`` returns on fake copies of its tensors, in ``fake``; raises what
    fake propagation raises."""
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake.from_tensor, (args, kwargs))
    with fake:
        return float_dtypes(func(*fake_args, **fake_kwargs))


def refused_for_two_dtypes(fake: FakeTensorMode, func: Any, args: tuple, kwargs: dict, error: Exception) -> bool:
    """Whether ``error``, fake propagation's refusal of the call, is for its tensors' two floating
    dtypes: the call passes with them cast to one (fp32 where it is one of them)."""
    floating = {t.dtype for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if type(error) is not RuntimeError or len(floating) < 2:
        return False
    common = torch.float32 if torch.float32 in floating else next(iter(floating))
    try:
        cast_args, cast_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: (t.to(common) if t.is_floating_point() else t), (args, kwargs))
        fake_float_dtypes(fake, func, cast_args, cast_kwargs)
    except Exception:
        return False
    return True


def float_dtypes(value: Any) -> list[torch.dtype]:
    """The dtypes of the floating tensors in ``value``, in pytree order."""
    return [t.dtype for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def eager_backward(
    frame: Frame,
    substitutes: dict[int, torch.Tensor],
    wrt: list[torch.Tensor],
    loss: Callable[[Any], torch.Tensor],
    *,
    device_type: str,
    dtype: torch.dtype,
    cache_enabled: bool = True,
) -> tuple[Any, list[torch.Tensor | None]]:
    """Run the frame's code eagerly once with grad, under autocast to ``dtype``, each tensor
    argument ``t`` replaced by ``substitutes[id(t)]`` where there is one, and backpropagate
    ``loss(result)`` (with autocast off) to the tensors ``wrt`` (the model's parameters, substitutes).
    Buffers, Python caches and random state are restored after, the seed fixed. Returns the
    result (detached) and the gradients (None where unused). Raises what the run raises.
    """
    call = _EagerCall(frame.fn, _modules_reached(frame))
    swapped = pytree.tree_map(
        lambda v: substitutes.get(id(v), v) if isinstance(v, torch.Tensor) else v, (tuple(frame.args), dict(frame.kwargs))
    )
    args, kwargs = _fresh_arguments(Frame(frame.fn, *swapped))
    targets = list(wrt)
    with state_restored(call, seed=0), torch.enable_grad():
        with ambient_autocast(device_type, dtype, cache_enabled=cache_enabled):
            result = call(*args, **kwargs)
        with autocast_off():
            total = loss(result)
            grads = (
                list(torch.autograd.grad(total, targets, allow_unused=True))
                if total.requires_grad and targets else [None] * len(targets)
            )
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, result), grads


def _clear_method_caches(call: nn.Module) -> None:
    """Empty the ``functools.lru_cache`` of each method of the frame's modules' classes (transformers'
    ``compile_compatible_method_lru_cache``: DETR-family and SAM3 position embeddings, cached by
    shape, device and dtype and run uncached while compiling). Filled by an earlier eager call, the
    cache would answer the eager run with no calls for it to record, where dynamo traced them; the
    run fills it again with the same values (same arguments, same autocast)."""
    seen: set[int] = set()
    for module in call.modules():
        for klass in type(module).__mro__:
            if klass.__module__.startswith(("torch.", "graphamp.")) or id(klass) in seen:
                continue
            seen.add(id(klass))
            for value in vars(klass).values():
                value = getattr(value, "__func__", value)  # a staticmethod's or classmethod's function
                for cell in getattr(value, "__closure__", None) or ():
                    cached = cell.cell_contents if _filled(cell) else None
                    if callable(getattr(cached, "cache_clear", None)) and callable(getattr(cached, "cache_info", None)):
                        cached.cache_clear()


def dtype_calls(frame: Frame, *, device_type: str, dtype: torch.dtype | None) -> list[DtypeCall] | None:
    """The calls passing dtype constants that the frame's code makes when run eagerly, in order,
    under autocast to ``dtype`` (None: without autocast); None if it cannot run."""
    run = eager_run(frame, device_type=device_type, dtype=dtype)
    return None if run is None else run.calls


def frame_name(frame: Frame) -> str:
    """The frame's name for messages: the forward of the first module it reaches, else its function."""
    modules = _modules_reached(frame)
    return f"{type(modules[0]).__name__}.forward" if modules else frame.fn.__qualname__
