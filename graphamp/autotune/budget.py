"""``mode="budget"``: past autocast, within an accuracy budget: op types moved off autocast's dtype
where the whole program measures faster and its error against fp32 stays within the budget.

Autotune only ever raises ops autocast runs low. This search may also *lower* the ops autocast
keeps in fp32 (layer norm, softmax, reductions, losses) and the pointwise ops between them (add,
gelu, mul), so activations and weights stay low across them, and it may raise ops autocast runs
low. It decides per op type, in every node that has it, through ``Config.op_overrides``'s own
mechanism, so a plan is replayed, and composes with ``fp32_modules`` (a module kept in fp32, for
instance by ``graphamp.search``, stays fp32 whatever the plan says).

Starting from autocast's program, for each op type in turn (the most frequent in the program so
far, each once), the program with that op type moved to the other dtype is

1. checked: its relative RMS error against the model in fp32 (outputs and, where the conversion
   keeps gradients, the parameters' gradients; :func:`graphamp.autotune.accuracy.relative_error`),
   on the example and on a held-back batch (the example's float inputs redrawn with their mean and
   spread, its integer inputs redrawn in their range), must be within the budget on both:
   ``Config(error_budget=e)``, or else :data:`BUDGET_FACTOR` times eager autocast's own error on
   that batch;
2. timed against the program so far, in interleaved rounds (the median ratio over the rounds), as
   it will run: the converted graph, or with ``compile=True`` each program compiled by inductor;
3. kept where it is within the budget and faster by :data:`graphamp.autotune.compiled.MARGIN`.

Each step (op, dtype, error on both batches, time ratio, kept or why not) is in the
:class:`graphamp.BudgetPlan` (``BudgetPlan.of(amp)``), and each moved node's reason names it, so
``graphamp.explain(..., mode="budget")`` and its HTML report show them. Each step costs a conversion
from one shared capture, two error runs and a few timed rounds (with ``compile=True``, a compile).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphamp import hardware
from graphamp.autotune.accuracy import outputs_and_grads_of, checked_params, relative_error
from graphamp.autotune.compiled import MARGIN, program_call, time_programs
from graphamp.autotune.plan import BudgetPlan, BudgetStep
from graphamp.eager import inputs_restored, state_restored
from graphamp.node_info import graph_info, info, peek
from graphamp.policy import Category, op_key, short_dtype
from graphamp.runtime import autocast_op
from graphamp.spec import AmpSpec, ambient_autocast

__all__ = ["BUDGET_FACTOR", "held_back", "op_types", "within_budget"]

# Without Config(error_budget=...), each batch's cap is this many times eager autocast's own error
# against fp32 there.
BUDGET_FACTOR = 2.0
ROUNDS = 5
_LOW = Category.LOWER_PRECISION_FP.value
_FP32 = Category.FP32.value


def held_back(args: tuple, kwargs: dict, *, seed: int = 1) -> tuple[tuple, dict]:
    """A second batch like the example: floating tensors redrawn from a normal with each one's mean
    and standard deviation, integer tensors (ids) redrawn uniformly in their range; bool tensors,
    constant integer tensors (all-ones masks) and non-tensors as they are.

    >>> ids = torch.tensor([[3, 9, 4]]); x = torch.full((2, 2), 5.0)
    >>> (ids2, x2), _ = held_back((ids, x), {})
    >>> assert ids2.shape == ids.shape and 3 <= int(ids2.min()) and int(ids2.max()) <= 9 and torch.equal(x2, x)
    """
    generator = torch.Generator().manual_seed(seed)

    def redraw(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() < 2 or t.dtype is torch.bool:
            return t
        if t.is_floating_point():
            mean, std = t.double().mean(), t.double().std()
            fresh = torch.randn(t.shape, generator=generator, dtype=torch.float64) * std + mean
            return fresh.to(dtype=t.dtype, device=t.device)
        if t.is_complex():
            return t
        low, high = int(t.min()), int(t.max())
        if low == high:
            return t
        return torch.randint(low, high + 1, t.shape, generator=generator, dtype=t.dtype).to(t.device)

    return pytree.tree_map(redraw, (tuple(args), dict(kwargs)))


def op_types(amp: nn.Module, spec: AmpSpec) -> list[tuple[str, str, int]]:
    """The op types the search may move, most frequent first: (op key, the category to try, node
    count). An op type qualifies where every node that has it computes a floating value in one
    dtype, the low one or fp32, from a floating input; views, casts, dropout, ops autocast bans,
    ops ``Config.op_overrides`` pins and nodes inside a module the config keeps in fp32 do not."""
    counts: Counter[str] = Counter()
    dtypes: dict[str, set[torch.dtype]] = {}
    pinned: set[str] = set()
    policy = spec.policy
    for node in amp.graph.nodes:
        # An eager fused kernel run under autocast (fuse_encoder_layers) counts as its op.
        target = node.args[0] if node.op == "call_function" and node.target is autocast_op else node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        record = peek(node)
        val = node.meta.get("val")
        if (record is not None and record.cast) or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        key = op_key(target)
        if (
            target.is_view
            or key.startswith(("dropout", "native_dropout", "_to_copy", "clone", "contiguous", "detach", "alias"))
            or policy.category(key) is Category.BANNED
            or not any(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point() for a in node.all_input_nodes)
        ):
            continue
        if key in spec.config.op_overrides:
            pinned.add(key)
            continue
        if spec.config.keeps_fp32(node.meta.get("nn_module_stack")):
            continue  # kept in fp32 whatever the plan says: the op type counts only where it is not
        counts[key] += 1
        dtypes.setdefault(key, set()).add(val.dtype)
    found = []
    for key, count in counts.most_common():
        kinds = dtypes[key]
        if key in pinned or len(kinds) != 1:
            continue
        (dtype,) = kinds
        if dtype is torch.float32:
            found.append((key, _LOW, count))
        elif dtype is spec.dtype:
            found.append((key, _FP32, count))
    return found


def within_budget(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec,
    convert_with: Callable[[AmpSpec], nn.Module], compile_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """The budget search (see the module's doc) from ``amp``, autocast's program of ``model``.
    ``convert_with(spec)`` converts with another spec (``graphamp.pipeline.conversions_of_one_capture``);
    ``compile_fn(program)`` compiles one, where the programs are timed compiled. Returns the program
    kept (compiled, with ``compile_fn``), with its :class:`BudgetPlan` in its record."""
    start = time.perf_counter()
    params = checked_params(model, spec)
    batches = {"example": (tuple(args), dict(kwargs)), "held-back": held_back(args, kwargs)}
    refs, autocast_err = {}, []
    for name, (a, k) in batches.items():
        refs[name] = outputs_and_grads_of(model, model, a, k, params)
        with ambient_autocast(spec.device_type, spec.dtype, cache_enabled=spec.cache_enabled):
            autocast_err.append(relative_error(outputs_and_grads_of(model, model, a, k, params), refs[name]))
    budget = spec.config.error_budget
    caps = (budget, budget) if budget is not None else tuple(BUDGET_FACTOR * e for e in autocast_err)

    def errors(program: nn.Module) -> tuple[float, float]:
        return tuple(
            relative_error(outputs_and_grads_of(program, model, a, k, params), refs[name]) for name, (a, k) in batches.items()
        )

    def runnable(program: nn.Module) -> nn.Module:
        return compile_fn(program) if compile_fn is not None else program

    current, current_run = amp, runnable(amp)
    current_err = errors(current_run)
    overrides: dict[str, str] = {}
    steps: list[BudgetStep] = []
    seen: set[str] = set()
    while True:
        # Again after each kept step: moving one op type moves the dtype of the ops it feeds.
        left = [found for found in op_types(current, spec) if found[0] not in seen]
        if not left:
            break
        key, tried, count = left[0]
        seen.add(key)
        moved = {**overrides, key: tried}
        to = "fp32" if tried == _FP32 else short_dtype(spec.dtype)
        try:
            program = convert_with(_with_plan(spec, moved))
            run = runnable(program)
            err = errors(run)
        except Exception as e:  # noqa: BLE001 (a step that cannot convert or run is not taken)
            steps.append(BudgetStep(key, count, tried, False, math.inf, math.inf, None, f"{to}: failed ({type(e).__name__}: {str(e)[:120]})"))
            continue
        over = [f"{e:.3g} > {c:.3g} on the {n}" for e, c, n in zip(err, caps, batches) if not e <= c]
        if over:
            steps.append(BudgetStep(key, count, tried, False, *err, None, f"{to}: over the budget ({'; '.join(over)})"))
            continue
        with state_restored(model), inputs_restored((args, kwargs)):  # the example as it was, after
            samples = time_programs(
                {"before": program_call(current_run, args, kwargs, params), "after": program_call(run, args, kwargs, params)},
                rounds=ROUNDS,
            )
        ratio = statistics.median(a / b for a, b in zip(samples["after"], samples["before"]))
        kept = ratio < 1 - MARGIN
        why = f"{to}: {ratio:.2f}x the time, error {err[0]:.3g} and {err[1]:.3g} within {caps[0]:.3g} and {caps[1]:.3g}"
        steps.append(BudgetStep(key, count, tried, kept, *err, ratio, why if kept else f"{why}, not faster by {MARGIN:.0%}"))
        if kept:
            overrides, current, current_run, current_err = moved, program, run, err
    plan = BudgetPlan(
        spec.device_type, spec.dtype, overrides, steps=tuple(steps), budget=caps, autocast_error=tuple(autocast_err),
        error=current_err, timed="compiled" if compile_fn is not None else "eager", measure_s=time.perf_counter() - start,
        machine=hardware.capability(spec.device_type).key(),
    )
    graph_info(current).plan = plan
    for node in current.graph.nodes:  # each moved node names the step that moved it
        record = peek(node)
        if not (record is not None and record.cast) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            key = op_key(node.target)
            if key in overrides and record is not None and "budget plan" in (record.reason or ""):
                info(node).notes["budget"] = next(s.to_dict() for s in steps if s.op == key and s.kept)
                info(node).reason = f"{overrides[key]} ({plan.reason(key)})"
    return current_run


def _with_plan(spec: AmpSpec, overrides: dict[str, str]) -> AmpSpec:
    plan = BudgetPlan(spec.device_type, spec.dtype, overrides)
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, plan=plan))
