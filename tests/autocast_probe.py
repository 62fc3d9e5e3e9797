"""Read which cast policy an ATen overload follows under the installed torch's eager autocast.

An op is called through ``torch.ops.aten`` with autocast on, under a ``TorchDispatchMode`` that logs
every op that reaches the backend as (op key, input dtypes, output dtypes); autocast's own casts show
up there as ``_to_copy``. Each category of ``graphamp.policy`` is then *predicted*: its rule is
applied by hand (explicit casts, ``dtype=torch.float32``, the dtype-taking overload) and the op runs
with autocast off under the same log. The categories whose prediction gives the same log (and the
same error, if any) on every input variant are the ones eager autocast is consistent with. Logs are
compared as multisets because CUDA casts its arguments right to left.

CPU runs on real tensors. CUDA runs on fake CUDA tensors with the dispatcher's CUDA autocast
switched on by hand (``torch.autocast("cuda")`` disables itself on a CPU-only build).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphamp.policy import Category, op_key

__all__ = [
    "CANDIDATES",
    "NONE",
    "Inputs",
    "Outcome",
    "SAMPLES",
    "autocast_on",
    "consistent_categories",
    "device_context",
    "dtype_overload",
    "eligible",
    "make_sample",
    "observe",
    "predict",
    "registered",
    "resolve",
    "run_logged",
    "variants",
]

# "No autocast behaviour": the op runs exactly as it would with autocast off.
NONE = None

Args = tuple[tuple, dict]


def resolve(key: str) -> torch._ops.OpOverload:
    """``"softmax.int"`` -> ``torch.ops.aten.softmax.int``; the inverse of ``op_key``."""
    name, _, overload = key.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def registered(dispatch_key: str) -> set[str]:
    """Table keys of every op with a kernel for ``dispatch_key``; non-aten ops keep their namespace."""
    keys = set()
    for qualname in torch._C._dispatch_get_all_op_names():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, dispatch_key):
            continue
        namespace, _, rest = qualname.partition("::")
        keys.add(rest if namespace == "aten" else qualname)
    return keys


def eligible(value: Any, device: str) -> bool:
    """autocast_mode.h ``is_autocast_eligible``: floating, not float64, on the autocast device."""
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == device
        and value.is_floating_point()
        and value.dtype is not torch.float64
    )


class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # prim::device is a metadata query that fake tensors answer through the dispatcher.
        if func.namespace != "prim":
            self.calls.append((op_key(func), _dtypes((args, kwargs)), _dtypes(out)))
        return out


def _dtypes(tree: Any) -> tuple:
    """The dtype of every tensor and every dtype argument in ``tree``, in order."""
    return tuple(
        leaf.dtype if isinstance(leaf, torch.Tensor) else f"dtype={leaf}"
        for leaf in pytree.tree_leaves(tree)
        if isinstance(leaf, (torch.Tensor, torch.dtype))
    )


@dataclass(frozen=True)
class Outcome:
    """What one call did: the ops that reached the backend, the result's dtypes, or the error."""

    calls: tuple
    out: tuple | None
    error: str | None
    result: Any = field(default=None, compare=False, repr=False)

    def same_as(self, other: Outcome) -> bool:
        return (
            Counter(self.calls) == Counter(other.calls) and self.out == other.out and self.error == other.error
        )

    def casts(self) -> list[str]:
        return [f"{i[0]}->{o[0]}" for k, i, o in self.calls if k == "_to_copy" and i and o and i[0] != o[0]]

    def summary(self) -> str:
        if self.error is not None:
            return f"casts {self.casts()} then raised {self.error}"
        return f"casts {self.casts()}, output dtypes {list(self.out)}"


def run_logged(fn: Callable[[], Any]) -> Outcome:
    """Call ``fn`` under the dispatch log; an exception is part of the outcome."""
    log = _Log()
    try:
        with log:
            out = fn()
    except Exception as e:  # noqa: BLE001 - the error is what the op did, it is compared, not hidden
        first = (str(e).strip().splitlines() or [""])[0]
        return Outcome(tuple(log.calls), None, f"{type(e).__name__}: {first}")
    return Outcome(tuple(log.calls), _dtypes(out), None, out)


@contextlib.contextmanager
def device_context(device: str) -> Iterator[None]:
    """Where sample inputs are made and ops run: real CPU, or fake CUDA tensors without a GPU."""
    if device == "cpu":
        yield
        return
    # Fake CUDA tensors must never require grad: AccumulateGrad aborts the process on a CPU build.
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        yield


@contextlib.contextmanager
def autocast_on(device: str, low: torch.dtype) -> Iterator[None]:
    """Eager autocast for ``device``; CUDA is switched on in the dispatcher directly."""
    if device == "cpu":
        with torch.autocast("cpu", dtype=low):
            yield
        return
    old_dtype = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", low)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", old_dtype)
        torch.clear_autocast_cache()


def observe(op: Callable, args: tuple, kwargs: dict, device: str, low: torch.dtype) -> Outcome:
    """What eager autocast does to ``op(*args, **kwargs)``."""
    with autocast_on(device, low):
        return run_logged(lambda: op(*args, **kwargs))


def _cast_eligible(tree: Any, to: torch.dtype, device: str) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(to) if eligible(t, device) and t.dtype != to else t, tree
    )


def _with_arg(op: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str, value: Any) -> Args:
    index = [a.name for a in op._schema.arguments].index(name)
    if index < len(args):
        return args[:index] + (value,) + args[index + 1 :], kwargs
    return args, {**kwargs, name: value}


def _bound(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every schema argument by name, defaults filled in."""
    bound = {}
    for i, sarg in enumerate(op._schema.arguments):
        if i < len(args) and not sarg.kwarg_only:
            bound[sarg.name] = args[i]
        elif sarg.name in kwargs:
            bound[sarg.name] = kwargs[sarg.name]
        elif sarg.has_default_value():
            bound[sarg.name] = sarg.default_value
    return bound


def dtype_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The functional overload of the same op whose arguments are ``op``'s plus ``dtype``."""
    names = [a.name for a in op._schema.arguments] + ["dtype"]
    packet = getattr(torch.ops.aten, op._schema.name.split("::", 1)[1])
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if [a.name for a in candidate._schema.arguments] == names and not candidate._schema.is_mutable:
            return candidate
    return None


def predict(
    category: Category | None, op: torch._ops.OpOverload, args: tuple, kwargs: dict, device: str, low: torch.dtype
) -> Outcome | None:
    """What ``op`` would do if autocast applied ``category`` (autocast_mode.h); None if not applicable."""
    if category is NONE:
        return run_logged(lambda: op(*args, **kwargs))
    if category in (Category.LOWER_PRECISION_FP, Category.FP32, Category.PROMOTE):
        if category is Category.LOWER_PRECISION_FP:
            to = low
        elif category is Category.FP32:
            to = torch.float32
        else:
            leaves = [t for t in pytree.tree_leaves((args, kwargs)) if eligible(t, device)]
            to = torch.float32 if any(t.dtype is torch.float32 for t in leaves) else low

        def call() -> Any:
            cargs, ckwargs = _cast_eligible((args, kwargs), to, device)
            return op(*cargs, **ckwargs)

        return run_logged(call)
    bound = _bound(op, args, kwargs)
    first = bound[op._schema.arguments[0].name]
    if category is Category.FP32_SET_OPT_DTYPE:
        if "dtype" not in bound:
            return None
        if eligible(first, device) and bound["dtype"] is None:
            args, kwargs = _with_arg(op, args, kwargs, "dtype", torch.float32)
        return run_logged(lambda: op(*args, **kwargs))
    if category is Category.FP32_APPEND_DTYPE:
        target = dtype_overload(op)
        if target is None:
            return None
        dtype = torch.float32 if eligible(first, device) else first.dtype
        return run_logged(lambda: target(**bound, dtype=dtype))
    raise ValueError(f"no prediction for {category}")


CANDIDATES = (
    NONE,
    Category.LOWER_PRECISION_FP,
    Category.FP32,
    Category.FP32_SET_OPT_DTYPE,
    Category.FP32_APPEND_DTYPE,
    Category.PROMOTE,
)


def variants(op: torch._ops.OpOverload, args: tuple, kwargs: dict, low: torch.dtype) -> dict[str, Args]:
    """Input variants that tell the categories apart.

    fp32: every floating input fp32 (lower_precision_fp casts, the rest do not).
    low: every floating input low (fp32 and set_opt_dtype go to fp32, promote does not).
    mixed: the first floating input low, the others fp32 (promote goes to fp32).
    low+dtype=low: an explicit dtype, which set_opt_dtype respects and fp32 does not.
    """
    base = (args, kwargs)
    floats = [t for t in pytree.tree_leaves(base) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    out = {"fp32": base, "low": _cast_where(base, low, lambda t: t.is_floating_point())}
    if len(floats) > 1:
        out["mixed"] = _cast_where(base, low, lambda t: t is floats[0])
    bound = _bound(op, args, kwargs)
    if "dtype" in bound and bound["dtype"] is None:
        low_args, low_kwargs = out["low"]
        out["low+dtype=low"] = _with_arg(op, low_args, low_kwargs, "dtype", low)
    return out


def _cast_where(tree: Any, to: torch.dtype, which: Callable[[torch.Tensor], bool]) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(to) if which(t) else t, tree)


def _banned(outcome: Outcome) -> bool:
    # autocast_mode.cpp binary_cross_entropy_banned: raises before any cast.
    return outcome.error is not None and "unsafe to autocast" in outcome.error and not outcome.calls


def consistent_categories(
    key: str, device: str, low: torch.dtype
) -> tuple[set[Category | None], dict[str, str]]:
    """The categories whose prediction matches eager autocast on every variant, and what was seen.

    Call inside ``device_context(device)``.
    """
    op = resolve(key)
    args, kwargs = make_sample(key, device)
    found = {*CANDIDATES, Category.BANNED}
    seen = {}
    for name, (vargs, vkwargs) in variants(op, args, kwargs, low).items():
        observed = observe(op, vargs, vkwargs, device, low)
        seen[name] = observed.summary()
        if not _banned(observed):
            found.discard(Category.BANNED)
        for category in found - {Category.BANNED}:
            predicted = predict(category, op, vargs, vkwargs, device, low)
            if predicted is None or not predicted.same_as(observed):
                found.discard(category)
    return found, seen


class Inputs:
    """Small sample tensors on ``device``; deterministic on CPU, fake (values unused) on CUDA."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._gen = torch.Generator().manual_seed(0) if device == "cpu" else None

    def randn(self, *shape: int) -> torch.Tensor:
        if self._gen is None:
            return torch.randn(size=shape, device=self.device)
        return torch.randn(size=shape, generator=self._gen)

    def rand(self, *shape: int) -> torch.Tensor:
        """Uniform in (0.1, 0.9): probabilities, fractions, tau."""
        if self._gen is None:
            return torch.rand(size=shape, device=self.device)
        return torch.rand(size=shape, generator=self._gen) * 0.8 + 0.1

    def positive(self, *shape: int) -> torch.Tensor:
        return self.rand(*shape) + 0.5

    def sign(self, *shape: int) -> torch.Tensor:
        return torch.where(self.randn(*shape) > 0, 1.0, -1.0)

    def long(self, values: Any) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def square(self, n: int = 3) -> torch.Tensor:
        """Well conditioned: invertible, solvable, with distinct singular values."""
        return self.randn(n, n) * 0.3 + torch.diag(torch.arange(1.0, n + 1, device=self.device))

    def spd(self, n: int = 3) -> torch.Tensor:
        a = self.randn(n, n)
        return a @ a.T + n * torch.eye(n, device=self.device)

    def lower(self, n: int = 3) -> torch.Tensor:
        return torch.linalg.cholesky(self.spd(n))

    def grid(self, *shape: int) -> torch.Tensor:
        return self.rand(*shape) * 2 - 1

    def log_probs(self, *shape: int, dim: int = -1) -> torch.Tensor:
        return torch.log_softmax(self.randn(*shape), dim)


def _conv(dims: int, padding: str | None = None) -> Callable[[Inputs], Args]:
    def make(t: Inputs) -> Args:
        x, w, b = t.randn(1, 2, *[5] * dims), t.randn(3, 2, *[3] * dims), t.randn(3)
        return ((x, w, b, [1] * dims, padding), {}) if padding else ((x, w, b), {})
    return make


def _conv_transpose(dims: int) -> Callable[[Inputs], Args]:
    return lambda t: ((t.randn(1, 2, *[4] * dims), t.randn(2, 3, *[3] * dims), t.randn(3)), {})


def _unary(*shape: int, positive: bool = False, unit: bool = False) -> Callable[[Inputs], Args]:
    def make(t: Inputs) -> Args:
        return ((t.positive(*shape) if positive else t.rand(*shape) if unit else t.randn(*shape),), {})
    return make


def _pair_loss(t: Inputs) -> Args:
    return (t.randn(3, 4), t.randn(3, 4)), {}


def _upsample(dims: int, align: bool | None) -> Callable[[Inputs], Args]:
    def make(t: Inputs) -> Args:
        size = [6] * dims
        return ((t.randn(1, 2, *[4] * dims), size) + (() if align is None else (align,)), {})
    return make


def _rnn_params(t: Inputs, gates: int) -> list[torch.Tensor]:
    """The flat parameters of a two-layer RNN (input 5, hidden 4), as nn.RNN/GRU/LSTM pass them."""
    h = 4
    return [t.randn(gates * h, 5) * 0.3, t.randn(gates * h, h) * 0.3, t.randn(gates * h), t.randn(gates * h),
            t.randn(gates * h, h) * 0.3, t.randn(gates * h, h) * 0.3, t.randn(gates * h), t.randn(gates * h)]


def _packed(t: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed batch of 3 sequences of lengths 3, 2, 1 (data, batch_sizes)."""
    return t.randn(6, 5), torch.tensor([3, 2, 1])


def _max_unpool(t: Inputs, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = t.randn(1, 2, *[4] * dims)
    pool = torch.ops.aten.max_pool2d_with_indices if dims == 2 else torch.ops.aten.max_pool3d_with_indices
    values, indices = pool.default(x, [2] * dims, [2] * dims)
    return values, indices


def _mkldnn_rnn_layer(t: Inputs) -> Args:
    # One LSTM layer as aten::lstm.input passes it to oneDNN (mode 2 = LSTM): 4 weights, h0, c0, config.
    return (t.randn(6, 2, 5), t.randn(16, 5) * 0.3, t.randn(16, 4) * 0.3, t.randn(16), t.randn(16),
            t.randn(2, 4), t.randn(2, 4), False, [], 2, 4, 1, True, False, False, False), {}


def _householder(t: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten.geqrf.default(t.randn(4, 3))


SAMPLES: dict[str, Callable[[Inputs], Args]] = {
    # lower_precision_fp on CPU and/or CUDA
    "_addmm_activation": lambda t: ((t.randn(3), t.randn(2, 4), t.randn(4, 3)), {}),
    "_convolution": lambda t: ((t.randn(1, 2, 5, 5), t.randn(3, 2, 3, 3), t.randn(3), [1, 1], [0, 0], [1, 1],
                                False, [0, 0], 1, False, False, True, True), {}),
    "_convolution.deprecated": lambda t: ((t.randn(1, 2, 5, 5), t.randn(3, 2, 3, 3), t.randn(3), [1, 1], [0, 0],
                                           [1, 1], False, [0, 0], 1, False, False, True), {}),
    "_native_multi_head_attention": lambda t: ((t.randn(2, 3, 4), t.randn(2, 3, 4), t.randn(2, 3, 4), 4, 2,
                                                t.randn(12, 4), t.randn(12), t.randn(4, 4), t.randn(4)),
                                               {"need_weights": False}),
    "_scaled_dot_product_flash_attention": lambda t: ((t.randn(2, 2, 3, 8), t.randn(2, 2, 3, 8),
                                                       t.randn(2, 2, 3, 8)), {}),
    "_thnn_fused_gru_cell": lambda t: ((t.randn(3, 12), t.randn(3, 12), t.randn(3, 4), t.randn(12),
                                        t.randn(12)), {}),
    "_thnn_fused_lstm_cell": lambda t: ((t.randn(3, 16), t.randn(3, 16), t.randn(3, 4), t.randn(16),
                                         t.randn(16)), {}),
    "addbmm": lambda t: ((t.randn(3, 4), t.randn(2, 3, 5), t.randn(2, 5, 4)), {}),
    "addmm": lambda t: ((t.randn(3, 4), t.randn(3, 5), t.randn(5, 4)), {}),
    "addmv": lambda t: ((t.randn(3), t.randn(3, 4), t.randn(4)), {}),
    "addr": lambda t: ((t.randn(3, 4), t.randn(3), t.randn(4)), {}),
    "baddbmm": lambda t: ((t.randn(2, 3, 4), t.randn(2, 3, 5), t.randn(2, 5, 4)), {}),
    "bmm": lambda t: ((t.randn(2, 3, 5), t.randn(2, 5, 4)), {}),
    "chain_matmul": lambda t: (([t.randn(2, 3), t.randn(3, 4), t.randn(4, 2)],), {}),
    "conv1d": _conv(1),
    "conv1d.padding": _conv(1, "same"),
    "conv2d": _conv(2),
    "conv2d.padding": _conv(2, "same"),
    "conv3d": _conv(3),
    "conv3d.padding": _conv(3, "same"),
    "conv_tbc": lambda t: ((t.randn(5, 2, 3), t.randn(3, 3, 4), t.randn(4), 1), {}),
    "conv_transpose1d": _conv_transpose(1),
    "conv_transpose2d.input": _conv_transpose(2),
    "conv_transpose3d.input": _conv_transpose(3),
    "convolution": lambda t: ((t.randn(1, 2, 5, 5), t.randn(3, 2, 3, 3), t.randn(3), [1, 1], [0, 0], [1, 1],
                               False, [0, 0], 1), {}),
    "cudnn_convolution": lambda t: ((t.randn(1, 2, 5, 5), t.randn(3, 2, 3, 3), [0, 0], [1, 1], [1, 1], 1,
                                     False, False, True), {}),
    "cudnn_convolution_transpose": lambda t: ((t.randn(1, 2, 4, 4), t.randn(2, 3, 3, 3), [0, 0], [0, 0],
                                               [1, 1], [1, 1], 1, False, False, True), {}),
    "einsum": lambda t: (("ij,jk->ik", [t.randn(2, 3), t.randn(3, 4)]), {}),
    "gru_cell": lambda t: ((t.randn(3, 5), t.randn(3, 4), t.randn(12, 5), t.randn(12, 4), t.randn(12),
                            t.randn(12)), {}),
    "linalg_multi_dot": lambda t: (([t.randn(2, 3), t.randn(3, 4), t.randn(4, 2)],), {}),
    "linalg_vecdot": lambda t: ((t.randn(3, 4), t.randn(3, 4)), {}),
    "linear": lambda t: ((t.randn(2, 4), t.randn(3, 4), t.randn(3)), {}),
    "lstm_cell": lambda t: ((t.randn(3, 5), [t.randn(3, 4), t.randn(3, 4)], t.randn(16, 5), t.randn(16, 4),
                             t.randn(16), t.randn(16)), {}),
    "matmul": lambda t: ((t.randn(2, 3, 4), t.randn(4, 5)), {}),
    "mkldnn_rnn_layer": _mkldnn_rnn_layer,
    "mm": lambda t: ((t.randn(3, 5), t.randn(5, 4)), {}),
    "mv": lambda t: ((t.randn(3, 4), t.randn(4)), {}),
    "prelu": lambda t: ((t.randn(2, 3, 4), t.randn(3)), {}),
    "rnn_relu_cell": lambda t: ((t.randn(3, 5), t.randn(3, 4), t.randn(4, 5), t.randn(4, 4), t.randn(4),
                                 t.randn(4)), {}),
    "rnn_tanh_cell": lambda t: ((t.randn(3, 5), t.randn(3, 4), t.randn(4, 5), t.randn(4, 4), t.randn(4),
                                 t.randn(4)), {}),
    "scaled_dot_product_attention": lambda t: ((t.randn(2, 2, 3, 4), t.randn(2, 2, 3, 4), t.randn(2, 2, 3, 4)),
                                               {}),
    # fp32
    "_grid_sampler_2d_cpu_fallback": lambda t: ((t.randn(1, 2, 4, 4), t.grid(1, 3, 3, 2), 0, 0, False), {}),
    "_lu_with_info": lambda t: ((t.square(),), {}),
    "_upsample_bicubic2d_aa": _upsample(2, False),
    "_upsample_bilinear2d_aa": _upsample(2, False),
    "_upsample_nearest_exact1d": _upsample(1, None),
    "_upsample_nearest_exact2d": _upsample(2, None),
    "_upsample_nearest_exact3d": _upsample(3, None),
    "acos": _unary(3, 4, unit=True),
    "adaptive_avg_pool3d": lambda t: ((t.randn(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "adaptive_max_pool3d": lambda t: ((t.randn(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "asin": _unary(3, 4, unit=True),
    "avg_pool3d": lambda t: ((t.randn(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "binary_cross_entropy": lambda t: ((t.rand(3, 4), t.rand(3, 4)), {}),
    "binary_cross_entropy_with_logits": lambda t: ((t.randn(3, 4), t.rand(3, 4)), {}),
    "cdist": lambda t: ((t.randn(3, 4), t.randn(5, 4)), {}),
    "cholesky": lambda t: ((t.spd(),), {}),
    "cholesky_inverse": lambda t: ((t.lower(),), {}),
    "cholesky_solve": lambda t: ((t.randn(3, 2), t.lower()), {}),
    "cosh": _unary(3, 4),
    "cosine_embedding_loss": lambda t: ((t.randn(3, 4), t.randn(3, 4), t.sign(3)), {}),
    "cosine_similarity": _pair_loss,
    "cross_entropy_loss": lambda t: ((t.randn(3, 5), t.long([0, 4, 2])), {}),
    "ctc_loss.IntList": lambda t: ((t.log_probs(6, 2, 4), t.long([[1, 2, 3], [2, 1, 0]]), [6, 6], [3, 2]), {}),
    "ctc_loss.Tensor": lambda t: ((t.log_probs(6, 2, 4), t.long([[1, 2, 3], [2, 1, 0]]), t.long([6, 6]),
                                   t.long([3, 2])), {}),
    "dist": lambda t: ((t.randn(3), t.randn(3)), {}),
    "erfinv": _unary(3, 4, unit=True),
    "exp": _unary(3, 4),
    "expm1": _unary(3, 4),
    "fake_quantize_per_tensor_affine": lambda t: ((t.randn(3, 4), 0.1, 0, 0, 255), {}),
    "fft_fft": _unary(8),
    "fft_fft2": _unary(4, 4),
    "fft_fftn": _unary(4, 4),
    "fft_hfft": _unary(5),
    "fft_ifft": _unary(8),
    "fft_ifft2": _unary(4, 4),
    "fft_ifftn": _unary(4, 4),
    "fft_ihfft": _unary(8),
    "fft_irfft": _unary(5),
    "fft_irfft2": _unary(4, 4),
    "fft_irfftn": _unary(4, 4),
    "fft_rfft": _unary(8),
    "fft_rfft2": _unary(4, 4),
    "fft_rfftn": _unary(4, 4),
    "fractional_max_pool2d": lambda t: ((t.randn(1, 2, 6, 6), [2, 2], [3, 3], t.rand(1, 2, 2)), {}),
    "fractional_max_pool3d": lambda t: ((t.randn(1, 2, 6, 6, 6), [2, 2, 2], [3, 3, 3], t.rand(1, 2, 3)), {}),
    "frobenius_norm.dim": lambda t: ((t.randn(3, 4), [1]), {}),
    "geqrf": lambda t: ((t.randn(4, 3),), {}),
    "grid_sampler": lambda t: ((t.randn(1, 2, 4, 4), t.grid(1, 3, 3, 2), 0, 0, False), {}),
    "grid_sampler_2d": lambda t: ((t.randn(1, 2, 4, 4), t.grid(1, 3, 3, 2), 0, 0, False), {}),
    "grid_sampler_3d": lambda t: ((t.randn(1, 2, 4, 4, 4), t.grid(1, 3, 3, 3, 3), 0, 0, False), {}),
    "group_norm": lambda t: ((t.randn(2, 4, 3), 2, t.randn(4), t.randn(4)), {}),
    "hinge_embedding_loss": lambda t: ((t.randn(3, 4), t.sign(3, 4)), {}),
    "huber_loss": _pair_loss,
    "inverse": lambda t: ((t.square(),), {}),
    "kl_div": lambda t: ((t.log_probs(3, 4), t.rand(3, 4)), {}),
    "l1_loss": _pair_loss,
    "layer_norm": lambda t: ((t.randn(2, 3, 4), [4], t.randn(4), t.randn(4)), {}),
    "linalg_cholesky": lambda t: ((t.spd(),), {}),
    "linalg_cholesky_ex": lambda t: ((t.spd(),), {}),
    "linalg_cond": lambda t: ((t.square(),), {}),
    "linalg_cond.p_str": lambda t: ((t.square(), "fro"), {}),
    "linalg_eig": lambda t: ((t.square(),), {}),
    "linalg_eigh": lambda t: ((t.spd(),), {}),
    "linalg_eigvals": lambda t: ((t.square(),), {}),
    "linalg_eigvalsh": lambda t: ((t.spd(),), {}),
    "linalg_householder_product": lambda t: (_householder(t), {}),
    "linalg_inv": lambda t: ((t.square(),), {}),
    "linalg_inv_ex": lambda t: ((t.square(),), {}),
    "linalg_lstsq": lambda t: ((t.randn(4, 3), t.randn(4, 2)), {}),
    "linalg_matrix_norm": lambda t: ((t.square(), 1), {}),
    "linalg_matrix_norm.str_ord": lambda t: ((t.square(), "fro"), {}),
    "linalg_matrix_rank": lambda t: ((t.square(), 1e-3), {}),
    "linalg_matrix_rank.atol_rtol_float": lambda t: ((t.square(),), {"atol": 0.1}),
    "linalg_matrix_rank.atol_rtol_tensor": lambda t: ((t.square(),), {"atol": t.rand()}),
    "linalg_matrix_rank.tol_tensor": lambda t: ((t.square(), t.rand()), {}),
    "linalg_qr": lambda t: ((t.randn(4, 3),), {}),
    "linalg_solve": lambda t: ((t.square(), t.randn(3, 2)), {}),
    "linalg_svd": lambda t: ((t.randn(4, 3),), {}),
    "linalg_svdvals": lambda t: ((t.randn(4, 3),), {}),
    "linalg_tensorinv": lambda t: ((t.square(4).reshape(2, 2, 4),), {}),
    "linalg_tensorsolve": lambda t: ((t.square(6).reshape(2, 3, 6), t.randn(2, 3)), {}),
    "linalg_vector_norm": _unary(3, 4),
    "log": _unary(3, 4, positive=True),
    "log10": _unary(3, 4, positive=True),
    "log1p": _unary(3, 4, positive=True),
    "log2": _unary(3, 4, positive=True),
    "logsumexp": lambda t: ((t.randn(3, 4), [1]), {}),
    "lu_solve": lambda t: ((t.randn(3, 2), *torch.linalg.lu_factor(t.square())), {}),
    "margin_ranking_loss": lambda t: ((t.randn(3), t.randn(3), t.sign(3)), {}),
    "max_pool3d": lambda t: ((t.randn(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "max_unpool2d": lambda t: ((*_max_unpool(t, 2), [4, 4]), {}),
    "max_unpool3d": lambda t: ((*_max_unpool(t, 3), [4, 4, 4], [2, 2, 2], [0, 0, 0]), {}),
    "mse_loss": _pair_loss,
    "multi_margin_loss": lambda t: ((t.randn(3, 5), t.long([0, 4, 2])), {}),
    "multilabel_margin_loss": lambda t: ((t.randn(3, 4), t.long([[3, 0, -1, 1], [1, 2, 3, -1], [0, -1, 2, 1]])),
                                         {}),
    "multilabel_margin_loss_forward": lambda t: ((t.randn(3, 4),
                                                  t.long([[3, 0, -1, 1], [1, 2, 3, -1], [0, -1, 2, 1]]), 1), {}),
    "nanquantile": lambda t: ((t.randn(10), t.rand(2)), {}),
    "nanquantile.scalar": lambda t: ((t.randn(10), 0.3), {}),
    "native_layer_norm": lambda t: ((t.randn(2, 3, 4), [4], t.randn(4), t.randn(4), 1e-5), {}),
    "nll_loss": lambda t: ((t.log_probs(3, 5), t.long([0, 4, 2])), {}),
    "nll_loss2d": lambda t: ((t.log_probs(2, 3, 2, 2, dim=1), t.long([[[0, 1], [2, 0]], [[1, 1], [2, 2]]])), {}),
    "norm.Scalar": lambda t: ((t.randn(3, 4), 2), {}),
    "norm.ScalarOpt_dim": lambda t: ((t.randn(3, 4), 2, [1]), {}),
    "nuclear_norm": lambda t: ((t.randn(3, 3),), {}),
    "nuclear_norm.dim": lambda t: ((t.randn(3, 3), [0, 1]), {}),
    "orgqr": lambda t: (_householder(t), {}),
    "ormqr": lambda t: ((*_householder(t), t.randn(4, 2)), {}),
    "pdist": lambda t: ((t.randn(4, 3),), {}),
    "pinverse": lambda t: ((t.randn(3, 4),), {}),
    "poisson_nll_loss": lambda t: ((t.randn(3, 4), t.positive(3, 4), True, False, 1e-8, 1), {}),
    "polar": lambda t: ((t.positive(3), t.randn(3)), {}),
    "pow.Scalar": lambda t: ((2.0, t.randn(3, 4)), {}),
    "pow.Tensor_Scalar": lambda t: ((t.positive(3, 4), 2.5), {}),
    "pow.Tensor_Tensor": lambda t: ((t.positive(3, 4), t.randn(3, 4)), {}),
    "prod": _unary(3, 4),
    "prod.dim_int": lambda t: ((t.randn(3, 4), 1), {}),
    "qr": lambda t: ((t.randn(4, 3),), {}),
    "quantile": lambda t: ((t.randn(10), t.rand(2)), {}),
    "quantile.scalar": lambda t: ((t.randn(10), 0.3), {}),
    "reciprocal": _unary(3, 4, positive=True),
    "reflection_pad1d": lambda t: ((t.randn(1, 2, 5), [1, 1]), {}),
    "reflection_pad2d": lambda t: ((t.randn(1, 2, 4, 4), [1, 1, 1, 1]), {}),
    "renorm": lambda t: ((t.randn(3, 4), 2, 0, 1.0), {}),
    "replication_pad1d": lambda t: ((t.randn(1, 2, 5), [1, 1]), {}),
    "replication_pad2d": lambda t: ((t.randn(1, 2, 4, 4), [1, 1, 1, 1]), {}),
    "replication_pad3d": lambda t: ((t.randn(1, 2, 3, 3, 3), [1, 1, 1, 1, 1, 1]), {}),
    "rms_norm": lambda t: ((t.randn(2, 3, 4), [4], t.randn(4)), {}),
    "rsqrt": _unary(3, 4, positive=True),
    "sinh": _unary(3, 4),
    "smooth_l1_loss": _pair_loss,
    "soft_margin_loss": lambda t: ((t.randn(3, 4), t.sign(3, 4)), {}),
    "softplus": _unary(3, 4),
    "stft": lambda t: ((t.randn(32), 8), {"return_complex": True}),
    "stft.center": lambda t: ((t.randn(32), 8), {"return_complex": True}),
    "svd": lambda t: ((t.randn(4, 3),), {}),
    "tan": _unary(3, 4),
    "trace": lambda t: ((t.randn(3, 3),), {}),
    "triangular_solve": lambda t: ((t.randn(3, 2), t.lower().T.contiguous()), {}),
    "triplet_margin_loss": lambda t: ((t.randn(3, 4), t.randn(3, 4), t.randn(3, 4)), {}),
    "upsample_bicubic2d": _upsample(2, False),
    "upsample_bilinear2d": _upsample(2, False),
    "upsample_linear1d": _upsample(1, False),
    "upsample_nearest1d": _upsample(1, None),
    "upsample_nearest2d": _upsample(2, None),
    "upsample_nearest3d": _upsample(3, None),
    "upsample_trilinear3d": _upsample(3, False),
    "view_as_complex": lambda t: ((t.randn(3, 2),), {}),
    # fp32_set_opt_dtype (CUDA)
    "cumprod": lambda t: ((t.randn(3, 4), 1), {}),
    "cumsum": lambda t: ((t.randn(3, 4), 1), {}),
    "log_softmax.int": lambda t: ((t.randn(3, 4), 1), {}),
    "softmax.int": lambda t: ((t.randn(3, 4), 1), {}),
    "sum": _unary(3, 4),
    "sum.dim_IntList": lambda t: ((t.randn(3, 4), [1]), {}),
    # promote
    "addcdiv": lambda t: ((t.randn(3), t.randn(3), t.positive(3)), {}),
    "addcmul": lambda t: ((t.randn(3), t.randn(3), t.randn(3)), {}),
    "atan2": lambda t: ((t.randn(3), t.randn(3)), {}),
    "bilinear": lambda t: ((t.randn(2, 3), t.randn(2, 4), t.randn(5, 3, 4), t.randn(5)), {}),
    "cat": lambda t: (([t.randn(2, 3), t.randn(2, 3)],), {}),
    "cross": lambda t: ((t.randn(2, 3), t.randn(2, 3)), {}),
    "dot": lambda t: ((t.randn(3), t.randn(3)), {}),
    "index_copy": lambda t: ((t.randn(5, 3), 0, t.long([0, 2, 4]), t.randn(3, 3)), {}),
    "index_put": lambda t: ((t.randn(5, 3), [t.long([0, 2])], t.randn(2, 3)), {}),
    "scatter_add": lambda t: ((t.randn(3, 4), 1, t.long([[0, 1], [2, 3], [1, 0]]), t.randn(3, 2)), {}),
    "stack": lambda t: (([t.randn(2, 3), t.randn(2, 3)],), {}),
    "tensordot": lambda t: ((t.randn(2, 3, 4), t.randn(4, 3, 5), [1, 2], [1, 0]), {}),
    "vdot": lambda t: ((t.randn(3), t.randn(3)), {}),
    # unregistered composites (policy.effective / policy.opaque) and controls
    "upsample_nearest2d.vec": lambda t: ((t.randn(1, 2, 4, 4), [6, 6], None), {}),
    "upsample_bilinear2d.vec": lambda t: ((t.randn(1, 2, 4, 4), [6, 6], False, None), {}),
    "lstm.input": lambda t: ((t.randn(2, 6, 5), [t.randn(2, 2, 4), t.randn(2, 2, 4)], _rnn_params(t, 4), True, 2,
                              0.0, False, False, True), {}),
    "lstm.data": lambda t: ((*_packed(t), [t.randn(2, 3, 4), t.randn(2, 3, 4)], _rnn_params(t, 4), True, 2, 0.0,
                             False, False), {}),
    "gru.input": lambda t: ((t.randn(2, 6, 5), t.randn(2, 2, 4), _rnn_params(t, 3), True, 2, 0.0, False, False,
                             True), {}),
    "gru.data": lambda t: ((*_packed(t), t.randn(2, 3, 4), _rnn_params(t, 3), True, 2, 0.0, False, False), {}),
    "rnn_tanh.input": lambda t: ((t.randn(2, 6, 5), t.randn(2, 2, 4), _rnn_params(t, 1), True, 2, 0.0, False,
                                  False, True), {}),
    "rnn_tanh.data": lambda t: ((*_packed(t), t.randn(2, 3, 4), _rnn_params(t, 1), True, 2, 0.0, False, False),
                                {}),
    "rnn_relu.input": lambda t: ((t.randn(2, 6, 5), t.randn(2, 2, 4), _rnn_params(t, 1), True, 2, 0.0, False,
                                  False, True), {}),
    "rnn_relu.data": lambda t: ((*_packed(t), t.randn(2, 3, 4), _rnn_params(t, 1), True, 2, 0.0, False, False),
                                {}),
    "add.Tensor": lambda t: ((t.randn(3, 4), t.randn(3, 4)), {}),
    "mul.Tensor": lambda t: ((t.randn(3, 4), t.randn(3, 4)), {}),
    "gelu": _unary(3, 4),
    "relu": _unary(3, 4),
    "tanh": _unary(3, 4),
    "sigmoid": _unary(3, 4),
    "mean": _unary(3, 4),
    "_softmax": lambda t: ((t.randn(3, 4), 1, False), {}),
    "batch_norm": lambda t: ((t.randn(2, 3, 4), t.randn(3), t.randn(3), t.randn(3), t.positive(3), True, 0.1,
                              1e-5, True), {}),
    "dropout": lambda t: ((t.randn(3, 4), 0.5, True), {}),
    "embedding": lambda t: ((t.randn(5, 3), t.long([0, 4, 2])), {}),
    "avg_pool2d": lambda t: ((t.randn(1, 2, 4, 4), [2, 2]), {}),
    "max_pool2d": lambda t: ((t.randn(1, 2, 4, 4), [2, 2]), {}),
    "where.self": lambda t: ((t.randn(3, 4) > 0, t.randn(3, 4), t.randn(3, 4)), {}),
}


def make_sample(key: str, device: str) -> Args:
    """(args, kwargs) for ``key`` with every floating tensor fp32 on ``device``; call in device_context."""
    if key not in SAMPLES:
        raise KeyError(f"no sample inputs for {key!r}: add a SAMPLES entry in tests/autocast_probe.py")
    return SAMPLES[key](Inputs(device))
