"""``graphamp bench``: graphamp against eager autocast and its alternatives, side by side in one process.

Every variant runs the same model (its own copy) on the same inputs. Timings are wall time per call,
after warm-up, in interleaved rounds (variant A, B, C, A, B, C, ...), so drifts of
the machine hit all variants alike; a row reports the median over rounds, the p10-p90 spread, and
ratios of medians to eager autocast, to the fastest pure low precision variant, to fp32 and to the
fastest alternative measured (``vs best``: the fastest of ``ALTERNATIVES`` among the variants run:
fp32, eager autocast, torch.compile + autocast and torch.compile in fp32, each compiled one with and
without freezing, i.e. what a user gets without graphamp at autocast's accuracy or better). Pure low
precision (``pure_low``, ``compile_pure_low``: the model and inputs in bf16/fp16) changes the
numerics, so it is compared in its own column. Where graphamp's compiled variants try inductor's C++
wrapper (``graphamp_autotune_compiled`` for inference), each compiled alternative is built with and
without it too and keeps the faster, by the same rule.

By default a run answers "what should I use on this machine?" with a few variants
(:func:`default_variants`: fp32, eager autocast, the compiled alternative expected fastest on this
CPU, graphamp exact and graphamp's path for this CPU) and ends with one line per model naming the
fastest at autocast's accuracy or better (:func:`recommendation`); ``--all`` runs every variant.

``--model`` takes built-in names or ``pkg.module:factory`` for your own model (the factory returns a
``graphamp.testing.zoo.Case`` or ``(model, args[, kwargs])``, as ``graphamp verify`` takes it).

Compiled graphamp variants: ``graphamp_compiled`` is ``graphamp.convert(..., compile=True)`` (for
``--task infer`` with ``inference=True``, so inductor freezes the low-precision weights), trained
with the same eager AdamW step as the other variants; ``graphamp_autotune_compiled`` is the same with
``mode="autotune"`` (the ops measured slower in low precision on this machine raised to fp32, then
compiled); ``trainstep_compiled`` is
``graphamp.TrainStep(..., compile=True)``, whose optimizer step is compiled too;
``trainstep_autotune`` and ``trainstep_autotune_compiled`` are the same with ``mode="autotune"``
(each op's forward and backward timed, the slower-in-low-precision ops raised to fp32).

Other columns:
* casts/call: ``aten._to_copy`` ops one call executes after warm-up, counted by lowering the call with
  ``make_fx`` (n/a for compiled variants, whose casts inductor fuses);
* peak MiB: the peak of tensor memory allocated during one call and still alive (activations,
  temporary weight copies), tracked per op output by a dispatch mode; parameters, inputs and
  caches made before the call are not counted (n/a for compiled variants);
* max err: the largest absolute difference of any output from eager autocast's, on the first call
  with identical weights (0 means bitwise equal);
* err vs fp32: the largest absolute difference of any output from fp32's, with eager autocast's own
  error against fp32 beside it (autotune must not exceed it);
* faults/call: the process's minor page faults per timed call. Where glibc's malloc gives a
  variant's freed buffers back to the OS between calls, each call faults fresh pages in, which can
  double a small model's time and depends on the process's history; the table then says which
  variants faulted (see the benchmark guide's "Page faults").
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from graphamp import hardware
from graphamp.testing import zoo
from graphamp.verify.reference import count_casts, lowered_graph
from graphamp.policy import DTYPE_ALIASES
from graphamp.bench import limits as bench_limits
from graphamp.bench.memory import peak_mib
from graphamp.bench.progress import Estimate, setup_kind, show_progress
from graphamp.bench.variants import (
    ALTERNATIVES, BENCH_MODELS, BUDGETED, COMPILED, CPP_WRAPPER_TRIED, DEFAULT_MODELS, DTYPES, INFER_ONLY, PURE_LOW, TASKS, TRAIN_ONLY, VARIANTS,
    CallModule, Variant, max_err, prepare,
)

__all__ = [
    "ALTERNATIVES", "BENCH_MODELS", "DEFAULT_MODELS", "DTYPES", "FASTER_RATIO", "PURE_LOW", "TASKS", "VARIANTS", "Row", "build_case",
    "default_variants", "low_matmul_faster", "recommendation", "run", "table", "to_json",
]


# A low-precision matmul counts as faster than fp32 on this CPU from this ratio of their rates on.
FASTER_RATIO = 1.2


def low_matmul_faster(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` matmuls faster than fp32: native per its flags, and one
    512x512 matmul at least :data:`FASTER_RATIO` times fp32's rate (an Intel Xeon with
    ``avx512_fp16`` but no ``amx_fp16`` runs fp16 matmuls natively at about fp32's rate). Where the
    flags say emulated, nothing is measured."""
    if not hardware.capability("cpu").native(dtype):
        return False
    return bench_limits.gemm_rate(dtype, n=512) >= FASTER_RATIO * bench_limits.gemm_rate(torch.float32, n=512)


def default_variants(task: str, dtype: str, *, low_is_faster: bool | None = None) -> tuple[str, ...]:
    """The few variants that answer "what should I use on this machine?": fp32, eager autocast, the
    compiled alternative expected fastest on this CPU (torch.compile + autocast where ``dtype``
    matmuls run faster than fp32, torch.compile in fp32 where they do not; with freezing for
    inference), graphamp exact (``inference=True`` for inference), and graphamp's path for this CPU
    (compiled where ``dtype`` is faster; autotune, which raises to fp32 each op measured slower in
    ``dtype``, where it is not). ``low_is_faster`` defaults to :func:`low_matmul_faster`.

    >>> default_variants("infer", "bf16", low_is_faster=True)[2:]
    ('compile_autocast_freezing', 'graphamp_inference', 'graphamp_compiled')
    >>> default_variants("train", "fp16", low_is_faster=False)[2:]
    ('compile_fp32', 'graphamp', 'graphamp_autotune')
    """
    if low_is_faster is None:
        low_is_faster = low_matmul_faster(DTYPE_ALIASES[dtype])
    alternative = ("compile_autocast" if low_is_faster else "compile_fp32") + ("_freezing" if task == "infer" else "")
    # For inference, graphamp exact is the grad-free conversion (inference=True), as a user serving
    # the model converts it; its self-check then runs no backward.
    exact = "graphamp_inference" if task == "infer" else "graphamp"
    return ("fp32", "autocast", alternative, exact, "graphamp_compiled" if low_is_faster else "graphamp_autotune")


def recommendation(rows: list[Row]) -> str:
    """One line per model: the variant to use on this machine, at autocast's accuracy or better,
    and why (pure low precision is left out: it changes the numerics)."""
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        ran = [r for r in rows if r.model == model and r.status == "ok" and r.median_ms and r.variant not in PURE_LOW]
        # A budgeted variant may trade accuracy: it counts here only where it measured autocast's or better.
        ok = [r for r in ran if r.variant not in BUDGETED or _as_accurate_as_autocast(r)]
        if not ok:
            continue
        best = min(ok, key=lambda r: r.median_ms)
        theirs = [r for r in ok if r.variant in ALTERNATIVES]
        ours = [r for r in ok if r.variant not in ALTERNATIVES]
        fastest_alt = min(theirs, key=lambda r: r.median_ms) if theirs else None
        fastest_ours = min(ours, key=lambda r: r.median_ms) if ours else None
        head = f"{model} ({best.task}, {best.dtype}): use {best.variant} ({best.median_ms:.3g} ms)"
        if best.variant in ALTERNATIVES and fastest_ours is not None:
            lines.append(
                f"{head}, the fastest here at autocast's accuracy or better; graphamp's fastest, {fastest_ours.variant}, "
                f"takes {fastest_ours.median_ms / best.median_ms:.2f}x its time{_within_noise(best, fastest_ours)}."
            )
        elif fastest_alt is not None and fastest_alt is not best:
            lines.append(
                f"{head}: {fastest_alt.median_ms / best.median_ms:.2f}x faster than the fastest alternative, "
                f"{fastest_alt.variant} ({fastest_alt.median_ms:.3g} ms), at autocast's accuracy or better"
                f"{_within_noise(best, fastest_alt)}."
            )
        else:
            lines.append(f"{head}, the fastest of the variants run.")
        traded = [r for r in ran if r.variant in BUDGETED and r not in ok]
        if traded and fastest_alt is not None:
            r = min(traded, key=lambda r: r.median_ms)
            lines.append(
                f"  within its error budget, {r.variant} takes {r.median_ms:.3g} ms ({r.median_ms / fastest_alt.median_ms:.2f}x "
                f"{fastest_alt.variant}), at an error vs fp32 of {_fmt(r.err_vs_fp32, '.3g')} against eager autocast's "
                f"{_fmt(r.autocast_err_vs_fp32, '.3g')}."
            )
    return "\n".join(lines)


def _within_noise(a: Row, b: Row) -> str:
    """Where two rows' p10-p90 ranges overlap, the words that say their order is not settled."""
    if None in (a.p10_ms, a.p90_ms, b.p10_ms, b.p90_ms) or a.p90_ms < b.p10_ms or b.p90_ms < a.p10_ms:
        return ""
    return " (within this run's noise: their p10-p90 ranges overlap)"


def _as_accurate_as_autocast(row: Row) -> bool:
    return row.err_vs_fp32 is not None and row.autocast_err_vs_fp32 is not None and row.err_vs_fp32 <= row.autocast_err_vs_fp32


@dataclass
class Row:
    model: str
    task: str
    dtype: str
    variant: str
    status: str = "ok"  # ok | error: ...
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    vs_autocast: float | None = None
    vs_pure_low: float | None = None
    vs_fp32: float | None = None
    vs_best: float | None = None  # median / the fastest of ALTERNATIVES measured
    best: str = ""  # which alternative that was
    casts_per_call: int | None = None
    peak_mib: float | None = None
    max_err: float | None = None
    err_vs_fp32: float | None = None
    autocast_err_vs_fp32: float | None = None
    note: str = ""
    setup_s: float | None = None
    faults_per_call: float | None = None  # minor page faults per timed call
    samples: list[float] = field(default_factory=list, repr=False)
    limits: str = ""  # where the time goes (``run(limits=True)``): on the fastest row of each model


def run(
    models: list[str] | tuple[str, ...] = DEFAULT_MODELS,
    *,
    task: str = "infer",
    dtype: str = "bf16",
    variants: list[str] | tuple[str, ...] | None = None,
    rounds: int = 7,
    target_s: float = 0.05,
    limits: bool = False,
) -> list[Row]:
    """Benchmark ``variants`` on ``models``; returns one Row per (model, variant). ``limits``: also
    where the time goes (:mod:`graphamp.bench.limits`): the matmul-only bound of a step on this
    CPU and, for each model's fastest variant at autocast's accuracy or better, how far it is from
    that bound and its share of time in matmul/conv kernels (costs a large GEMM timed per dtype,
    about 20 s where the CPU emulates it, and a few profiled steps)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    low = DTYPE_ALIASES[dtype]
    wanted = default_variants(task, dtype) if variants is None else variants
    chosen = [v for v in wanted if not (task != "train" and v in TRAIN_ONLY) and not (task != "infer" and v in INFER_ONLY)]
    for v in chosen:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    cpp_wrapper = task == "infer" and any(v in CPP_WRAPPER_TRIED for v in chosen)
    with _every_variant_compiled():
        return _run(models, task, dtype, low, chosen, rounds, target_s, limits, cpp_wrapper)


@contextlib.contextmanager
def _every_variant_compiled() -> Any:
    """Dynamo settings for the bench's own process: every compiled variant compiles the same
    ``forward``, and past dynamo's recompile limit (8 per code object) torch.compile silently runs
    the model eagerly, so a later variant would time fp32 eager under its own name. The limit is
    raised for as many variants as the bench has, and a variant that still hits it is an error."""
    import torch._dynamo.config as dynamo_config

    limit = max(dynamo_config.recompile_limit, 4 * len(COMPILED))
    with dynamo_config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        yield


def _run(
    models: list[str] | tuple[str, ...], task: str, dtype: str, low: torch.dtype, chosen: list[str], rounds: int,
    target_s: float, limits: bool, cpp_wrapper: bool,
) -> list[Row]:
    """:func:`run` after its arguments are checked."""
    eta = Estimate([(m, v, setup_kind(v, cpp_wrapper)) for m in models for v in chosen], rounds)
    rows: list[Row] = []
    for model_name in models:
        case = build_case(model_name)
        prepared: dict[str, Variant] = {}
        model_rows = {v: Row(model_name, task, dtype, v) for v in chosen}
        first_out: dict[str, Any] = {}
        for v in chosen:
            show_progress(f"[{model_name}] preparing {v} ... {eta.line()}")
            start = time.perf_counter()
            try:
                prepared[v] = prepare(v, case, task, low, cpp_wrapper=cpp_wrapper and v.startswith("compile_"))
                model_rows[v].note = prepared[v].note
                # first calls: compile/convert warm-up, and the error against eager autocast
                if prepared[v].forward is not None:
                    with torch.no_grad():
                        first_out[v] = prepared[v].forward()
                for _ in range(2):
                    warm = time.perf_counter()
                    prepared[v].step()
                # Its rounds, until measured below: a round calls it for about target_s, once at least.
                eta.per_round(model_name, v, max(time.perf_counter() - warm, target_s))
            except Exception as e:  # a variant that cannot run is reported, not fatal
                model_rows[v].status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            model_rows[v].setup_s = time.perf_counter() - start
            eta.prepared(model_name, v, model_rows[v].setup_s)
        live = [v for v in chosen if v in prepared and model_rows[v].status == "ok"]
        for v in set(chosen) - set(live):
            eta.failed(model_name, v)
        numbers = {}
        for v in live:
            per_call = max(_seconds_per_call(prepared[v].step, 1), 1e-6)
            numbers[v] = max(1, int(target_s / per_call))
            eta.per_round(model_name, v, per_call * numbers[v])
        faulted: dict[str, int | None] = dict.fromkeys(live, 0)
        for r in range(rounds):
            # The order alternates (A, B, C, C, B, A, ...): no variant always follows the same one, whose
            # run evicts its weights from the caches (its first calls after a switch are the slower).
            for v in live if r % 2 == 0 else live[::-1]:
                show_progress(f"[{model_name}] round {r + 1}/{rounds} {v} {eta.line()}")
                seconds, n = hardware.faults_of(lambda: _seconds_per_call(prepared[v].step, numbers[v]))
                model_rows[v].samples.append(seconds * 1e3)
                faulted[v] = None if n is None or faulted[v] is None else faulted[v] + n
                eta.timed(model_name, v)
        for v in live:
            row = model_rows[v]
            # One round (--rounds 1) has no spread: its p10 and p90 are its median.
            q = statistics.quantiles(row.samples, n=10, method="inclusive") if len(row.samples) > 1 else row.samples * 9
            row.median_ms, row.p10_ms, row.p90_ms = statistics.median(row.samples), q[0], q[-1]
            if faulted[v] is not None:
                row.faults_per_call = faulted[v] / (numbers[v] * rounds)
            if "autocast" in first_out and v in first_out:
                row.max_err = max_err(first_out[v], first_out["autocast"])
            if "fp32" in first_out and v in first_out:
                row.err_vs_fp32 = max_err(first_out[v], first_out["fp32"])
                if "autocast" in first_out:
                    row.autocast_err_vs_fp32 = max_err(first_out["autocast"], first_out["fp32"])
            if prepared[v].lowerable is not None and task == "infer":
                try:
                    with torch.no_grad():
                        row.casts_per_call = count_casts(lowered_graph(CallModule(prepared[v].lowerable), (), {}))
                except Exception:
                    row.casts_per_call = None
            if v not in COMPILED and v not in TRAIN_ONLY:
                row.peak_mib = peak_mib(prepared[v].step)
        base = model_rows.get("autocast")
        fp32 = model_rows.get("fp32")
        measured = [(model_rows[v].median_ms, v) for v in ALTERNATIVES if v in live and model_rows[v].median_ms]
        best, best_name = min(measured) if measured else (None, "")
        pure = min((model_rows[v] for v in PURE_LOW if v in live and model_rows[v].median_ms), key=lambda r: r.median_ms, default=None)
        for v in live:
            row = model_rows[v]
            if base is not None and base.median_ms:
                row.vs_autocast = row.median_ms / base.median_ms
            if pure is not None and pure.median_ms:
                row.vs_pure_low = row.median_ms / pure.median_ms
            if fp32 is not None and fp32.median_ms:
                row.vs_fp32 = row.median_ms / fp32.median_ms
            if best:
                row.vs_best = row.median_ms / best
                row.best = best_name
        if limits:
            show_progress(f"[{model_name}] where the time goes ... {eta.line()}")
            _add_limits(model_rows, prepared, case, task, low)
        rows.extend(model_rows.values())
    show_progress("")
    print(file=sys.stderr, end="")
    return rows


def _seconds_per_call(step: Callable[[], Any], number: int) -> float:
    """Wall seconds per call of ``step`` over ``number`` calls, with the threads torch uses. Timed
    directly: every variant is warm (prepared, then run twice), and ``benchmark.Timer.timeit``
    would call it twice more per round, which on an emulated-bf16 CPU doubled the default run's
    timing phase."""
    start = time.perf_counter()
    for _ in range(number):
        step()
    return (time.perf_counter() - start) / number


def _add_limits(model_rows: dict[str, Row], prepared: dict[str, Variant], case: zoo.Case, task: str, dtype: torch.dtype) -> None:
    """Set ``limits`` on the fastest row at autocast's accuracy or better: the matmul-only bound of
    a step (its matmul FLOPs, counted on an uncompiled fp32 copy, at this CPU's large-GEMM rate) and
    how far that row is from it (:func:`graphamp.bench.limits.limits_line`)."""
    ok = [r for r in model_rows.values() if r.status == "ok" and r.median_ms and r.variant not in PURE_LOW and r.variant in prepared]
    if not ok:
        return
    fastest = min(ok, key=lambda r: r.median_ms)
    try:
        flops = bench_limits.matmul_flops(prepare("fp32", case, task, dtype).step)
        variant = prepared[fastest.variant]
        split = bench_limits.time_split(variant.profiled, calls=2)
        fastest.limits = bench_limits.limits_line(flops, dtype, fastest=fastest.variant, fastest_ms=fastest.median_ms, split=split)
        if variant.profiled is not variant.step:
            fastest.limits += " (profiled with inductor's Python wrapper: the C++ wrapper's kernel calls bypass the profiler)"
    except Exception as e:  # a profile or count that fails costs the line, not the run
        fastest.limits = f"where the time goes: not measured ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def build_case(name: str) -> zoo.Case:
    """A built-in bench model (benchmark sizes), or ``pkg.module:factory`` for the user's own."""
    if name in BENCH_MODELS:
        return BENCH_MODELS[name]()
    if ":" in name:
        return zoo.build(name)
    raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(BENCH_MODELS)}, or pkg.module:factory")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row]) -> str:
    """A Markdown table of the rows."""
    head = (
        "| model | task | dtype | variant | median ms | p10-p90 ms | vs autocast | vs pure low | vs fp32 | vs best "
        "| casts/call | peak MiB | max err | err vs fp32 (autocast's) | faults/call | setup s |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.model} | {r.task} | {r.dtype} | {r.variant} | {r.status} |" + " |" * 11)
            continue
        lines.append(
            f"| {r.model} | {r.task} | {r.dtype} | {r.variant} | {_fmt(r.median_ms, '.3f')} | "
            f"{_fmt(r.p10_ms, '.3f')}-{_fmt(r.p90_ms, '.3f')} | {_fmt(r.vs_autocast, '.2f')} | "
            f"{_fmt(r.vs_pure_low, '.2f')} | {_fmt(r.vs_fp32, '.2f')} | {_fmt(r.vs_best, '.2f')} | "
            f"{_fmt(r.casts_per_call, 'd')} | {_fmt(r.peak_mib, '.1f')} | "
            f"{_fmt(r.max_err, '.3g')} | {_fmt(r.err_vs_fp32, '.3g')} ({_fmt(r.autocast_err_vs_fp32, '.3g')}) | "
            f"{_fmt(r.faults_per_call, '.0f')} | {_fmt(r.setup_s, '.1f')} |"
        )
    notes = [f"{r.model} {r.variant}: {r.note}" for r in rows if r.note]
    notes += _faults_note(rows)
    notes += [f"{r.model} ({r.task}, {r.dtype}), where the time goes: {r.limits}" for r in rows if r.limits]
    bests = {r.model: r.best for r in rows if r.best}
    if bests:
        notes += [f"vs best: each row over the fastest alternative without graphamp ({', '.join(ALTERNATIVES)} as run): "
                  + ", ".join(f"{m}: {b}" for m, b in bests.items())]
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def _faults_note(rows: list[Row]) -> list[str]:
    """A line naming the variants whose timed calls took page faults, and what that means."""
    faulted = [r for r in rows if r.faults_per_call is not None and r.faults_per_call >= hardware.FAULTS_SAID]
    if not faulted:
        return []
    named = ", ".join(f"{r.model} {r.variant} ({r.faults_per_call:.0f})" for r in faulted)
    return [
        f"page faults per call: {named}. These variants' calls faulted fresh pages in, and their times include "
        "that: memory malloc gave back to the OS between calls (with glibc's default thresholds, whether it does "
        "depends on what ran before in the process), or blocks above malloc's mapping threshold (32 MiB at most "
        "in glibc), which it maps anew on every call. See docs/benchmark.md#page-faults."
    ]


def to_json(rows: list[Row]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items()} for r in rows]
