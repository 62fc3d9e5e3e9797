"""``graphamp bench``: graphamp against eager autocast and its alternatives, side by side in one process.

Every variant runs the same model (its own copy) on the same inputs. Timings come from
``torch.utils.benchmark.Timer`` in interleaved rounds (variant A, B, C, A, B, C, ...), so drifts of
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
  error against fp32 beside it (autotune must not exceed it).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

import graphamp
from graphamp import hardware
from graphamp.backend.inductor import inductor_freezing
from graphamp.testing import zoo
from graphamp.verify.reference import count_casts, lowered_graph
from graphamp.policy import DTYPE_ALIASES
from graphamp import bench_limits
from graphamp.autotune import compiled as autotune_compiled
from graphamp.autotune.plan import AutotunePlan

__all__ = ["ALTERNATIVES", "BENCH_MODELS", "DEFAULT_MODELS", "PURE_LOW", "VARIANTS", "Row", "build_case", "default_variants", "recommendation", "run"]

DTYPES = ("bf16", "fp16")  # the short names of graphamp.policy.DTYPE_ALIASES

# Benchmark sizes: large enough that compute, not Python, is most of a call.
BENCH_MODELS: dict[str, Callable[[], zoo.Case]] = {
    "mlp": lambda: zoo.mlp(),
    "checkerboard": lambda: zoo.checkerboard(),
    "transformer_encoder": lambda: _sized(zoo.transformer_encoder(d_model=256, layers=4, heads=8), 8, 128),
    "many_small_ops": lambda: zoo.many_small_ops(),
    "bert": lambda: _sized(zoo.bert(layers=4, hidden=256, heads=4), 8, 128),
    "gpt2": lambda: _sized(zoo.gpt2(layers=4, hidden=256, heads=4), 8, 128),
    "vit": lambda: _sized(zoo.vit(layers=4, hidden=256, heads=4, image=64), 8, 0),
}
DEFAULT_MODELS = ("bert",)

VARIANTS = (
    "fp32",
    "autocast",
    "pure_low",
    "graphamp",
    "graphamp_inference",
    "graphamp_autotune",
    "compile_autocast",
    "compile_autocast_freezing",
    "compile_fp32",
    "compile_fp32_freezing",
    "compile_pure_low",
    "graphamp_backend",
    "graphamp_compiled",
    "graphamp_autotune_compiled",
    "trainstep",
    "trainstep_compiled",
    "trainstep_autotune",
    "trainstep_autotune_compiled",
)
# "infer": eval under no_grad; "forward": eval with grad enabled, no backward (eager's program may
# differ by grad mode: a fused encoder kernel); "train": train mode, forward, backward, AdamW step.
TASKS = ("infer", "forward", "train")
INFER_ONLY = {"graphamp_inference", "compile_autocast_freezing", "compile_fp32_freezing", "compile_pure_low"}
TRAIN_ONLY = {"trainstep", "trainstep_compiled", "trainstep_autotune", "trainstep_autotune_compiled"}
COMPILED = {
    "compile_autocast", "compile_autocast_freezing", "compile_fp32", "compile_fp32_freezing", "compile_pure_low",
    "graphamp_backend", "graphamp_compiled", "graphamp_autotune_compiled", "trainstep_compiled", "trainstep_autotune_compiled",
}
# What a user gets without graphamp at autocast's accuracy or better: ``vs best`` divides by the
# fastest of these that ran.
ALTERNATIVES = ("fp32", "autocast", "compile_autocast", "compile_autocast_freezing", "compile_fp32", "compile_fp32_freezing")
# Pure low precision (weights and activations in bf16/fp16), eager and compiled: faster where the CPU
# computes it natively, and less accurate than autocast; ``vs pure low`` divides by the fastest.
PURE_LOW = ("pure_low", "compile_pure_low")
# Compiled alternatives whose inductor options include what graphamp's compiled variants try: for
# inference, graphamp_autotune_compiled also builds its program with inductor's C++ wrapper and keeps
# it where it times faster, so each of these does the same when that variant runs.
CPP_WRAPPER_TRIED = ("graphamp_autotune_compiled",)


def default_variants(task: str, dtype: str) -> tuple[str, ...]:
    """The few variants that answer "what should I use on this machine?": fp32, eager autocast, the
    compiled alternative expected fastest on this CPU (torch.compile + autocast where it computes
    ``dtype`` natively, torch.compile in fp32 where it emulates it; with freezing for inference),
    graphamp exact, and graphamp's path for this CPU (compiled where ``dtype`` is native; autotune,
    which raises to fp32 each op measured slower in ``dtype``, where it is emulated).

    >>> from graphamp.hardware import assume_cpu_flags
    >>> with assume_cpu_flags(["avx512_bf16"]):
    ...     assert default_variants("infer", "bf16")[2:] == ("compile_autocast_freezing", "graphamp", "graphamp_compiled")
    >>> with assume_cpu_flags([]):
    ...     assert default_variants("train", "bf16")[2:] == ("compile_fp32", "graphamp", "graphamp_autotune")
    """
    native = hardware.capability("cpu").native(DTYPE_ALIASES[dtype])
    alternative = ("compile_autocast" if native else "compile_fp32") + ("_freezing" if task == "infer" else "")
    return ("fp32", "autocast", alternative, "graphamp", "graphamp_compiled" if native else "graphamp_autotune")


def recommendation(rows: list[Row]) -> str:
    """One line per model: the variant to use on this machine, at autocast's accuracy or better,
    and why (pure low precision is left out: it changes the numerics)."""
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        ok = [r for r in rows if r.model == model and r.status == "ok" and r.median_ms and r.variant not in PURE_LOW]
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
                f"takes {fastest_ours.median_ms / best.median_ms:.2f}x its time."
            )
        elif fastest_alt is not None:
            lines.append(
                f"{head}: {fastest_alt.median_ms / best.median_ms:.2f}x faster than the fastest alternative, "
                f"{fastest_alt.variant} ({fastest_alt.median_ms:.3g} ms), at autocast's accuracy or better."
            )
        else:
            lines.append(f"{head}, the fastest of the variants run.")
    return "\n".join(lines)


def _sized(case: zoo.Case, batch: int, seq: int) -> zoo.Case:
    case.batch, case.seq = batch, seq or case.seq
    return case


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
    samples: list[float] = field(default_factory=list, repr=False)
    limits: str = ""  # where the time goes (``run(limits=True)``): on the fastest row of each model


def _cast_inputs(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)


def _outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Variant:
    """A prepared variant: ``step()`` runs one forward (infer) or one training step (train)."""

    def __init__(self, step: Callable[[], Any], forward: Callable[[], Any] | None, lowerable: Callable[[], Any] | None) -> None:
        self.step = step
        self.forward = forward
        self.lowerable = lowerable
        self.note = ""


def _faster_with_cpp_wrapper(
    call: Callable[[], Any], compiled_call: Callable[[dict[str, Any]], Callable[[], Any]],
    as_step: Callable[[Callable[[], Any], Any], Callable[[], Any]],
) -> tuple[Callable[[], Any], str]:
    """``call``, or the same program built with inductor's C++ wrapper where that times faster, by the
    rule graphamp's autotune applies to its own (:mod:`graphamp.autotune.compiled`)."""
    cpp = compiled_call({"cpp_wrapper": True})
    steps = {"plan": as_step(call, ()), "C++ wrapper": as_step(cpp, ())}
    for step in steps.values():
        step()  # compiles
    samples = autotune_compiled.time_programs(steps)
    ratio = autotune_compiled.ratios_to_plan(samples)["C++ wrapper"]
    if autotune_compiled.pick(samples) == "C++ wrapper":
        return cpp, f"inductor's C++ wrapper kept ({ratio:.2f}x without it)"
    return call, f"inductor's C++ wrapper tried, not kept ({ratio:.2f}x)"


def _prepare(name: str, case: zoo.Case, task: str, dtype: torch.dtype, *, cpp_wrapper: bool = False) -> _Variant:
    model = copy.deepcopy(case.model).train(task == "train")
    args, kwargs = case.inputs
    device = "cpu"
    no_grad = task == "infer"

    def grad_ctx():
        return torch.no_grad() if no_grad else torch.enable_grad()

    def autocast_ctx():
        return torch.autocast(device, dtype=dtype)

    def as_step(call: Callable[[], Any], params: Any) -> Callable[[], Any]:
        if task == "infer":
            def infer() -> Any:
                with torch.no_grad():
                    return call()
            return infer
        if task == "forward":  # eval, grad enabled, no backward: the autograd graph is built and dropped
            def forward() -> Any:
                with torch.enable_grad():
                    return call()
            return forward
        opt = torch.optim.AdamW(params, lr=1e-4)

        def train() -> Any:
            opt.zero_grad(set_to_none=True)
            loss = _loss(call())
            loss.backward()
            opt.step()
            return loss
        return train

    if name == "fp32":
        call = lambda: model(*args, **kwargs)  # noqa: E731
        return _Variant(as_step(call, model.parameters()), call, call)
    if name == "autocast":
        def call() -> Any:
            with autocast_ctx():
                return model(*args, **kwargs)
        return _Variant(as_step(call, model.parameters()), call, call)
    if name == "pure_low":
        low = model.to(dtype)
        low_args, low_kwargs = _cast_inputs((args, kwargs), dtype)
        call = lambda: low(*low_args, **low_kwargs)  # noqa: E731
        return _Variant(as_step(call, low.parameters()), call, call)
    if name in ("graphamp", "graphamp_inference"):
        amp = graphamp.convert(model, args, kwargs, dtype=dtype, inference=name == "graphamp_inference")
        call = lambda: amp(*args, **kwargs)  # noqa: E731
        return _Variant(as_step(call, model.parameters()), call, call)
    if name == "graphamp_autotune":
        amp = graphamp.convert(model, args, kwargs, dtype=dtype, mode="autotune", inference=task == "infer")
        call = lambda: amp(*args, **kwargs)  # noqa: E731
        variant = _Variant(as_step(call, model.parameters()), call, call)
        variant.note = AutotunePlan.of(amp).summary()
        return variant
    if name.startswith("compile_"):
        # torch.compile as a user would write it: autocast around the compiled model, the model in
        # fp32, or the model and its inputs in low precision. Inductor options are part of the
        # backend, so no two variants share a compiled graph.
        freezing = name.endswith("freezing") or name == "compile_pure_low"
        target, inputs = model, (args, kwargs)
        if name == "compile_pure_low":
            target, inputs = model.to(dtype), _cast_inputs((args, kwargs), dtype)
        region = autocast_ctx if name.startswith("compile_autocast") else contextlib.nullcontext

        def compiled_call(options: dict[str, Any]) -> Callable[[], Any]:
            compiled = torch.compile(target, options={"freezing": freezing, **options})

            def call() -> Any:
                # Dynamo reads inductor's freezing flag while tracing: options alone fold nothing.
                with region(), inductor_freezing() if freezing else contextlib.nullcontext():
                    return compiled(*inputs[0], **inputs[1])
            return call

        call, note = compiled_call({}), ""
        if cpp_wrapper:
            call, note = _faster_with_cpp_wrapper(call, compiled_call, as_step)
        variant = _Variant(as_step(call, target.parameters()), call, None)
        variant.note = note
        return variant
    if name == "graphamp_backend":
        compiled = torch.compile(model, backend="graphamp", options={"dtype": dtype})
        call = lambda: compiled(*args, **kwargs)  # noqa: E731
        return _Variant(as_step(call, model.parameters()), call, None)
    if name in ("graphamp_compiled", "graphamp_autotune_compiled"):
        inference = task == "infer"
        mode = "autotune" if name == "graphamp_autotune_compiled" else "exact"
        cm = graphamp.convert(model, args, kwargs, dtype=dtype, inference=inference, mode=mode, compile=True)
        call = lambda: cm(*args, **kwargs)  # noqa: E731
        variant = _Variant(as_step(call, model.parameters()), call, None)
        ran = "" if getattr(cm, "runs_compiled", False) else " (the compiled program was refused: runs uncompiled)"
        variant.note = (f"inference={inference}; drift on the example: {cm.drift.line()}" if getattr(cm, "drift", None) else "") + ran
        if mode == "autotune":
            variant.note = f"{AutotunePlan.of(getattr(cm, 'amp', cm)).summary()}; {variant.note}"
        return variant
    if name in TRAIN_ONLY:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mode = "autotune" if "autotune" in name else "exact"
        step = graphamp.TrainStep(model, lambda out, target: _loss(out), opt, dtype=dtype, compile=name.endswith("_compiled"), mode=mode)

        def train() -> Any:
            return step(*args, target=None, **kwargs)

        # TrainStep's graph ends in the loss, so it has no model outputs to compare (max err n/a).
        variant = _Variant(train, None, None)
        if mode == "autotune":
            train()  # converts (and measures) now, not inside the first timed round
            variant.note = AutotunePlan.of(step.module).summary()
        return variant
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors created under the mode and still alive (views count with their base)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None and not _is_input(t, args, kwargs):
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


def _is_input(t: torch.Tensor, args: Any, kwargs: Any) -> bool:
    # In-place ops and aliases return one of their inputs: not a new allocation.
    return any(t is a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))


def _peak_mib(fn: Callable[[], Any]) -> float | None:
    gc.collect()
    mode = _LiveBytes()
    with mode:
        out = fn()
    del out
    return mode.peak / 2**20


def _max_err(out: Any, ref: Any) -> float:
    got, want = _outputs(out), _outputs(ref)
    if len(got) != len(want):
        return float("nan")
    err = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return float("nan")
        err = max(err, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return err


def _progress(message: str) -> None:
    """A one-line progress bar on a terminal; whole lines per phase otherwise (logs, CI)."""
    if sys.stderr.isatty():
        print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)
    elif message and "round" not in message:
        print(message, file=sys.stderr, flush=True)


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
    where the time goes (:mod:`graphamp.bench_limits`): the matmul-only bound of a step on this
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
    eta = _Estimate([(m, v, _setup_kind(v, cpp_wrapper)) for m in models for v in chosen], rounds)
    rows: list[Row] = []
    for model_name in models:
        case = build_case(model_name)
        prepared: dict[str, _Variant] = {}
        model_rows = {v: Row(model_name, task, dtype, v) for v in chosen}
        first_out: dict[str, Any] = {}
        for v in chosen:
            _progress(f"[{model_name}] preparing {v} ... {eta.line()}")
            start = time.perf_counter()
            try:
                prepared[v] = _prepare(v, case, task, low, cpp_wrapper=cpp_wrapper and v.startswith("compile_"))
                model_rows[v].note = prepared[v].note
                # first calls: compile/convert warm-up, and the error against eager autocast
                if prepared[v].forward is not None:
                    with torch.no_grad():
                        first_out[v] = prepared[v].forward()
                for _ in range(2):
                    prepared[v].step()
            except Exception as e:  # a variant that cannot run is reported, not fatal
                model_rows[v].status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            model_rows[v].setup_s = time.perf_counter() - start
            eta.prepared(model_name, v, model_rows[v].setup_s)
        live = [v for v in chosen if v in prepared and model_rows[v].status == "ok"]
        for v in set(chosen) - set(live):
            eta.failed(model_name, v)
        timers = {v: benchmark.Timer(stmt="step()", globals={"step": prepared[v].step}, num_threads=torch.get_num_threads()) for v in live}
        numbers = {}
        for v in live:
            per_call = max(timers[v].timeit(1).median, 1e-6)
            numbers[v] = max(1, int(target_s / per_call))
            eta.per_round(model_name, v, per_call * numbers[v])
        for r in range(rounds):
            for v in live:
                _progress(f"[{model_name}] round {r + 1}/{rounds} {v} {eta.line()}")
                m = timers[v].timeit(numbers[v])
                eta.timed(model_name, v)
                model_rows[v].samples.append(m.median * 1e3)
        for v in live:
            row = model_rows[v]
            # One round (--rounds 1) has no spread: its p10 and p90 are its median.
            q = statistics.quantiles(row.samples, n=10, method="inclusive") if len(row.samples) > 1 else row.samples * 9
            row.median_ms, row.p10_ms, row.p90_ms = statistics.median(row.samples), q[0], q[-1]
            if "autocast" in first_out and v in first_out:
                row.max_err = _max_err(first_out[v], first_out["autocast"])
            if "fp32" in first_out and v in first_out:
                row.err_vs_fp32 = _max_err(first_out[v], first_out["fp32"])
                if "autocast" in first_out:
                    row.autocast_err_vs_fp32 = _max_err(first_out["autocast"], first_out["fp32"])
            if prepared[v].lowerable is not None and task == "infer":
                try:
                    with torch.no_grad():
                        row.casts_per_call = count_casts(lowered_graph(_CallModule(prepared[v].lowerable), (), {}))
                except Exception:
                    row.casts_per_call = None
            if v not in COMPILED and v not in TRAIN_ONLY:
                row.peak_mib = _peak_mib(prepared[v].step)
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
            _progress(f"[{model_name}] where the time goes ... {eta.line()}")
            _add_limits(model_rows, prepared, case, task, low)
        rows.extend(model_rows.values())
    _progress("")
    print(file=sys.stderr, end="")
    return rows


# What preparing a variant costs before any is measured (s, this project's 2-core machines, cold
# inductor cache): an eager variant, a conversion, one inductor compile. Replaced by this run's own
# measurement of the same kind as soon as one has run.
_PRIOR_SETUP_S = {"eager": 5.0, "convert": 20.0, "compile": 40.0}


def _setup_kind(variant: str, cpp_wrapper: bool) -> tuple[str, float]:
    """What preparing ``variant`` costs, as (kind, how many of that kind)."""
    if variant in ("graphamp_autotune_compiled", "trainstep_autotune_compiled"):
        return "compile", 3.0 + cpp_wrapper  # up to three candidates, then the C++-wrapper build
    if variant.startswith("compile_"):
        return "compile", 1.0 + cpp_wrapper
    if variant in COMPILED:
        return "compile", 1.0
    if variant.startswith(("graphamp", "trainstep")):
        return "convert", 1.0
    return "eager", 1.0


class _Estimate:
    """Time left in a run, from what this run measured so far: the setup of each kind of variant
    (priors until one of a kind ran) and, once a model's variants are warm, its timing rounds."""

    def __init__(self, work: list[tuple[str, str, tuple[str, float]]], rounds: int) -> None:
        self.start = time.perf_counter()
        self.pending = {(m, v): kind for m, v, kind in work}
        self.rounds = {(m, v): rounds for m, v, _ in work}
        self.round_s: dict[tuple[str, str], float] = {}
        self.measured: dict[str, list[float]] = {}

    def prepared(self, model: str, variant: str, seconds: float) -> None:
        kind, units = self.pending.pop((model, variant))
        self.measured.setdefault(kind, []).append(seconds / units)

    def per_round(self, model: str, variant: str, seconds: float) -> None:
        self.round_s[(model, variant)] = seconds

    def timed(self, model: str, variant: str) -> None:
        self.rounds[(model, variant)] -= 1

    def failed(self, model: str, variant: str) -> None:
        self.rounds[(model, variant)] = 0

    def left_s(self) -> float:
        setup = sum(units * statistics.mean(self.measured.get(kind) or [_PRIOR_SETUP_S[kind]]) for kind, units in self.pending.values())
        # Rounds of variants not yet warm: the mean round of those that are (1 s before any).
        guess = statistics.mean(self.round_s.values()) if self.round_s else 1.0
        timing = sum(n * self.round_s.get(key, guess) for key, n in self.rounds.items() if n > 0)
        return setup + timing

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        return f"({elapsed:.0f} s elapsed, about {self.left_s():.0f} s left)"


def _add_limits(model_rows: dict[str, Row], prepared: dict[str, _Variant], case: zoo.Case, task: str, dtype: torch.dtype) -> None:
    """Set ``limits`` on the fastest row at autocast's accuracy or better: the matmul-only bound of
    a step (its matmul FLOPs, counted on an uncompiled fp32 copy, at this CPU's large-GEMM rate) and
    how far that row is from it (:func:`graphamp.bench_limits.limits_line`)."""
    ok = [r for r in model_rows.values() if r.status == "ok" and r.median_ms and r.variant not in PURE_LOW and r.variant in prepared]
    if not ok:
        return
    fastest = min(ok, key=lambda r: r.median_ms)
    try:
        flops = bench_limits.matmul_flops(_prepare("fp32", case, task, dtype).step)
        split = bench_limits.time_split(prepared[fastest.variant].step, calls=2)
        fastest.limits = bench_limits.limits_line(flops, dtype, fastest=fastest.variant, fastest_ms=fastest.median_ms, split=split)
    except Exception as e:  # a profile or count that fails costs the line, not the run
        fastest.limits = f"where the time goes: not measured ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def build_case(name: str) -> zoo.Case:
    """A built-in bench model (benchmark sizes), or ``pkg.module:factory`` for the user's own."""
    if name in BENCH_MODELS:
        return BENCH_MODELS[name]()
    if ":" in name:
        return zoo.build(name)
    raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(BENCH_MODELS)}, or pkg.module:factory")


class _CallModule(nn.Module):
    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self) -> Any:
        return self.fn()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row]) -> str:
    """A Markdown table of the rows."""
    head = (
        "| model | task | dtype | variant | median ms | p10-p90 ms | vs autocast | vs pure low | vs fp32 | vs best "
        "| casts/call | peak MiB | max err | err vs fp32 (autocast's) | setup s |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.model} | {r.task} | {r.dtype} | {r.variant} | {r.status} |" + " |" * 10)
            continue
        lines.append(
            f"| {r.model} | {r.task} | {r.dtype} | {r.variant} | {_fmt(r.median_ms, '.3f')} | "
            f"{_fmt(r.p10_ms, '.3f')}-{_fmt(r.p90_ms, '.3f')} | {_fmt(r.vs_autocast, '.2f')} | "
            f"{_fmt(r.vs_pure_low, '.2f')} | {_fmt(r.vs_fp32, '.2f')} | {_fmt(r.vs_best, '.2f')} | "
            f"{_fmt(r.casts_per_call, 'd')} | {_fmt(r.peak_mib, '.1f')} | "
            f"{_fmt(r.max_err, '.3g')} | {_fmt(r.err_vs_fp32, '.3g')} ({_fmt(r.autocast_err_vs_fp32, '.3g')}) | {_fmt(r.setup_s, '.1f')} |"
        )
    notes = [f"{r.model} {r.variant}: {r.note}" for r in rows if r.note]
    notes += [f"{r.model} ({r.task}, {r.dtype}), where the time goes: {r.limits}" for r in rows if r.limits]
    bests = {r.model: r.best for r in rows if r.best}
    if bests:
        notes += [f"vs best: each row over the fastest alternative without graphamp ({', '.join(ALTERNATIVES)} as run): "
                  + ", ".join(f"{m}: {b}" for m, b in bests.items())]
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def to_json(rows: list[Row]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items()} for r in rows]
