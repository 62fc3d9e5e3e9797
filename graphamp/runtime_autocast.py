"""Where a converted graph runs code under eager autocast's own state: a custom
``torch.autograd.Function`` kept whole (:class:`KeptFunction`, :func:`apply_function`), one that
dynamo captured (:class:`KeptGraphFunction`), and a fused kernel eager runs whole
(:func:`autocast_op`).

A kept Function's node calls :func:`apply_function`, which runs ``Function.apply`` under the
autocast state eager autocast has at that point of ``forward``. Its forward therefore sees autocast
as in eager (so ``torch.amp.custom_fwd(cast_inputs=...)`` casts, and ``custom_bwd`` replays the
state in backward), and autograd calls the Function's own ``backward``.

Part of the stable runtime: :mod:`graphamp.runtime` re-exports the names here, and the ones it
lists in its ``__all__`` carry ``graphamp.runtime`` as their ``__module__`` (the end of this file),
the path FX writes into a converted module's imports and pickle into a saved file. Like the
runtime, this module imports torch only.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import pickle
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = [
    "AutocastState",
    "KeptFunction",
    "KeptGraphFunction",
    "PartialTemplate",
    "Slot",
    "apply_function",
    "apply_graph_function",
    "autocast_op",
    "autocast_state",
    "current_autocast_state",
    "encoder_layer_under_autocast",
    "fill",
    "qualified_name",
]

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


def autocast_op(op: Any, device_type: str, dtype: torch.dtype, *args: Any) -> Any:
    """``op(*args)`` with ``device_type`` autocast on in ``dtype``: a fused kernel eager runs whole
    (``_transformer_encoder_layer_fwd``), whose inner kernels autocast casts one by one.

    >>> x, w = torch.randn(2, 4), torch.randn(4, 4)
    >>> assert autocast_op(torch.ops.aten.mm.default, "cpu", torch.bfloat16, x, w).dtype is torch.bfloat16
    """
    with autocast_state([AutocastState(device_type, True, dtype)]):
        return op(*args)


FUSED_ENCODER_LAYER = torch.ops.aten._transformer_encoder_layer_fwd.default


def fused_layer_dtype(src: torch.Tensor, args: Sequence[Any], autocast: tuple[str, torch.dtype] | None) -> torch.dtype:
    """The dtype eager's fused encoder layer returns for an input like ``src`` and the arguments
    ``args`` after it (tensors real or fake; the last two, the mask, are left out), with
    ``autocast`` ((device type, dtype)) on: found by running the kernel on a two-token probe of
    zeros of the same dtypes, since under autocast it casts inside, which fake propagation does not
    model."""
    def zeros(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tuple(int(n) for n in t.shape), dtype=t.dtype, device=t.device)

    with unset_fake_temporarily(), torch.no_grad():
        probe = torch.zeros(1, 2, int(args[0]), device=src.device, dtype=src.dtype)
        real = [zeros(a) if isinstance(a, torch.Tensor) else a for a in args[:-2]] + [None, None]
        return (FUSED_ENCODER_LAYER(probe, *real) if autocast is None else autocast_op(FUSED_ENCODER_LAYER, *autocast, probe, *real)).dtype


@torch.library.custom_op("graphamp::encoder_layer_under_autocast", mutates_args=())
def encoder_layer_under_autocast(
    src: torch.Tensor, embed_dim: int, num_heads: int, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor, proj_bias: torch.Tensor, use_gelu: bool, norm_first: bool, eps: float,
    norm_weight_1: torch.Tensor, norm_bias_1: torch.Tensor, norm_weight_2: torch.Tensor, norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor, ffn_bias_1: torch.Tensor, ffn_weight_2: torch.Tensor, ffn_bias_2: torch.Tensor,
    mask: torch.Tensor | None, mask_type: int | None, device_type: str, dtype: torch.dtype,
) -> torch.Tensor:
    """``_transformer_encoder_layer_fwd`` under ``device_type``'s autocast to ``dtype``
    (:func:`autocast_op`), as one op that AOTAutograd and inductor keep whole: traced through, the
    fused kernel would be recorded without the autocast it runs under, and run in fp32."""
    args = (src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
            norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask, mask_type)
    return autocast_op(FUSED_ENCODER_LAYER, device_type, dtype, *args)


@encoder_layer_under_autocast.register_fake
def _(src: torch.Tensor, embed_dim: int, *args: Any) -> torch.Tensor:
    *layer, device_type, dtype = args
    return torch.empty_like(src, dtype=fused_layer_dtype(src, (embed_dim, *layer), (device_type, dtype)))


# Named by the stable path, where generated code imports them and saved files find them.
for _stable in (
    AutocastState, KeptFunction, KeptGraphFunction, PartialTemplate, Slot, apply_function, apply_graph_function,
    autocast_op, autocast_state, current_autocast_state, fill,
):
    _stable.__module__ = "graphamp.runtime"
del _stable
