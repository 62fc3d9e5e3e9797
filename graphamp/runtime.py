"""What the code of a converted module calls at run time, and what a saved module refers to.

Generated code calls graphamp through this module only. With the package's top level
(``graphamp.AmpModule``, ``graphamp.AmpInfo``, ``graphamp.Config``), it is also the only graphamp
module a saved module names: ``torch.save`` writes a converted module's code with its imports
(``from graphamp.runtime import cached_cast``), and its submodules and values by class path
(``graphamp.runtime.WeightCache``), into the user's file. So this is a stable import path:

* names may be added, and a function may gain an argument with a default;
* a name is never removed or renamed, and a signature or a pickled state never changes
  incompatibly, without a loader shim that keeps the files earlier versions saved loading (an
  alias left here, a ``__setstate__`` that upgrades old state);
* it imports torch, ``graphamp.errors`` and the runtime's own modules (below) only, so the
  compile-time modules (capture, policy, the passes, emit) can move freely.

``tests/test_runtime.py`` checks both halves: a fresh save names nothing else, and the committed
files in ``tests/fixtures/`` still load and run bitwise equal to eager autocast.

Some of the runtime is defined in modules of its own, which import torch and ``graphamp.errors``
only too: :mod:`graphamp.runtime_guards` (the input and value checks), :mod:`graphamp.runtime_autocast`
(custom autograd Functions kept whole, fused kernels, under eager's autocast state) and
:mod:`graphamp.runtime_saved` (the node record a saved module carries). Every name in ``__all__``
is importable from here and carries this module as its ``__module__``, which is the path FX
writes into generated code and pickle into files; so those modules can be rearranged freely too.
``tests/test_runtime_layout.py`` checks it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src

from graphamp.errors import InputValueError
# Defined in the runtime's own modules, named here; the ones outside __all__ for graphamp's own
# compile-time importers (capture, passes, compiled).
from graphamp.runtime_autocast import (
    AutocastState, KeptFunction, KeptGraphFunction, PartialTemplate, Slot, apply_function, apply_graph_function,
    FUSED_ENCODER_LAYER, autocast_op, autocast_state, current_autocast_state, encoder_layer_under_autocast, fill,
    fused_layer_dtype, qualified_name,
)
from graphamp.runtime_guards import (
    COMPILED_REFUSAL, InputGuard, assert_condition, compiled_guards, guard_size, guard_value, size_condition_holds, traced,
)
from graphamp.runtime_saved import MODEL, NODE_META, restore_node_meta

__all__ = [
    "AmpTracer",
    "AutocastState",
    "FrozenDict",
    "InputGuard",
    "KeptFunction",
    "KeptGraphFunction",
    "PartialTemplate",
    "Slot",
    "WeightCache",
    "apply_function",
    "apply_graph_function",
    "autocast_cached",
    "autocast_op",
    "autocast_state",
    "cached_cast",
    "grad_casts_kept",
    "current_autocast_state",
    "fill",
    "guard_size",
    "guard_value",
    "read_state",
    "rebuild_amp_module",
    "set_grad_enabled",
    "size_condition_holds",
]



def set_grad_enabled(enabled: bool) -> bool:
    """Set grad mode and return the previous one; the graph calls it around a grad-mode region.

    >>> prev = set_grad_enabled(False)
    >>> assert prev and not torch.is_grad_enabled()
    >>> assert set_grad_enabled(prev) is False and torch.is_grad_enabled()
    """
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enabled)
    return prev


def autocast_cached(src: torch.Tensor, first: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A later cast of input ``src``: ``first`` (the forward's first cast of it) where eager
    autocast's cache would hand that out, i.e. ``src`` is a leaf that requires grad and not a view;
    a fresh cast otherwise.

    >>> x = torch.randn(2, requires_grad=True)
    >>> first = x.to(torch.bfloat16)
    >>> assert autocast_cached(x, first, torch.bfloat16) is first and autocast_cached(x * 1, first, torch.bfloat16) is not first
    """
    if src.requires_grad and src.is_leaf and not src._is_view():
        return first
    return torch.ops.aten._to_copy.default(src, dtype=dtype)


class WeightCache(nn.Module):
    """Low-precision copies of parameters, keyed by (parameter, dtype), stamped with its version.

    The copies are not saved: a loaded module recasts each weight on its first call.
    """

    def __init__(self) -> None:
        super().__init__()
        # (id(param), dtype) -> (version, data_ptr, low copy)
        self._entries: dict[tuple[int, torch.dtype], tuple[int, int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # This runs once per weight per call, so it stays lean: one dict lookup, two reads.
        key = (id(param), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0] == param._version and entry[1] == param.data_ptr() and entry[2].requires_grad == param.requires_grad:
            return entry[2]
        if isinstance(param, FakeTensor):  # no data to reuse (fake CUDA checks): cast as eager does
            return torch.ops.aten._to_copy.default(param, dtype=dtype)
        stamp = (param._version, param.data_ptr())
        # A normal tensor even under inference_mode, so a later grad-mode call may save it.
        with torch.inference_mode(False), torch.no_grad():
            low = param.detach().to(dtype)
        # Eager autocast's cached cast of a weight that requires grad still requires grad under
        # no_grad, and kernels read that flag: matmul folds a non-contiguous 3-D input into one mm
        # (a copy, then mm) when the other operand requires grad, else it runs bmm, which rounds
        # fp16 differently. The copy is a leaf and only used without grad, so the flag is inert.
        low.requires_grad_(param.requires_grad)
        with self._lock:
            self._entries[key] = (*stamp, low)
        return low

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_entries"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> WeightCache:
        return WeightCache()


def cached_cast(cache: WeightCache, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``param`` cast to ``dtype``, reusing the copy of an earlier call while ``param`` is unchanged.

    >>> cache, w = WeightCache(), torch.randn(3)
    >>> assert cached_cast(cache, w, torch.bfloat16) is cached_cast(cache, w, torch.bfloat16)
    >>> w.add_(1)  # an in-place update bumps the version: the copy is recomputed
    tensor(...)
    >>> assert torch.equal(cached_cast(cache, w, torch.bfloat16), w.to(torch.bfloat16))
    """
    if traced():
        # Traced by dynamo (convert(compile=True)): the cast itself, which inductor's freezing
        # folds into a constant; the cache's version and pointer checks would break the graph.
        return torch.ops.aten._to_copy.default(param, dtype=dtype)
    if param.requires_grad and torch.is_grad_enabled():
        store = getattr(_KEPT_CASTS, "store", None)
        if store is None or param.numel() < KEEP_CAST_MIN_NUMEL or isinstance(param, FakeTensor):
            return torch.ops.aten._to_copy.default(param, dtype=dtype)  # per forward, as eager casts it
        return _kept_grad_cast(store, param, dtype)
    # WeightCache.get's hit path, inlined: this runs once per weight per call.
    entry = cache._entries.get((id(param), dtype))
    if entry is not None and entry[0] == param._version and entry[1] == param.data_ptr() and entry[2].requires_grad == param.requires_grad:
        return entry[2]
    return cache.get(param, dtype)


_KEPT_CASTS = threading.local()
# Below this many elements (2 MiB as bf16) a weight is cast per forward, as eager does: the fresh
# cast leaves the low copy in cache for the matmul that reads it, and the kept cast's Python
# autograd.Function costs about 15 us. Measured 2026-11-28 on a 2-core AMD EPYC (one linear, forward
# and backward, kept / recast): 3072x768 0.68-0.89x, 1024x1024 0.83x, 768x768 0.59-1.06x, 256x1024
# 1.02x; GPT-2 at hidden 256 with its 256x1024 weights kept ran 3-7% slower per window.
KEEP_CAST_MIN_NUMEL = 1 << 20


@contextlib.contextmanager
def grad_casts_kept(store: dict) -> Iterator[None]:
    """Within it, a parameter's low-precision cast on a gradient path is made once while the
    parameter is unchanged (its version counter and data pointer, as ``WeightCache``) and kept in
    ``store``; later forwards reuse it through a backward identical to the cast's. ``TrainStep``
    keeps one store per accumulation window: the micro-batches of a window see the same weights,
    so eager's per-forward recast gives the same values every time.

    Weights under ``KEEP_CAST_MIN_NUMEL`` elements are cast per forward: keeping them costs more.

    >>> w = nn.Parameter(torch.randn(1024, 1024))
    >>> store = {}
    >>> with grad_casts_kept(store):
    ...     a = cached_cast(WeightCache(), w, torch.bfloat16)
    ...     b = cached_cast(WeightCache(), w, torch.bfloat16)
    >>> assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and len(store) == 1
    >>> (a.float().sum() + b.float().sum()).backward()
    >>> assert torch.equal(w.grad, torch.full((1024, 1024), 2.0))
    """
    previous = getattr(_KEPT_CASTS, "store", None)
    _KEPT_CASTS.store = store
    try:
        yield
    finally:
        _KEPT_CASTS.store = previous


class _KeptCast(torch.autograd.Function):
    """A kept low-precision copy of ``param`` as the output of its cast: forward returns a view of
    the copy, backward what ``aten::_to_copy``'s does (the gradient converted to the parameter's
    dtype, which is exact from bf16 or fp16 to fp32)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def _kept_grad_cast(store: dict, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    key = (id(param), dtype)
    entry = store.get(key)
    if entry is None or entry[0] != param._version or entry[1] != param.data_ptr():
        with torch.no_grad():
            low = torch.ops.aten._to_copy.default(param.detach(), dtype=dtype)
        store[key] = entry = (param._version, param.data_ptr(), low)
    return _KeptCast.apply(param, entry[2])


def read_state(root: nn.Module, *paths: tuple[str, ...]) -> list[Any]:
    """The attributes at ``paths`` (each a tuple of names) of ``root``, read as ``getattr`` reads
    them but through the modules' dictionaries: an instance attribute, then ``_parameters``,
    ``_buffers``, ``_modules`` (``nn.Module.__getattr__``'s order), else ``getattr``.

    A converted module's code reads its parameters through this once per call
    (``graphamp.codegen``), so it always sees the current objects.

    >>> m = nn.Sequential(nn.Linear(2, 2))
    >>> w, b = read_state(m, ("0", "weight"), ("0", "bias"))
    >>> assert w is m[0].weight and b is m[0].bias
    """
    values = []
    for path in paths:
        obj = root
        for key in path:
            try:
                d = obj.__dict__
                params = d["_parameters"]
            except (AttributeError, KeyError):  # not a module
                obj = getattr(obj, key)
                continue
            if key in d:
                obj = getattr(obj, key)
            elif key in params:
                obj = params[key]
            elif key in d["_buffers"]:
                obj = d["_buffers"][key]
            elif key in d["_modules"]:
                obj = d["_modules"][key]
            else:
                obj = getattr(obj, key)
        values.append(obj)
    return values


class FrozenDict(dict):
    """A dict that refuses mutation (unlike MappingProxyType it pickles, so AmpModules save).

    A saved module's :class:`graphamp.Config` holds its op overrides in one.
    """

    def _readonly(self, *args: object, **kwargs: object) -> None:
        raise TypeError("Config is frozen; build a new Config instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (FrozenDict, (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=repr)))


@contextlib.contextmanager
def restored_on_refusal(root: nn.Module, buffers: Sequence[str], rng: bool) -> Iterator[None]:
    """Run a graph whose guards may refuse the call after it changed state: on
    :class:`~graphamp.errors.InputValueError`, the buffers it updated in place (batch-norm
    statistics) and the random generator's state are put back, so that the graph converted for
    these inputs runs from the state eager would. The random state is every generator's (as
    ``graphamp.eager.RngState``, which this module cannot import: see :func:`_random_state`).

    >>> bn = nn.BatchNorm1d(2)
    >>> try:
    ...     with restored_on_refusal(bn, ["running_mean"], True):
    ...         _ = bn.running_mean.add_(1.0)
    ...         raise InputValueError("refused")
    ... except InputValueError:
    ...     pass
    >>> assert torch.equal(bn.running_mean, torch.zeros(2))
    """
    saved = [(root.get_buffer(path), root.get_buffer(path).clone()) for path in buffers]
    restore_random_state = _random_state() if rng else None
    try:
        yield
    except InputValueError:
        with torch.no_grad():
            for buf, before in saved:
                buf.copy_(before)
        if restore_random_state is not None:
            restore_random_state()
        raise


def _random_state() -> Callable[[], None]:
    """What puts every random generator back as it is now: the CPU's, each device's of the
    accelerator where it is initialized, XLA's where torch_xla is loaded. The same torch generators as
    ``graphamp.eager.RngState`` (``tests/test_eager_rng.py`` checks both), read here because the
    runtime imports no compile-time module (``graphamp.eager`` will run models). Not Python's or
    numpy's global generators, which RngState also keeps: a graph never draws from them (the capture
    refuses a model that does)."""
    cpu = torch.default_generator.get_state()
    device = torch.accelerator.current_accelerator()
    module = torch.get_device_module(device.type) if device is not None else None
    ready = module is not None and (getattr(module, "is_initialized", None) or getattr(module, "is_available", bool))()
    devices = [module.get_rng_state(i) for i in range(module.device_count())] if ready else []
    xm = sys.modules.get("torch_xla.core.xla_model")
    xla = xm.get_rng_state() if xm is not None else None

    def restore() -> None:
        torch.default_generator.set_state(cpu)
        for i, state in enumerate(devices):
            module.set_rng_state(state, i)
        if xm is not None:
            xm.set_rng_state(xla)

    return restore


# The functions generated code calls besides torch's ops: a re-trace must record every call.
_RUNTIME_CALLS = (set_grad_enabled, cached_cast, autocast_cached, apply_function, autocast_op, guard_value, guard_size)


class AmpTracer(torch.fx.Tracer):
    """Re-traces a saved AmpModule's code, recording every call of the runtime functions.

    FX's autowrap records a call only when an argument is traced, so ``set_grad_enabled(False)``
    (constant arguments) would run at trace time and vanish from the graph, and a ``no_grad``
    region would be lost on load. While tracing, those names in the code's globals are bound to
    functions that always record.
    """

    def trace(self, root: Any, concrete_args: Any = None) -> torch.fx.Graph:
        fn = type(root).forward if isinstance(root, nn.Module) else root
        globals_ = fn.__globals__
        bound = {name: value for name, value in globals_.items() if any(value is f for f in _RUNTIME_CALLS)}
        registry = torch.fx._symbolic_trace._wrapped_fns_to_patch
        # Files saved by older versions register these names with FX's wrap(), which would wrap
        # the recording functions again; they are recorded here instead.
        wrapped = {key: registry.pop(key) for key in list(registry) if key[0] == id(globals_) and key[1] in bound}
        for name, value in bound.items():
            globals_[name] = self._recorder(value)
        try:
            return super().trace(root, concrete_args)
        finally:
            globals_.update(bound)
            registry.update(wrapped)

    def _recorder(self, target: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            return self.create_proxy("call_function", target, args, kwargs)

        return record


def rebuild_amp_module(body: dict[str, Any], import_block: str) -> nn.Module:
    """A saved ``graphamp.AmpModule`` again, from what its ``__reduce__`` wrote: FX's module
    state and the code's imports. The code is re-traced with :class:`AmpTracer`."""
    import graphamp  # loaded already: unpickling this function imported the package

    record = body.pop(NODE_META, None)
    # The model it was converted from (saved since it converts again for other shapes) stays out of
    # the module's submodules, as before saving.
    model = body.pop(MODEL, None)
    # FX's loader keeps the new module's empty meta: graphamp's record (the self-check, what a
    # refused call puts back, ...) is put back here, read by the AmpModule of this version.
    meta = body.pop("meta", None)
    forward = _forward_from_src(import_block + (body.get("_code") or body["code"]), {})
    amp = _deserialize_graph_module(forward, body, graph_module_cls=graphamp.AmpModule)
    if meta:
        amp.meta.update(graphamp.AmpModule.meta_from_saved(meta))
    if model is not None:
        amp._graphamp_bind(model)
    if record is not None:
        restore_node_meta(amp.graph, record, graphamp.AmpModule.node_info_from_saved)
    return amp
