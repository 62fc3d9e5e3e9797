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
* it imports torch and ``graphamp.errors`` only, so the compile-time modules (capture, policy,
  the passes, emit) can move freely.

``tests/test_runtime.py`` checks both halves: a fresh save names nothing else, and the committed
files in ``tests/fixtures/`` still load and run bitwise equal to eager autocast.

A custom ``torch.autograd.Function`` is kept whole in a converted graph: one node calls
:func:`apply_function`, which runs ``Function.apply`` under the autocast state eager autocast has
at that point of ``forward``. Its forward therefore sees autocast as in eager (so
``torch.amp.custom_fwd(cast_inputs=...)`` casts, and ``custom_bwd`` replays the state in
backward), and autograd calls the Function's own ``backward``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import math
import operator
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src

from graphamp.errors import InputMismatchError, InputShapeError, InputValueError

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
    if torch.compiler.is_compiling():
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


class InputGuard(nn.Module):
    """Checks that inputs match what the graph was converted for: dtype, device, rank, sizes.

    Dims that export kept symbolic may vary within their range; other dims, and every dtype,
    are fixed, because the casts were decided for them.
    """

    def __init__(
        self, names: list[str], specs: list[tuple | None], ranges: dict[str, tuple[int, int | None]],
        reasons: dict[str, str] | None = None, conditions: Sequence[tuple[str, tuple[str, ...], str]] = (),
    ) -> None:
        super().__init__()
        self.names = names
        self.specs = specs
        self.ranges = ranges
        self.reasons = reasons or {}  # per size: the model's condition that bounds it, and where
        # The model's conditions on sizes that no range says (batch != 1): (Python source over the
        # sizes, the sizes it reads, where the model tests it). Guards saved before have none.
        self.conditions = list(conditions)
        self._prepare_conditions()

    def _prepare_conditions(self) -> None:
        # Each condition as a function, made here and after loading, not while dynamo traces the
        # compiled path: dynamo traces calling it (a guard on the sizes), not making it (eval).
        fns = []
        for source, sizes, _ in self.__dict__.get("conditions", ()):
            try:
                fns.append(_condition(source, sizes))
            except Exception:  # a source that does not compile: the check says False, as below
                fns.append(None)
        self.__dict__["_condition_fns"] = fns

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_condition_fns", None)  # functions made by eval do not pickle: made again on load
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._prepare_conditions()

    def _condition_holds(self, i: int, source: str, sizes: tuple[str, ...], values: list[Any]) -> bool:
        fns = self.__dict__.get("_condition_fns") or ()
        fn = fns[i] if i < len(fns) else None
        if fn is not None and torch.compiler.is_compiling():
            return bool(fn(*values))
        return size_condition_holds(source, sizes, values)

    def _fast_specs(self) -> tuple | bool:
        """Per input, what the fast path checks; False when some input needs the full check."""
        counts: dict[str, int] = {}
        for spec in self.specs:
            for d in spec[2] if spec is not None else ():
                if not isinstance(d, int):
                    counts[d] = counts.get(d, 0) + 1
        fast = tuple(_fast_spec_of(spec, self.ranges, counts) for spec in self.specs)
        return False if any(f is False for f in fast) or self.__dict__.get("conditions") else fast

    def forward(self, *inputs: Any) -> None:
        # Fast path, once per call: every tensor input has the dtype, device and rank converted for
        # and its fixed sizes, and no symbolic size is bounded or shared; anything else takes the
        # full check below, which also words the error.
        fast = self.__dict__.get("_fast")
        if fast is None:
            fast = self.__dict__["_fast"] = self._fast_specs()
        if fast is not False and len(inputs) == len(fast):
            for spec, value in zip(fast, inputs):
                if spec is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    break
                dtype, device_type, rank, fixed, free = spec
                if value.dtype != dtype or value.device.type != device_type or value.dim() != rank:
                    break
                shape = value.shape
                if any(shape[i] != d for i, d in fixed) or any(shape[i] < lo for i, lo in free):
                    break
            else:
                return None
        bound: dict[str, int] = {}
        for name, spec, value in zip(self.names, self.specs, inputs):
            if spec is None:
                continue
            dtype, device_type, dims = spec
            if not isinstance(value, torch.Tensor):
                raise InputMismatchError(f"input {name!r}: expected a tensor, got {type(value).__name__}")
            if value.dtype != dtype or value.device.type != device_type or value.dim() != len(dims):
                raise InputMismatchError(
                    f"input {name!r} is {value.dtype} on {value.device.type} with {value.dim()} dims, but the "
                    f"graph was converted for {dtype} on {device_type} with {len(dims)} dims; the casts depend "
                    "on it. Way out: call graphamp.convert again with an example input like this one."
                )
            for i, (dim, size) in enumerate(zip(dims, value.shape)):
                if isinstance(dim, int):
                    if size != dim:
                        raise InputShapeError(
                            f"input {name!r} dim {i} is {size}, but the converted graph fixed it to {dim} "
                            "(torch.export specialized it while tracing the model's code)."
                        )
                elif dim in self.ranges:
                    lo, hi = self.ranges[dim]
                    if bound.setdefault(dim, size) != size:
                        raise InputShapeError(
                            f"input {name!r} dim {i} is {size}, but another input gave {bound[dim]} for the "
                            f"same size {dim}."
                        )
                    if size < lo or (hi is not None and size > hi):
                        why = getattr(self, "reasons", {}).get(dim)
                        raise InputShapeError(
                            f"input {name!r} dim {i} is {size}, outside the range [{lo}, {hi or 'inf'}] the "
                            "model's code allows for it"
                            + (f" (the graph was traced where the model's code tested {why})" if why else "")
                            + "."
                        )
        for i, (source, sizes, where) in enumerate(self.__dict__.get("conditions", ())):
            if not all(size in bound for size in sizes):
                continue
            values = [bound[size] for size in sizes]
            if not self._condition_holds(i, source, sizes, values):
                _refuse_sizes(sizes, values, where)


@torch.compiler.disable
def _refuse_sizes(sizes: tuple[str, ...], values: list[int], where: str) -> None:
    # Raised outside dynamo's trace (disable: a graph break, then this runs eagerly), so the error
    # leaves the compiled code as it is: dynamo cannot trace the raise, and falling back to eager
    # for the whole frame would run the converted module's reconversion inside the compiled call.
    given = ", ".join(f"{size}={value}" for size, value in zip(sizes, values))
    raise InputShapeError(
        f"these inputs' sizes ({given}) fail the condition the model's code tested where the graph "
        f"was traced ({where}): eager would take another branch."
    )


@functools.lru_cache(maxsize=256)
def _condition(source: str, sizes: tuple[str, ...]) -> Callable[..., bool]:
    """A size condition's source (torch's PythonPrinter over the size symbols) as a function."""
    return eval(f"lambda {', '.join(sizes)}: bool({source})", {"__builtins__": {}, "bool": bool, "math": math, "min": min, "max": max, "abs": abs})


def size_condition_holds(source: str, sizes: tuple[str, ...], values: Sequence[int]) -> bool:
    """Whether the model's size condition ``source`` holds for these sizes; False where it cannot
    be evaluated (then the input gets a conversion of its own, which is never wrong).

    >>> assert size_condition_holds("s0 != 1", ("s0",), [2]) and not size_condition_holds("s0 != 1", ("s0",), [1])
    """
    try:
        return _condition(source, sizes)(*values)
    except Exception:
        return False


def _fast_spec_of(spec: tuple | None, ranges: dict, counts: dict) -> tuple | None | bool:
    """(dtype, device, rank, ((dim, size) fixed), ((dim, lower bound) free)) for the guard's fast path;
    False for a size it cannot check alone (an upper bound, or a size shared with another dim)."""
    if spec is None:
        return None
    dtype, device_type, dims = spec
    fixed, free = [], []
    for i, d in enumerate(dims):
        if isinstance(d, int):
            fixed.append((i, d))
        elif d in ranges and ranges[d][1] is None and counts[d] == 1:
            free.append((i, ranges[d][0]))
        else:
            return False
    return (dtype, device_type, len(dims), tuple(fixed), tuple(free))


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


# The devices whose autocast state a kept Function sees: graphamp's policies.
_DEVICE_TYPES = ("cpu", "cuda")


class AutocastState(NamedTuple):
    """Autocast's switches for one device, as ``torch.autocast`` sets them."""

    device_type: str
    enabled: bool
    dtype: torch.dtype


def current_autocast_state(device_types: Sequence[str] = _DEVICE_TYPES) -> tuple[tuple[AutocastState, ...], bool]:
    """The autocast state now: each device's switches, and whether the cast cache is on."""
    states = tuple(
        AutocastState(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in device_types
    )
    return states, torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def autocast_state(states: Sequence[AutocastState], cache_enabled: bool = True) -> Iterator[None]:
    """Set autocast's switches as ``torch.autocast`` regions would, and restore them after.

    The switches are set directly rather than through ``torch.autocast``, which disables itself
    for a device type the build cannot run (CUDA on a CPU-only build, where graphamp still runs
    the CUDA policy over fake tensors).
    """
    previous = [(s.device_type, torch.is_autocast_enabled(s.device_type), torch.get_autocast_dtype(s.device_type)) for s in states]
    previous_cache = torch.is_autocast_cache_enabled()
    for s in states:
        torch.set_autocast_enabled(s.device_type, s.enabled)
        torch.set_autocast_dtype(s.device_type, s.dtype)
    torch.set_autocast_cache_enabled(cache_enabled)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        # As torch.autocast.__exit__: the cast cache lives as long as the outermost region.
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        for device_type, enabled, dtype in previous:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(previous_cache)


class Slot(NamedTuple):
    """Stands for the ``index``-th value a kept call takes from the graph (a tensor or a SymInt)."""

    index: int


def fill(template: Any, values: Sequence[Any]) -> Any:
    """``template`` with every :class:`Slot` replaced by its value: the inverse of a split."""
    if isinstance(template, Slot):
        return values[template.index]
    if isinstance(template, PartialTemplate):
        return template.rebuild(values)
    if isinstance(template, tuple):
        filled = [fill(t, values) for t in template]
        return type(template)(*filled) if hasattr(template, "_fields") else type(template)(filled)
    if isinstance(template, list):
        return [fill(t, values) for t in template]
    if isinstance(template, dict):
        return type(template)((k, fill(v, values)) for k, v in template.items())
    return template


class PartialTemplate(NamedTuple):
    """A ``functools.partial`` whose bound arguments hold graph values (Hugging Face's checkpointed
    layers pass ``partial(forward, layer, **kwargs)``)."""

    cls: type
    func: Any
    args: Any
    keywords: Any

    def rebuild(self, values: Sequence[Any]) -> Any:
        return self.cls(fill(self.func, values), *fill(self.args, values), **fill(self.keywords, values))


def qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _importable(cls: type) -> bool:
    """Whether pickle can find ``cls`` again by its module and qualified name."""
    try:
        obj: Any = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            obj = getattr(obj, part)
    except Exception:
        return False
    return obj is cls


class KeptFunction(nn.Module):
    """One call of a custom ``torch.autograd.Function``, kept whole in a converted graph.

    ``function`` is the Function class; ``template`` its ``(args, kwargs)`` with a :class:`Slot`
    for each value the graph passes in; ``autocast`` the state eager autocast had at the call.
    Pickling refers to ``function`` by its qualified name, so a Function defined inside another
    function cannot be saved (``copy.deepcopy`` works).
    """

    def __init__(
        self,
        function: type[torch.autograd.Function],
        template: tuple[tuple, dict],
        autocast: tuple[AutocastState, ...],
        cache_enabled: bool = True,
    ) -> None:
        super().__init__()
        self.function = function
        self.template = template
        self.autocast = tuple(autocast)
        self.cache_enabled = cache_enabled

    def forward(self, *values: Any) -> Any:
        return apply_function(self, *values)

    def extra_repr(self) -> str:
        on = [f"{s.device_type}: {s.dtype}" for s in self.autocast if s.enabled]
        return f"{qualified_name(self.function)}, autocast {{{', '.join(on)}}}"

    def __getstate__(self) -> dict:
        if not _importable(self.function):
            raise pickle.PicklingError(
                f"cannot save this converted module: it keeps the custom autograd.Function "
                f"{qualified_name(self.function)}, which pickle cannot find again by name (it is defined "
                "inside a function, or renamed). Way out: define the Function at module level, or "
                "save the original model's state_dict and convert again after loading."
            )
        return self.__dict__.copy()

    def __deepcopy__(self, memo: dict) -> KeptFunction:
        # Copies by value, not through pickle's by-name lookup: a local Function class copies too.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


def apply_function(kept: KeptFunction, *values: Any) -> Any:
    """Call ``kept.function.apply`` on the graph's ``values`` under eager's autocast state there.

    >>> class Double(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x, k):
    ...         ctx.k = k
    ...         return x @ x * k           # a matmul: autocast runs it in bf16
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g * 0 + 7, None    # the Function's own gradient
    >>> on = (AutocastState("cpu", True, torch.bfloat16),)
    >>> kept = KeptFunction(Double, ((Slot(0), 2.0), {}), on)
    >>> x = torch.randn(3, 3, requires_grad=True)
    >>> y = apply_function(kept, x)
    >>> y.sum().backward()
    >>> assert y.dtype is torch.bfloat16 and bool((x.grad == 7).all())
    >>> assert not torch.is_autocast_enabled("cpu")
    """
    args, kwargs = fill(kept.template, values)
    with autocast_state(kept.autocast, kept.cache_enabled):
        return kept.function.apply(*args, **kwargs)


class KeptGraphFunction(nn.Module):
    """A custom ``autograd.Function`` as dynamo captured it (``autograd_function_apply``: a forward
    and a backward graph), kept whole by ``torch.compile(backend="graphamp")``."""

    def __init__(self, fwd: nn.Module, bwd: nn.Module, kwargs: dict[str, Any], autocast: tuple[AutocastState, ...], cache_enabled: bool = True) -> None:
        super().__init__()
        self.fwd = fwd
        self.bwd = bwd
        self.hop_kwargs = dict(kwargs)
        self.autocast = tuple(autocast)
        self.cache_enabled = cache_enabled

    def forward(self, *operands: Any) -> Any:
        return apply_graph_function(self, *operands)


def apply_graph_function(kept: KeptGraphFunction, *operands: Any) -> Any:
    """Run dynamo's ``autograd_function_apply`` under eager's autocast state at the call: tracing
    it (AOTAutograd) records the forward's casts explicitly and the Function's own backward."""
    with autocast_state(kept.autocast, kept.cache_enabled):
        return torch.ops.higher_order.autograd_function_apply(kept.fwd, kept.bwd, *operands, **kept.hop_kwargs)


# The functions generated code calls besides torch's ops: a re-trace must record every call.
def autocast_op(op: Any, device_type: str, dtype: torch.dtype, *args: Any) -> Any:
    """``op(*args)`` with ``device_type`` autocast on in ``dtype``: a fused kernel eager runs whole
    (``_transformer_encoder_layer_fwd``), whose inner kernels autocast casts one by one.

    >>> x, w = torch.randn(2, 4), torch.randn(4, 4)
    >>> assert autocast_op(torch.ops.aten.mm.default, "cpu", torch.bfloat16, x, w).dtype is torch.bfloat16
    """
    with autocast_state([AutocastState(device_type, True, dtype)]):
        return op(*args)


# What a graph captured by following the example's values (graphamp.capture.values) checks as it
# runs: each tensor value the model's Python read, by how it read it.
_READS: dict[str, Callable[..., Any]] = {
    "item": lambda t: t.item(),
    "bool": lambda t: bool(t),
    "int": lambda t: int(t),
    "float": lambda t: float(t),
    "index": lambda t: operator.index(t),
    "complex": lambda t: complex(t),
    "is_nonzero": lambda t: torch.is_nonzero(t),
    "tolist": lambda t: t.detach().cpu().tolist(),
    "numpy": lambda t: t.detach().cpu().tolist(),
    "equal": lambda a, b: torch.equal(a, b),
    "contains": lambda t, value: value in t,
    "allclose": lambda a, b, *rest: torch.allclose(a, b, *rest),
    "op": lambda op, *args: op(*args),  # an ATen op's own read (``aten.item`` inside a composite op)
}


def _same_value(got: Any, expected: Any) -> bool:
    """Equal as the model's branch sees it: NaN equals NaN, and lists compare element by element."""
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(map(_same_value, got, expected))
    if isinstance(expected, float) and expected != expected:
        return isinstance(got, float) and got != got
    return type(got) is type(expected) and got == expected


# Reads whose value is the tensor's own (one element), which an ATen comparison can check.
_SCALAR_READS = ("bool", "is_nonzero", "item", "int", "float", "index")


def assert_condition(read: str, value: torch.Tensor, expected: Any) -> tuple[Callable[..., Any], Any] | None:
    """``(op, scalar)`` such that ``op(value, scalar)`` is a bool tensor, true exactly where reading
    ``value`` as ``read`` gives ``expected`` (``value`` may be fake); None where no ATen comparison
    says it exactly. Shared by the compiled module's guards and graphamp.export's assertions.

    >>> assert_condition("bool", torch.ones(()), True)
    (<OpOverload(op='aten.ne', overload='Scalar')>, 0)
    >>> assert_condition("int", torch.ones(()), 1) is None  # int() truncates a float: 1.5 reads as 1 too
    True
    """
    if read not in _SCALAR_READS or not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    if read in ("bool", "is_nonzero"):
        return ((torch.ops.aten.ne.Scalar if expected else torch.ops.aten.eq.Scalar), 0) if isinstance(expected, bool) else None
    if type(expected) not in (int, float, bool) or expected != expected:  # NaN: no equality says it
        return None
    if read in ("int", "index") and value.is_floating_point():
        return None
    return torch.ops.aten.eq.Scalar, expected


# The message prefix of a guard's assertion in compiled code (CompiledAmpModule maps it back to
# InputValueError); on only while a CompiledAmpModule calls its compiled code, so that a user's own
# torch.compile of a converted module keeps the typed error (at a graph break).
COMPILED_REFUSAL = "graphamp refused the call: "


class _CompiledGuards:
    asserting = False


def _refusal(read: str, expected: Any, where: str) -> str:
    shown = repr(expected) if len(repr(expected)) < 60 else repr(expected)[:57] + "..."
    return (
        f"the model's code read a tensor value ({read}{f' at {where}' if where else ''}) that was {shown} on the "
        "example this graph follows, and differs on these inputs: eager runs another program for them."
    )


def guard_value(read: str, values: Sequence[Any], expected: Any, where: str = "") -> None:
    """Check that reading ``values`` as the model's code did (``read``: "bool", "item", "tolist",
    ...) gives what it gave on the example the graph was captured for; else raise
    :class:`graphamp.errors.InputValueError` (the module converts again for these inputs).

    In a CompiledAmpModule's compiled code a read one comparison checks is an ATen assertion
    instead of a Python ``bool`` (which would break dynamo's graph there).

    >>> guard_value("bool", [torch.ones(3).all()], True)
    >>> guard_value("item", [torch.tensor(2)], 3)
    Traceback (most recent call last):
    graphamp.errors.InputValueError: ...
    """
    if _CompiledGuards.asserting and torch.compiler.is_compiling() and len(values) == 1:
        condition = assert_condition(read, values[0], expected)
        if condition is not None:
            op, scalar = condition
            torch.ops.aten._assert_async.msg(op(values[0], scalar), COMPILED_REFUSAL + _refusal(read, expected, where))
            return
    got = _READS[read](*values)
    if not _same_value(got, expected):
        raise InputValueError(_refusal(read, expected, where))


@contextlib.contextmanager
def compiled_guards() -> Iterator[None]:
    """Guards as ATen assertions while tracing and running a CompiledAmpModule's code; a failed one
    is raised as :class:`InputValueError`."""
    previous, _CompiledGuards.asserting = _CompiledGuards.asserting, True
    try:
        yield
    except RuntimeError as e:
        if COMPILED_REFUSAL in str(e):
            raise InputValueError(str(e).split(COMPILED_REFUSAL, 1)[1].splitlines()[0]) from e
        raise
    finally:
        _CompiledGuards.asserting = previous


def guard_size(value: torch.Tensor, size: Sequence[int], where: str = "") -> torch.Tensor:
    """``value``, checked to have the size it had on the example (an op whose output size depends
    on values: ``nonzero``, ``masked_select``, ``unique``): the graph holds the sizes that follow."""
    if tuple(value.shape) != tuple(size):
        raise InputValueError(
            f"an op{f' at {where}' if where else ''} whose output size depends on tensor values gave {tuple(value.shape)} "
            f"where the example gave {tuple(size)}, and the graph holds the sizes that follow from it."
        )
    return value


# AmpModule.meta key: (buffer paths, random draws?) a graph changes before a guard that may refuse
# the call, which the module puts back when it does (graphamp.capture.values).
RESTORE_ON_REFUSAL = "graphamp_restore_on_refusal"


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
    accelerator where it is initialized, XLA's where torch_xla is loaded. The same generators as
    ``graphamp.eager.RngState`` (``tests/test_eager_rng.py`` checks both), read here because the
    runtime imports no compile-time module (``graphamp.eager`` will run models)."""
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


torch.fx.node.has_side_effect(guard_value)
torch.fx.node.has_side_effect(guard_size)

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


# Where a converted module keeps the model it converts again from for other shape classes.
_MODEL = "_graphamp_model"

# Where a saved module keeps graphamp's node meta (casts, categories), which a re-trace loses.
_NODE_META = "_graphamp_node_meta"


def _node_key(node: torch.fx.Node) -> str:
    """A call node's op and target, the same in every process: the code of a re-traced module
    matches the saved graph's node for node exactly when these keys do."""
    t = node.target
    if isinstance(t, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{node.op} {t.__module__}.{t.__qualname__}"
    return f"{node.op} {t}"


def _node_meta_record(graph: torch.fx.Graph, info_of: Any) -> dict[str, Any]:
    """What :func:`rebuild_amp_module` restores, for ``AmpModule.__reduce__``: ``info_of(node)``
    for every call node, in order, and for every ``get_attr`` node by its target. Private: the
    saved format is the record's shape, not this function."""
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    attrs = {n.target: info_of(n) for n in graph.find_nodes(op="get_attr")}
    return {"calls": [(_node_key(n), info_of(n)) for n in calls], "attrs": {k: v for k, v in attrs.items() if v}}


def _restore_node_meta(graph: torch.fx.Graph, record: dict[str, Any], as_info: Any) -> None:
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    # Only where the re-trace gave the saved graph's nodes back one for one; otherwise the module
    # runs the same and only its report (cast_summary) is empty.
    if [key for key, _ in record["calls"]] == [_node_key(n) for n in calls]:
        for node, (_, info) in zip(calls, record["calls"]):
            if info:
                node.meta["graphamp"] = as_info(info)
    for node in graph.find_nodes(op="get_attr"):
        if node.target in record["attrs"]:
            node.meta["graphamp"] = as_info(record["attrs"][node.target])


def rebuild_amp_module(body: dict[str, Any], import_block: str) -> nn.Module:
    """A saved ``graphamp.AmpModule`` again, from what its ``__reduce__`` wrote: FX's module
    state and the code's imports. The code is re-traced with :class:`AmpTracer`."""
    import graphamp  # loaded already: unpickling this function imported the package

    record = body.pop(_NODE_META, None)
    # The model it was converted from (saved since it converts again for other shapes) stays out of
    # the module's submodules, as before saving.
    model = body.pop(_MODEL, None)
    forward = _forward_from_src(import_block + (body.get("_code") or body["code"]), {})
    amp = _deserialize_graph_module(forward, body, graph_module_cls=graphamp.AmpModule)
    if model is not None:
        amp._graphamp_bind(model)
    if record is not None:
        _restore_node_meta(amp.graph, record, graphamp.AmpModule.node_info_from_saved)
    return amp
