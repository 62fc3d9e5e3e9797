"""Where a benchmarked program's time goes, and how fast its matmuls could go on this CPU (issue 37,
deliverable 4).

Two numbers put a bench row in perspective:

* :func:`time_split`: the share of a step's time spent in matmul, convolution and attention kernels
  (oneDNN, MKL and ATen's GEMMs), against everything else (inductor's generated ``cpp_fused_*``
  kernels, eager elementwise ops, normalizations, casts, the optimizer, Python and dispatch), from
  the profiler's per-op self times;
* :func:`matmul_bound_ms`: the time the step's matmul FLOPs (:func:`matmul_flops`, counted on the
  uncompiled step) would take at the rate of one large square matmul on this CPU
  (:func:`gemm_rate`), i.e. if every matmul ran as fast as a large GEMM and nothing else took time.
  No fusion or cast placement gets a program whose matmuls run in that dtype below it; how far the
  fastest variant is from it is what remains to win (a ratio below 1 against the low-precision bound
  says the program's matmuls do not run in the low dtype).

:func:`limits_line` puts both in one line for a bench table.

The bound is a lower bound in that sense only: small and skinny matmuls run slower than a large
square one, and a CPU's rate depends on the layout of the operands where its low precision is
emulated (on a CPU without ``avx512_bf16``/AMX, ATen's fallback bf16 GEMM runs ``a @ b.T`` about 10x
faster than ``a @ b``); a mixed-precision program may also raise matmuls to fp32, so both the
low-precision and the fp32 bound are given and the smaller is the program's bound.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "MATMUL_OPS",
    "Split",
    "gemm_rate",
    "is_matmul_op",
    "limits_line",
    "matmul_bound_ms",
    "matmul_dtype",
    "matmul_flops",
    "time_split",
]

# Profiler event names (``namespace::op``) whose own time is a matmul, convolution or attention
# kernel. Ops that only dispatch to one of these (aten::linear, aten::matmul, aten::einsum,
# aten::conv2d, aten::convolution, aten::scaled_dot_product_attention, autograd's MmBackward0 ...)
# are not listed: their children are, and their own time is dispatch glue (or, for aten::matmul and
# aten::einsum, reshape copies), counted as "other".
MATMUL_OPS: frozenset[str] = frozenset({
    # ATen's GEMM/GEMV kernels (MKL, oneDNN or ATen's own fallback, e.g. emulated bf16)
    "aten::mm", "aten::addmm", "aten::_addmm_activation", "aten::bmm", "aten::baddbmm", "aten::addbmm",
    "aten::mv", "aten::addmv", "aten::_int_mm", "aten::_scaled_mm", "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    # convolutions: aten::_convolution runs some kernels itself (depthwise 3x3 Winograd), the rest
    # in the backend ops below; aten::convolution_backward calls oneDNN's backward directly
    "aten::_convolution", "aten::mkldnn_convolution", "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward",
    "aten::slow_conv3d_forward", "aten::slow_conv_dilated2d", "aten::slow_conv_dilated3d", "aten::slow_conv_transpose2d",
    "aten::slow_conv_transpose3d", "aten::_nnpack_spatial_convolution", "aten::_conv_depthwise2d",
    "aten::convolution_backward",
    # oneDNN/MKL ops, eager and inductor's (freezing packs weights into mkl::_mkl_linear in fp32 and
    # mkldnn::_linear_pointwise / _convolution_pointwise where oneDNN takes the dtype; their own time
    # includes the fused pointwise epilogue)
    "aten::mkldnn_linear", "aten::mkldnn_linear_backward", "aten::mkldnn_linear_backward_input",
    "aten::mkldnn_linear_backward_weights", "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward",
    "mkl::_mkl_linear",
    # attention kernels (SDPA's CPU flash attention: two batched matmuls and the softmax between)
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
})
# oneDNN's fused ops, by prefix: mkldnn::_linear_pointwise, mkldnn::_convolution_pointwise(_),
# mkldnn::_convolution_transpose_pointwise, onednn::qlinear_pointwise, onednn::qconv*_pointwise ...
_MATMUL_PREFIXES = ("mkldnn::_linear", "mkldnn::_convolution", "onednn::qlinear", "onednn::qconv")

# The marker around each profiled call: its length is the call's time.
_CALL = "graphamp.bench.limits.call"

# (dtype, n, threads, layout) -> FLOP/s, measured once per process.
_RATES: dict[tuple[torch.dtype, int, int, str], float] = {}
_LAYOUTS = {"nn": "torch.mm(a, b)", "nt": "torch.mm(a, b.t())", "tn": "torch.mm(a.t(), b)"}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def is_matmul_op(name: str) -> bool:
    """Whether a profiler event's own time is a matmul, convolution or attention kernel.

    >>> assert is_matmul_op("aten::addmm") and is_matmul_op("mkldnn::_linear_pointwise")
    >>> assert not is_matmul_op("aten::linear") and not is_matmul_op("## Call CompiledFxGraph abc ##")
    """
    return name in MATMUL_OPS or name.startswith(_MATMUL_PREFIXES)


def gemm_rate(dtype: torch.dtype, *, n: int = 2048, layout: str = "nt") -> float:
    """FLOP/s (``2 n^3`` per call) of one ``n x n`` by ``n x n`` matmul in ``dtype`` on this CPU at
    the current intra-op thread count: the median of ``torch.utils.benchmark.Timer.blocked_autorange``
    over at least about three calls, after one warm-up call. Cached per (dtype, n, threads, layout)
    in the process.

    ``layout`` is how the operands are laid out: ``"nt"`` (default) is ``a @ b.T``, nn.Linear's
    forward (``x @ W.T``); ``"tn"`` is ``a.T @ b`` (a weight
    gradient), ``"nn"`` is ``a @ b``. MKL's fp32 GEMM runs all three alike; ATen's fallback for an
    emulated bf16 ran ``"nn"`` about 10x slower than ``"nt"`` on an AVX2-only CPU (over a minute at
    n=2048).

    >>> rate = gemm_rate(torch.float32, n=128)
    >>> assert rate > 0 and gemm_rate(torch.float32, n=128) == rate  # measured once, then cached
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    threads = torch.get_num_threads()
    key = (dtype, n, threads, layout)
    if key not in _RATES:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        timer = benchmark.Timer(_LAYOUTS[layout], globals={"torch": torch, "a": a, "b": b}, num_threads=threads)
        first = timer.timeit(1).median  # warm-up, and how long one call takes
        measured = timer.blocked_autorange(min_run_time=max(0.2, 3 * first))
        _RATES[key] = 2 * n**3 / measured.median
    return _RATES[key]


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                              out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _cpu_attention_flops() -> dict[Any, Any]:
    # FlopCounterMode has formulas for the CUDA flash/efficient attention ops, not for the CPU one
    # that SDPA dispatches to here; its arguments come in the same order (query, key, value, ...;
    # the backward: grad_out, query, key, value, ...), so SDPA's counts apply ([batch, heads, seq,
    # head dim] each; causal masks not discounted, as for the CUDA ops).
    ops = torch.ops.aten
    return {
        ops._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
        ops._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
    }


@contextlib.contextmanager
def _no_mha_fastpath() -> Iterator[None]:
    # nn.MultiheadAttention's and nn.TransformerEncoderLayer's inference fast path is one fused op
    # (aten::_transformer_encoder_layer_fwd, aten::_native_multi_head_attention) that FlopCounterMode
    # sees as one op without a formula: 0 FLOPs. Without it the same math runs as counted ops.
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def matmul_flops(step: Callable[[], Any]) -> int:
    """FLOPs of the matmuls, convolutions and attention one call of ``step`` runs (forward, and
    backward where ``step`` trains), counted by ``torch.utils.flop_counter.FlopCounterMode``:
    ``2 m n k`` per ``m x k`` by ``k x n`` matmul, the convolution's equivalent; elementwise ops,
    normalizations and the optimizer count 0. CPU attention (``_scaled_dot_product_flash_attention
    _for_cpu`` and its backward) is counted with FlopCounterMode's SDPA formulas, and the
    MultiheadAttention fast path is turned off for the count (its fused op has no formula).

    Count it on an UNCOMPILED step: eager fp32 or eager autocast (the FLOPs are the same). Under a
    compiled program the counter sees only the extern calls that dispatch through ATen (an
    ``extern_kernels.mm``), not oneDNN/MKL's packed ops (``mkldnn._linear_pointwise``,
    ``mkl._mkl_linear``), so it undercounts; it may also make dynamo recompile. A training step runs
    (and updates the weights) once more.

    With backward, a linear layer counts 2x its forward FLOPs where its input needs no gradient (the
    weight gradient only) and 3x where it does (weight and input gradients):

    >>> lin, x = torch.nn.Linear(64, 32), torch.randn(8, 64)
    >>> assert matmul_flops(lambda: lin(x)) == 2 * 8 * 64 * 32
    >>> assert matmul_flops(lambda: lin(x.requires_grad_()).sum().backward()) == 3 * 2 * 8 * 64 * 32
    """
    with _no_mha_fastpath(), FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as counter:
        step()
    return int(counter.get_total_flops())


def matmul_bound_ms(flops: int, dtype: torch.dtype, *, n: int = 2048) -> float:
    """``flops`` at :func:`gemm_rate` of ``dtype``, in ms: the time if every matmul ran at the rate of
    one large ``n x n`` matmul and nothing else took time.

    A lower bound in that sense only (small matmuls run slower than a large one, see the module
    docstring). For a mixed-precision program give both ``matmul_bound_ms(flops, low)`` and
    ``matmul_bound_ms(flops, torch.float32)``: it may run some matmuls in fp32, and where the low
    dtype is emulated the fp32 bound is the smaller.

    >>> ms = matmul_bound_ms(2 * 128**3, torch.float32, n=128)
    >>> assert abs(ms - 2 * 128**3 / gemm_rate(torch.float32, n=128) * 1e3) < 1e-9
    """
    return flops / gemm_rate(dtype, n=n) * 1e3


def matmul_dtype(variant: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a ``graphamp.bench`` variant's matmuls run in: fp32 for the fp32 variants, ``dtype``
    for pure low precision, None for mixed precision (autocast, graphamp: some in each).

    >>> assert matmul_dtype("compile_fp32_freezing", torch.bfloat16) == torch.float32
    >>> assert matmul_dtype("graphamp_compiled", torch.bfloat16) is None
    """
    if variant in ("fp32", "compile_fp32", "compile_fp32_freezing"):
        return torch.float32
    if variant in ("pure_low", "compile_pure_low"):
        return dtype
    return None


@dataclass(frozen=True)
class Split:
    """One call's time, in matmul/conv/attention kernels and in everything else (ms, per call).

    ``events``: (event name, "matmul" or "other", own ms per call) of every profiler event name
    seen, the slowest first, to check the classification; not compared.

    >>> s = Split(matmul_ms=3.0, other_ms=1.0)
    >>> assert s.fraction == 0.75 and s.total_ms == 4.0
    """

    matmul_ms: float
    other_ms: float
    events: tuple[tuple[str, str, float], ...] = field(default=(), compare=False, repr=False)

    @property
    def total_ms(self) -> float:
        return self.matmul_ms + self.other_ms

    @property
    def fraction(self) -> float:
        """The matmul/conv/attention share of the call's time, in [0, 1]."""
        return self.matmul_ms / self.total_ms if self.total_ms > 0 else 0.0


def _classify(event: Any) -> str | None:
    """"matmul" for an event that is a matmul op or runs inside one (aten::addmm's copy_ of the bias
    into its output, BLAS's beta * C; its output allocation; oneDNN's reorders under a convolution),
    "other" for any other event inside a profiled call, None outside the calls."""
    kind = "other"
    while event is not None:
        if kind == "other" and is_matmul_op(event.name):
            kind = "matmul"
        if event.name == _CALL:
            return kind
        event = event.cpu_parent
    return None


def time_split(step: Callable[[], Any], *, calls: int = 3) -> Split:
    """Runs ``step`` once (warm-up), then under ``torch.profiler`` (CPU activity) once more, not
    counted, and ``calls`` times, and splits each call's time into matmul/conv/attention kernels and
    everything else, averaged per call.

    Each counted call is a ``record_function`` range; its length is the call's time, and only the
    events inside one count (on the calls' thread: autograd runs a CPU backward on the caller's
    thread; OpenMP's workers record nothing). Matmul time is the *self* time (own time, children excluded, so nothing is counted twice) of every event that is
    a matmul op (:data:`MATMUL_OPS`: ``aten::mm``/``addmm``/``bmm``/..., oneDNN's
    ``mkldnn::_linear_pointwise`` and convolutions, MKL's ``mkl::_mkl_linear``, the CPU flash
    attention and its backward) or runs inside one; everything else in the call is "other". Under an
    inductor-compiled program that is: the generated ``cpp_fused_*`` kernels (recorded only with
    ``torch._inductor.config.cpp.enable_kernel_profile``; otherwise their time is the own time of the
    ``## Call CompiledFxGraph ... ##`` range that runs them), the wrapper's allocations and views,
    dynamo's guards. Inductor's extern matmuls (``extern_kernels.mm``, ``torch.ops.mkldnn.
    _linear_pointwise``, ``torch.ops.mkl._mkl_linear``) dispatch through ATen and appear under their
    op names, so they count as matmul.

    The profiler adds a few microseconds per recorded op, counted as "other": eager programs (many
    ops) look a little less matmul-bound than they are; the split is for comparison, not a timing.

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> x = torch.randn(32, 64)
    >>> split = time_split(lambda: mlp(x), calls=2)
    >>> assert split.matmul_ms > 0 and 0 <= split.fraction <= 1
    """
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        # Not counted: the profiler's first recorded events, and the first record_function (which
        # looks its op up: about 20 ms), cost more than the rest.
        with record_function("graphamp.bench.limits.warm-up"):
            step()
        for _ in range(calls):
            with record_function(_CALL):
                step()
    own: dict[tuple[str, str], float] = defaultdict(float)
    total_us = matmul_us = 0.0
    for e in prof.events():
        kind = None if getattr(e, "is_async", False) else _classify(e)
        if kind is None:
            continue
        own[(e.name, kind)] += e.self_cpu_time_total
        if e.name == _CALL:
            total_us += e.cpu_time_total
        elif kind == "matmul":
            matmul_us += e.self_cpu_time_total
    listed = sorted(((name, kind, us / calls / 1e3) for (name, kind), us in own.items()), key=lambda t: -t[2])
    return Split(matmul_us / calls / 1e3, (total_us - matmul_us) / calls / 1e3, tuple(listed))


def _ms(ms: float) -> str:
    return f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def limits_line(
    flops: int,
    dtype: torch.dtype,
    *,
    fastest: str | None = None,
    fastest_ms: float | None = None,
    split: Split | None = None,
    n: int = 2048,
) -> str:
    """One line for a bench table: the matmul-only bound of a step with ``flops`` matmul FLOPs in
    ``dtype`` and in fp32, the rates behind them, and, given the fastest variant's name and median
    ms (and its :func:`time_split`), how far it is from its bound (fp32 variants: the fp32 bound;
    mixed precision: both) and its matmul share.

    >>> line = limits_line(10**9, torch.float32, fastest="compile_fp32", fastest_ms=1234.5, n=128)
    >>> assert line.startswith("matmul-only bound") and "the fastest variant, compile_fp32, 1234 ms =" in line
    """
    low = _SHORT.get(dtype, str(dtype))
    bound_low, bound_fp32 = matmul_bound_ms(flops, dtype, n=n), matmul_bound_ms(flops, torch.float32, n=n)
    rate_low, rate_fp32 = gemm_rate(dtype, n=n) / 1e9, gemm_rate(torch.float32, n=n) / 1e9
    if dtype == torch.float32:
        head = f"matmul-only bound {_ms(bound_fp32)} ms in fp32: {flops / 1e9:.3g} GFLOP at {rate_fp32:.3g} GFLOP/s"
    else:
        head = (
            f"matmul-only bound {_ms(bound_low)} ms in {low} ({_ms(bound_fp32)} ms in fp32): {flops / 1e9:.3g} GFLOP at "
            f"{rate_low:.3g} GFLOP/s {low}, {rate_fp32:.3g} GFLOP/s fp32"
        )
    line = f"{head} (one {n}x{n} matmul here)"
    if fastest is None or fastest_ms is None:
        return line
    runs_in = matmul_dtype(fastest, dtype)
    if runs_in is not None or dtype == torch.float32:
        bound = bound_fp32 if (runs_in or dtype) == torch.float32 else bound_low
        name = _SHORT.get(runs_in or dtype, str(runs_in))
        far = f"{fastest_ms / bound:.2f}x the {name} bound"
    else:
        far = f"{fastest_ms / bound_low:.2f}x the {low} bound, {fastest_ms / bound_fp32:.2f}x the fp32 bound"
    line += f"; the fastest variant, {fastest}, {_ms(fastest_ms)} ms = {far}"
    if split is not None:
        line += f", spends {split.fraction:.0%} of its time in matmul/conv kernels"
    return line
