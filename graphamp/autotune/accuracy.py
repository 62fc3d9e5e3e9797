"""Autotune's accuracy check: a tuned program's error against fp32 is at most eager autocast's.

Measured on the example, from the same random state on every side: the relative RMS error of the
floating outputs and, where the conversion keeps gradients, of the parameters' gradients of a fixed
random projection. :func:`no_less_accurate` keeps the plan, raises every op, or undoes the raises;
the compiled choice (``graphamp.autotune.compiled``) compares its candidates with the same measure.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphamp.eager import rng_kept
from graphamp.node_info import GraphInfo, graph_info, peek_graph_info
from graphamp.autotune.plan import AutotunePlan
from graphamp.policy import short_dtype
from graphamp.eager import inputs_restored, state_restored
from graphamp.spec import AmpSpec, ambient_autocast

__all__ = ["checked_params", "errors_against_fp32", "no_less_accurate", "outputs_and_grads_of", "relative_error"]


def no_less_accurate(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, replay: Callable[..., nn.Module]
) -> nn.Module:
    """Autotune's end-to-end check: on the example, the raised program's error against fp32 is at
    most eager autocast's. Else, where the measurements say raising every op is faster than
    autocast's dtypes, the program with every op raised (fp32 wherever autocast runs low), checked
    the same way; else every raise is undone (the plan replayed with autocast's dtypes). ``replay``
    converts with a given plan (``graphamp.pipeline.replay``, handed in by the engine).

    The error (:func:`relative_error`) is the largest relative RMS difference over the floating outputs
    and, where the conversion keeps gradients, over the parameters' gradients of a fixed random
    projection of the outputs. An RMS over every element, not the largest single difference: raising
    an op never makes that op less precise, but the ops after it round other values, so one element
    (or a scalar loss, all a ``TrainStep``'s graph returns) can come out a little above autocast's by
    chance, and the whole plan would be undone for it.
    """
    plan = (peek_graph_info(amp) or GraphInfo()).plan
    if plan is None or not plan.raised:
        return amp
    start = time.perf_counter()
    failed: dict[str, str] = {}
    try:
        measured = errors_against_fp32({"plan": amp}, model, args, kwargs, spec, failed)
        err_tuned, err_low = measured["plan"], measured["autocast"]
        over = "outputs and gradients" if checked_params(model, spec) else "outputs"
        errors = f"relative RMS error vs fp32 on the example ({over}) {err_tuned:.3g}, eager autocast's {err_low:.3g}"
        if "plan" in failed:
            errors = f"the tuned program raised on the example ({failed['plan']})"
        if err_tuned <= err_low and "plan" not in failed:
            graph_info(amp).plan = dataclasses.replace(plan, accuracy=errors, check_s=time.perf_counter() - start)
            return amp
    except Exception as e:  # the check is advisory: a model that cannot run eagerly keeps its plan
        # (the tuned program's own failure is measured, above, as an infinite error)
        graph_info(amp).plan = dataclasses.replace(
            plan, accuracy=f"error not checked ({type(e).__name__}: {str(e)[:120]})", check_s=time.perf_counter() - start
        )
        return amp
    everything = _every_op_raised(plan)
    if everything is not None:
        try:
            raised = replay(model, args, kwargs, spec, everything)
            err_all = errors_against_fp32({"raised": raised}, model, args, kwargs, spec)["raised"]
        except Exception:  # noqa: BLE001 (the fallback is optional: undo the raises instead)
            err_all = math.inf
        if err_all <= err_low:
            low_ms, fp32_ms = _summed_ms(plan)
            graph_info(raised).plan = dataclasses.replace(everything, check_s=time.perf_counter() - start, accuracy=(
                f"every op raised instead: with {len(plan.raised)} op(s) raised, {errors}; with every op raised "
                f"(measured {fp32_ms:.3g} ms in fp32 against {low_ms:.3g} ms in {short_dtype(spec.dtype)}) {err_all:.3g}"
            ))
            return raised
    undone = dataclasses.replace(plan, decisions=dict.fromkeys(plan.decisions, spec.dtype), accuracy=(
        f"raises undone: with {len(plan.raised)} op(s) raised, {errors}"
    ))
    again = replay(model, args, kwargs, spec, undone)
    graph_info(again).plan = dataclasses.replace(undone, check_s=time.perf_counter() - start)
    return again


def errors_against_fp32(
    programs: dict[str, nn.Module], model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec,
    failures: dict[str, str] | None = None,
) -> dict[str, float]:
    """:func:`relative_error` of each program on the example against the model in fp32, and of eager
    autocast under the key ``"autocast"``: the measure of :func:`no_less_accurate`. Raises where the
    model cannot run eagerly; a program that raises on the example measures ``inf`` (never kept),
    its error in words in ``failures``."""
    params = checked_params(model, spec)
    ref = outputs_and_grads_of(model, model, args, kwargs, params)
    with ambient_autocast(spec.device_type, spec.dtype):
        errors = {"autocast": relative_error(outputs_and_grads_of(model, model, args, kwargs, params), ref)}
    for name, program in programs.items():
        try:
            errors[name] = relative_error(outputs_and_grads_of(program, model, args, kwargs, params), ref)
        except Exception as e:  # noqa: BLE001 (a program that cannot run on the example is never kept)
            errors[name] = math.inf
            if failures is not None:
                failures[name] = f"{type(e).__name__}: {str(e).strip()[:120]}"
    return errors


def checked_params(model: nn.Module, spec: AmpSpec) -> list[torch.Tensor]:
    return [] if spec.inference else [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]


def outputs_and_grads_of(program: nn.Module, model: nn.Module, args: tuple, kwargs: dict, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
    """``program`` on the example, seeded, ``model``'s buffers and random state restored after: its
    floating outputs and the gradients of ``params`` (what :func:`relative_error` compares). The
    inputs it writes in place are put back, so every program runs from the same values."""
    with state_restored(model), inputs_restored((args, kwargs)):  # buffers, RNG and inputs as they were, after
        return _seeded(lambda: _outputs_and_grads(lambda: program(*args, **kwargs), params))


def _every_op_raised(plan: AutotunePlan) -> AutotunePlan | None:
    """``plan`` with every op raised, where each op was measured and the sum of their fp32 times is
    below the sum of their low-precision times; else None."""
    if plan.unmeasured or len(plan.raised) == len(plan.decisions) or set(plan.times_ms) != set(plan.decisions):
        return None
    low_ms, fp32_ms = _summed_ms(plan)
    if fp32_ms >= low_ms:
        return None
    return dataclasses.replace(plan, decisions=dict.fromkeys(plan.decisions, torch.float32))


def _summed_ms(plan: AutotunePlan) -> tuple[float, float]:
    """The plan's measured times summed over its ops: (low precision, fp32)."""
    return sum(low for low, _ in plan.times_ms.values()), sum(fp32 for _, fp32 in plan.times_ms.values())


def _seeded(run: Any) -> Any:
    with rng_kept(seed=0):  # the same dropout masks for each program
        return run()


def _outputs_and_grads(run: Any, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
    """The floating output leaves of ``run()`` and (given ``params``) their gradients of a fixed
    random projection of those outputs (``torch.autograd.grad``: no ``.grad`` is touched)."""
    if not params:
        with torch.no_grad():
            return (_floating(run()),)
    outputs = _floating(run())
    weights = torch.Generator().manual_seed(0)
    probe = sum((o.float() * torch.randn(o.shape, generator=weights).to(o.device)).sum() for o in outputs if o.requires_grad)
    if not isinstance(probe, torch.Tensor):  # no output depends on a parameter
        return ([o.detach() for o in outputs],)
    grads = torch.autograd.grad(probe, params, allow_unused=True)
    return [o.detach() for o in outputs], [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _floating(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def relative_error(got: tuple[list[torch.Tensor], ...], ref: tuple[list[torch.Tensor], ...]) -> float:
    """The larger, over outputs and gradients, of the relative RMS difference over all their
    elements, ``sqrt(sum((got - ref)**2) / sum(ref**2))`` (the RMS difference itself where ``ref``
    is all zeros; inf for a new NaN). One ratio per group, not per tensor: a gradient that is
    nearly zero in fp32 would make its own ratio meaningless."""
    worst = 0.0
    for got_group, ref_group in zip(got, ref):
        diff_sq, ref_sq, count = 0.0, 0.0, 0
        for a, b in zip(got_group, ref_group):
            diff = a.double() - b.double()
            if bool((diff.isnan() & ~b.isnan()).any()):
                return math.inf
            diff_sq += float(diff.nan_to_num(0.0).square().sum())
            ref_sq += float(b.double().nan_to_num(0.0).square().sum())
            count += diff.numel()
        worst = max(worst, math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.sqrt(diff_sq / max(count, 1)))
    return worst

