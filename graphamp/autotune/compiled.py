"""``convert(mode="autotune", compile=True)``: compiled candidate programs timed whole, the fastest kept.

Autotune decides op by op from eager timings, and a compiled program does not run op by op:
inductor fuses the casts, prepacks weights and lowers an emulated fp16 convolution its own way. On
this project's AMD EPYC (fp16 emulated) the checkerboard's autotuned plan kept two fp16 convolutions
that eager timed faster, and compiled it trained at 19.3 ms a step against 9.7 ms with every
convolution in fp32. So with ``compile=True`` up to three programs are compiled and timed on the
example, in interleaved rounds: the plan's own, autocast's dtypes (the plan's raises undone) and every
op raised (each, like the plan, no less accurate than eager autocast on the example). Each is judged
by the median over the rounds of its time over the plan's in the same round, and the plan's own is
kept unless another's is below ``1 - MARGIN``. For ``inference=True`` the program kept is then
compiled again without inductor's freezing, then with its C++ wrapper (:data:`SETTINGS_TRIED`),
each timed against the one kept so far the same way. Each candidate costs a compile.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn

from graphamp.emit import AmpModule
from graphamp.node_info import graph_info
from graphamp.autotune.plan import AutotunePlan
from graphamp.policy import short_dtype
from graphamp.spec import AmpSpec
from graphamp.autotune.accuracy import checked_params, errors_against_fp32
from graphamp.compiled import compile_converted
from graphamp.eager import inputs_restored, state_restored
from graphamp.hardware import FAULTS_SAID, faults_of
from graphamp.pipeline import replay

__all__ = ["MARGIN", "candidate_plans", "fastest_compiled", "faults_said", "pick", "program_call", "ratios_to_plan", "time_programs"]

# Another candidate replaces the plan's own program only when its median is this much lower.
MARGIN = 0.03
ROUNDS = 7
MIN_ROUND_S = 0.05


def candidate_plans(plan: AutotunePlan, dtype: torch.dtype) -> dict[str, AutotunePlan]:
    """The plans to compile beside ``plan`` itself: autocast's dtypes where it raised an op, every
    op raised where it kept one low."""
    candidates = {}
    if plan.raised:
        candidates["autocast's dtypes"] = dataclasses.replace(plan, decisions=dict.fromkeys(plan.decisions, dtype))
    if len(plan.raised) < len(plan.decisions):
        candidates["every op raised"] = dataclasses.replace(plan, decisions=dict.fromkeys(plan.decisions, torch.float32))
    return candidates


def time_programs(
    runs: dict[str, Callable[[], Any]], *, rounds: int = ROUNDS, faults: dict[str, float] | None = None
) -> dict[str, list[float]]:
    """ms per call of each ``run`` in each of ``rounds`` interleaved rounds of at least
    :data:`MIN_ROUND_S` each (the first call of each, before, untimed). ``faults``, where given,
    receives each run's minor page faults per timed call (:func:`graphamp.hardware.faults_of`)."""
    numbers = {}
    for name, run in runs.items():
        start = time.perf_counter()
        run()
        numbers[name] = max(1, math.ceil(MIN_ROUND_S / max(time.perf_counter() - start, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    faulted: dict[str, int | None] = dict.fromkeys(runs, 0)
    for _ in range(rounds):
        for name, run in runs.items():
            # Timed directly: benchmark.Timer.timeit warms up with two more calls per round, which
            # the first call above makes needless and which triple a slow program's cost.
            ms, n = faults_of(lambda: _ms_per_call(run, numbers[name]))
            samples[name].append(ms)
            faulted[name] = None if n is None or faulted[name] is None else faulted[name] + n
    if faults is not None:
        faults.update({name: n / (numbers[name] * rounds) for name, n in faulted.items() if n is not None})
    return samples


def _ms_per_call(run: Callable[[], Any], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        run()
    return (time.perf_counter() - start) / number * 1e3


def faults_said(faults: dict[str, float]) -> str:
    """Where a timed program took page faults on its calls, the words that say so ("" where none
    took :data:`FAULTS_SAID` per call): its time then includes glibc giving memory back to the OS
    and taking it again, which depends on the process's history, not on the program alone.

    >>> faults_said({"plan": 992.0, "every op raised": 0.0})
    'page faults per call: plan 992, every op raised 0 (malloc returned memory to the OS between calls: see docs/benchmark.md#page-faults)'
    """
    if not faults or max(faults.values()) < FAULTS_SAID:
        return ""
    counts = ", ".join(f"{name} {n:.0f}" for name, n in faults.items())
    return f"page faults per call: {counts} (malloc returned memory to the OS between calls: see docs/benchmark.md#page-faults)"


def fastest_compiled(
    amp: AmpModule, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec,
    compile_fn: Callable[[AmpModule, nn.Module, tuple, dict], nn.Module] | None = None,
) -> nn.Module:
    """The fastest of ``amp``'s compiled program and the candidates' (see the module's doc), timed
    on the example: forward, and backward to the parameters where the conversion keeps gradients.
    ``compile_fn(program, model, args, kwargs)`` compiles one (default: ``convert(compile=True)``'s)."""
    compile_fn = compile_fn or compile_converted

    plan = graph_info(amp).plan
    programs: dict[str, AmpModule] = {}
    notes = []
    candidates = candidate_plans(plan, spec.dtype)
    for name, decisions in candidates.items():
        try:
            programs[name] = replay(model, args, kwargs, spec, decisions)
        except Exception as e:  # noqa: BLE001 (a candidate is optional)
            notes.append(f"{name}: not converted ({type(e).__name__})")
    if "autocast's dtypes" in programs:  # autocast's accuracy by definition
        graph_info(programs["autocast's dtypes"]).plan = dataclasses.replace(
            candidates["autocast's dtypes"], accuracy="autocast's dtypes: eager autocast's accuracy"
        )
    if "every op raised" in programs:
        try:
            errors = errors_against_fp32({"every op raised": programs["every op raised"]}, model, args, kwargs, spec)
        except Exception as e:  # noqa: BLE001 (unchecked: not a candidate)
            errors = {"every op raised": math.inf, "autocast": 0.0}
            notes.append(f"every op raised: error not checked ({type(e).__name__})")
        if errors["every op raised"] <= errors["autocast"]:
            graph_info(programs["every op raised"]).plan = dataclasses.replace(candidates["every op raised"], accuracy=(
                f"every op raised: relative RMS error vs fp32 on the example {errors['every op raised']:.3g}, "
                f"eager autocast's {errors['autocast']:.3g}"
            ))
        else:
            del programs["every op raised"]
            notes.append("every op raised: less accurate than autocast on the example")
    compiled: dict[str, nn.Module] = {}
    caught: dict[str, list[warnings.WarningMessage]] = {}
    for name, program in {"plan": amp, **programs}.items():
        with warnings.catch_warnings(record=True) as caught[name]:
            warnings.simplefilter("always")
            try:
                compiled[name] = compile_fn(program, model, args, kwargs)
            except Exception as e:
                if name == "plan":
                    raise
                notes.append(f"{name}: not compiled ({type(e).__name__})")
    params = checked_params(model, spec)

    def run(cm: nn.Module) -> Callable[[], Any]:
        return program_call(cm, args, kwargs, params)

    samples: dict[str, list[float]] = {}
    if len(compiled) > 1:
        faults: dict[str, float] = {}
        with state_restored(model), inputs_restored((args, kwargs)):  # the example as it was, after
            samples = time_programs({name: run(cm) for name, cm in compiled.items()}, faults=faults)
        notes.extend(filter(None, [faults_said(faults)]))
    best = pick(samples) if samples else "plan"
    chosen = compiled[best]
    if spec.inference and compile_fn is compile_converted and getattr(chosen, "runs_compiled", False):
        program, settings = {"plan": amp, **programs}[best], {}
        for name, setting in SETTINGS_TRIED:
            chosen, kept = _setting_if_faster(chosen, program, name, {**settings, **setting}, model, args, kwargs, run, notes)
            settings.update(setting if kept else {})
    return _chosen(chosen, caught[best], best, samples, notes, spec)


def program_call(program: nn.Module, args: tuple, kwargs: dict, params: list[torch.Tensor]) -> Callable[[], Any]:
    """A call of ``program`` on the example as a timing runs it: forward under no_grad where
    ``params`` is empty, else forward and the gradients of ``params`` (no ``.grad`` touched)."""

    def call() -> Any:
        if not params:
            with torch.no_grad():
                return program(*args, **kwargs)
        out = [t for t in torch.utils._pytree.tree_leaves(program(*args, **kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if out:  # the parameters' gradients, as a training step computes them
            torch.autograd.grad(sum(t.float().mean() for t in out), params, allow_unused=True)

    return call


# Inference only, each tried on the program kept so far and kept where it times faster by the
# candidates' rule: without freezing (fp32 matmuls prepacked by freezing ran 0.92-1.11x their unfrozen
# time on the AMD EPYCs' BERT and GPT-2, by run: neither wins everywhere), then inductor's C++ wrapper
# (the call's Python glue compiled too: 0.93x on the bench's 1 ms checkerboard).
SETTINGS_TRIED = (("without freezing", {"freezing": False}), ("C++ wrapper", {"options": {"cpp_wrapper": True}}))


def _setting_if_faster(
    cm: nn.Module, program: AmpModule, name: str, settings: dict[str, Any], model: nn.Module, args: tuple, kwargs: dict,
    run: Callable[[nn.Module], Callable[[], Any]], notes: list[str],
) -> tuple[nn.Module, bool]:
    """``program`` compiled again with ``settings`` (``compile_converted``'s keywords), kept where it
    times faster than ``cm``: the module kept and whether it is the new one; the choice is added to ``notes``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = compile_converted(program, model, args, kwargs, **settings)
    except Exception as e:  # noqa: BLE001 (optional: cm stays)
        notes.append(f"{name}: not compiled ({type(e).__name__})")
        return cm, False
    if not getattr(other, "runs_compiled", False):
        notes.append(f"{name}: refused")
        return cm, False
    faults: dict[str, float] = {}
    with state_restored(model), inputs_restored((args, kwargs)):  # the example as it was, after
        samples = time_programs({"plan": run(cm), name: run(other)}, faults=faults)
    ratio = ratios_to_plan(samples)[name]
    kept = pick(samples) == name
    said = faults_said(faults)
    notes.append(
        f"{name} {statistics.median(samples[name]):.3g} ms against {statistics.median(samples['plan']):.3g} ms "
        f"({ratio:.2f}x), {'kept' if kept else 'not kept'}" + (f" ({said})" if said else "")
    )
    return (other, True) if kept else (cm, False)


def ratios_to_plan(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each program's median, over the rounds, of its time divided by the plan's in the same round:
    a slow spell of a shared machine slows both of a round's programs and cancels."""
    return {name: statistics.median(t / p for t, p in zip(times, samples["plan"])) for name, times in samples.items()}


def pick(samples: dict[str, list[float]]) -> str:
    """The program with the lowest :func:`ratios_to_plan`, or ``"plan"`` unless that ratio is
    below ``1 - MARGIN``."""
    ratios = ratios_to_plan(samples)
    best = min(ratios, key=ratios.__getitem__)
    return best if ratios[best] < 1 - MARGIN else "plan"


def _chosen(cm: nn.Module, caught: list[warnings.WarningMessage], name: str, samples: dict[str, list[float]], notes: list[str], spec: AmpSpec) -> nn.Module:
    """``cm`` with the choice in its plan, and the warnings its compile gave, given again."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    amp = getattr(cm, "amp", cm)
    plan = graph_info(amp).plan
    ratios = ratios_to_plan(samples) if samples else {}
    timed = ", ".join(
        f"{n} {statistics.median(ms):.3g} ms" + (f" ({ratios[n]:.2f}x)" if n != "plan" else "") for n, ms in samples.items()
    )
    line = f"compiled: {'the plan' if name == 'plan' else name} ({timed or 'no other candidate compiled'})"
    if notes:
        line += f"; {'; '.join(notes)}"
    if name != "plan":
        raised = sum(d is torch.float32 for d in plan.decisions.values())
        rest = f", the rest in {short_dtype(spec.dtype)}" if raised < len(plan.decisions) else ""
        line += f"; {raised} of {len(plan.decisions)} ops in fp32{rest}"
    graph_info(amp).plan = dataclasses.replace(plan, compiled=line)
    return cm
