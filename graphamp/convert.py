"""``graphamp.convert``: capture, rewrite into explicit mixed precision, emit."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from typing import Any

import torch
from torch import nn

from graphamp import hardware
from graphamp.capture import capture
from graphamp.capture.stacks import source_lines_read_lazily
from graphamp.capture.values import capture_by_values, guard_eager_reads
from graphamp.capture.dynamo import dynamo_fallback, needs_graph_breaks
from graphamp.config import Config
from graphamp.eager import rng_kept
from graphamp.emit import ALL_ONES_AS_NONE, ALL_ONES_PROVEN, AmpModule, all_ones_key, emit, is_all_ones
from graphamp.errors import CaptureError, EagerPathWarning, PolicyDriftError
from graphamp.passes import build_pipeline, run_passes
from graphamp.passes.follow_eager_attention import EAGER_SDPA, SDPA, repeated_heads
from graphamp.passes.autotune import PLAN_META, checks_accuracy
from graphamp.passes.export_guards import guards_as_asserts
from graphamp.shared_state import capture_lock
from graphamp.plan import AutotunePlan
from graphamp.policy import short_dtype
from graphamp.probe import _state_restored, eager_sdpa_calls
from graphamp.self_check import SELF_CHECK_META, applies, check_against_eager, check_self_check, checker_for
from graphamp.spec import AmpSpec, ambient_autocast, autocast_off

_log = logging.getLogger("graphamp")

__all__ = ["convert"]


def observe_eager(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype) -> None:
    """Record in ``gm.meta`` what eager did where the traced graph may hold another program.

    Only attention whose key/value heads the traced code repeats needs it (see
    passes/follow_eager_attention.py); other models pay nothing.
    """
    if any(repeated_heads(n.args[1]) for n in gm.graph.find_nodes(op="call_function", target=SDPA)):
        gm.meta[EAGER_SDPA] = eager_sdpa_calls(model, args, kwargs, device_type=device_type, dtype=dtype)


def convert(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    mode: str = "exact",
    config: Config | None = None,
    inference: bool = False,
    keep_io_types: bool = False,
    self_check: str | bool = "raise",
    compile: bool = False,
) -> AmpModule | nn.Module:
    """Rewrite ``model`` into explicit mixed precision, equal to running it under ``torch.autocast``.

    Args:
        model: the module to convert; it is not modified.
        args, kwargs: example inputs, as for ``torch.export.export``. Later calls may use other
            sizes: where the graph cannot hold them, the module converts again for their shape class.
        dtype: ``torch.bfloat16`` or ``torch.float16``; None takes autocast's default for the device.
        device_type: "cpu" or "cuda"; None takes the device of the model's parameters.
        mode: "exact" reproduces eager autocast bit for bit (and warns once, with
            :class:`graphamp.EmulatedPrecisionWarning`, where this CPU emulates ``dtype``);
            "autotune" measures each low-precision op against fp32 here and keeps the faster
            (never less precise than autocast; ``graphamp.AutotunePlan.of(amp)`` is its plan).
        config: a :class:`graphamp.Config` with op overrides and modules kept in fp32.
        inference: deployment mode: no gradient path is kept (calls run under ``no_grad``),
            casts are shared freely, and weights used only in low precision are cast once, now,
            and held in low precision only. Outputs stay bitwise equal to eager autocast.
        keep_io_types: an fp32 interface: floating inputs the example gave in bf16/fp16 are taken
            in fp32 and cast inside the graph, and bf16/fp16 floating outputs are returned in fp32
            (values equal eager autocast's outputs ``.float()``).
        self_check: in exact mode (autocast's own policy), the converted module and eager
            ``torch.autocast`` run the example once more, from the same random state with buffers
            restored, and every output value and dtype and (unless ``inference``) every parameter
            gradient of a fixed loss must be bitwise equal. "raise" (default) raises
            :class:`graphamp.PolicyDriftError` naming what differs and the first divergent node,
            unless another conversion is exact (all-ones masks passed as None, the capture on
            values), which is returned instead;
            "warn" warns :class:`graphamp.PolicyDriftWarning` and returns the module; "off" skips
            it (for conversions in a loop; ``graphamp.verify`` checks on demand). What it found is
            in ``amp.meta["graphamp.self_check"]``.
        compile: hand the converted graph, with its casts, to AOTAutograd and inductor (with
            freezing when ``inference``): faster, and no longer bitwise equal to eager autocast
            (inductor fuses and reduces its own way). The example runs through it once now, which
            compiles it (a failure raises :class:`graphamp.CompileError`) and measures its drift
            from eager autocast (``cm.drift``). Returns a :class:`graphamp.CompiledAmpModule`.
            With ``mode="autotune"`` (and no plan given) up to three programs are compiled, the
            plan's, autocast's dtypes and every op raised, and the fastest on the example is
            returned (:mod:`graphamp.autotune_compiled`; ``AutotunePlan.of(cm.amp).compiled``).

    Returns:
        An :class:`AmpModule`: a GraphModule with the casts in its code, sharing the model's
        parameters and buffers, with the model's input and output pytree. Where torch.export
        refuses the program even with static sizes (a branch on a tensor's value), a
        :class:`graphamp.DynamoAmpModule`: the model under ``torch.compile(backend="graphamp")``.

    >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    >>> x = torch.randn(4, 8)
    >>> amp = convert(model, (x,), dtype=torch.bfloat16)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     expected = model(x)
    >>> assert torch.equal(amp(x), expected)
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.convert")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    if compile:  # refused for a sharded model before anything is captured (or gathered)
        from graphamp.integrations import fsdp

        fsdp.refuse_compile(model, "graphamp.convert")
    on_drift = check_self_check(self_check)
    spec = AmpSpec.resolve(
        model, (args, kwargs), dtype=dtype, device_type=device_type, mode=mode, inference=inference, config=config,
        keep_io_types=keep_io_types,
    )
    if spec.mode == "exact":
        hardware.warn_if_emulated(spec.device_type, spec.dtype)
    refused: CaptureError | None = None
    try:
        amp = _convert(model, args, kwargs, spec)
    except CaptureError as e:
        if not needs_graph_breaks(e):
            raise
        refused = e
        try:
            amp = dynamo_fallback(model, args, kwargs, spec, e)
        except CaptureError as failed:  # dynamo cannot run it either: the capture on values may
            spec = dataclasses.replace(spec, capture="values")
            try:
                amp = _convert(model, args, kwargs, spec)
            except CaptureError:
                raise failed  # noqa: B904 (its own cause, the error dynamo met, is the one to show)
    if on_drift != "off" and applies(spec, model, args, kwargs):
        try:
            # Undiagnosed where other conversions follow: locating a difference costs a run or a compile.
            quick = on_drift == "raise" and spec.mode == "exact"
            amp.meta[SELF_CHECK_META] = _self_check(amp, model, args, kwargs, spec, on_drift=on_drift, diagnose=not quick)
        except PolicyDriftError as drift:
            amp = _exact_again(model, args, kwargs, spec, drift, refused, first=amp)
    if compile:
        from graphamp.compiled import compile_converted

        if spec.mode == "autotune" and spec.config.plan is None and isinstance(amp, AmpModule) and PLAN_META in amp.meta:
            from graphamp.autotune_compiled import fastest_compiled

            return fastest_compiled(amp, model, args, kwargs, spec)
        return compile_converted(amp, model, args, kwargs)
    return amp


def _self_check(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, on_drift: str, diagnose: bool = True,
) -> Any:
    """The self-check for ``amp``'s kind; ``diagnose=False``: a difference raises at once, unlocated
    (:func:`graphamp.self_check.check_against_eager`; the FSDP check always says where)."""
    check = checker_for(amp)
    if diagnose or check is not check_against_eager:
        return check(amp, model, args, kwargs, spec, on_drift=on_drift)
    return check(amp, model, args, kwargs, spec, on_drift=on_drift, diagnose=False)


def _exact_again(
    model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, drift: PolicyDriftError, refused: CaptureError | None,
    *, first: nn.Module | None = None,
) -> AmpModule:
    """After the self-check found ``drift``, the first other conversion the self-check proves exact:
    all-ones masks passed as None (where torch.export captured the model), then the capture on the
    example's values. Else ``drift`` is raised again; where it was found undiagnosed, ``first``
    (the conversion that drifted) is checked again, diagnosed, to raise the located difference.

    torch.export traces on fake tensors, where model code that reads a tensor value or asks whether
    it is traced takes another program than eager, and torch.compile's graph breaks (the fallback
    where export refuses the model) sum some gradients in another order; the capture on values runs
    eager's program itself, guarded, at the cost of a conversion per shape and per branch taken."""
    if spec.mode != "exact":
        raise drift
    tries = [] if refused is not None else [lambda: _all_ones_masks_dropped(model, args, kwargs, spec, drift)]
    if spec.capture != "values":
        tries.append(lambda: _checked(_convert(model, args, kwargs, dataclasses.replace(spec, capture="values")), model, args, kwargs, spec))
    for attempt in tries:
        try:
            amp = attempt()
        except (PolicyDriftError, CaptureError) as e:
            _log.info("graphamp: %s: %s", type(model).__name__, str(e).strip().splitlines()[0][:200])
            continue
        if amp.graphamp_info.capture == "values":
            _log.info(
                "graphamp: %s captured on the example's values (eager's program, guarded; the module converts "
                "again for other sizes and values its code branches on), because %s",
                type(model).__name__, str(drift).strip().splitlines()[0][:200],
            )
        return amp
    if first is not None and drift.undiagnosed:
        first.meta[SELF_CHECK_META] = _self_check(first, model, args, kwargs, spec, on_drift="raise")
        return first  # the difference did not show again (it raises, as a rule)
    raise drift


def _checked(amp: AmpModule, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> AmpModule:
    amp.meta[SELF_CHECK_META] = _self_check(amp, model, args, kwargs, spec, on_drift="raise", diagnose=False)
    return amp


def _all_ones_masks_dropped(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, drift: PolicyDriftError) -> AmpModule:
    """The model converted with its all-ones keyword masks passed as None, if that is exact; else
    ``drift`` is raised again.

    Model code may drop a mask that masks nothing by its values (transformers' mask utilities:
    ``padding_mask.all()``), which no trace can read: traced, it builds the mask and runs another
    program (an fp32 zero bias makes softmax run in fp32), whose gradients round differently. Such
    code runs the same program for an all-ones mask as for no mask, so the graph converted without
    the mask is eager's; the module passes None for an all-ones mask on every call (a call with
    padding keeps its mask, and converts its own graph on first use, checked in turn). That holds
    only where the self-check proves it on the example: the module, called with the all-ones mask,
    equals eager autocast called with it, outputs and gradients.
    """
    names = tuple(k for k, v in kwargs.items() if is_all_ones(v))
    if not names or spec.mode != "exact":
        raise drift
    try:
        amp = _convert(model, args, {**kwargs, **dict.fromkeys(names)}, spec)
    except Exception:  # the model needs the mask: the first conversion's difference stands
        raise drift from None
    if not isinstance(amp, AmpModule):
        raise drift
    amp.__dict__[ALL_ONES_AS_NONE] = names
    # What the self-check below proves, for these masks' shapes only (emit.AmpModule._all_ones_dropped).
    amp.__dict__[ALL_ONES_PROVEN] = {all_ones_key(kwargs, names, model.training): True}
    try:
        amp.meta[SELF_CHECK_META] = _self_check(amp, model, args, kwargs, spec, on_drift="raise", diagnose=False)
    except PolicyDriftError:
        raise drift from None
    _log.info("graphamp: %s drops an all-ones %s by value; converted without it", type(model).__name__, ", ".join(names))
    return amp


def check_inputs(model: object, args: object, kwargs: object, frontend: str) -> tuple[tuple, dict]:
    """The model and example inputs every frontend takes, checked and normalised."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{frontend} expects a torch.nn.Module, got {type(model).__name__}; wrap a function "
            "in an nn.Module whose forward calls it"
        )
    if isinstance(model, AmpModule):
        raise ValueError("this model was already converted by graphamp; convert the original model instead")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of example keyword inputs, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})


@source_lines_read_lazily()
def _convert(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, check: bool | None = None) -> AmpModule:
    """The conversion core every frontend calls: capture, observe eager, run the passes, emit.

    ``check`` overrides ``spec.check`` (verify rebuilds a drifted conversion without the check, to
    report where it differs). A model holding FSDP2 (``fully_shard``) units is converted unit by
    unit (:mod:`graphamp.integrations.fsdp`).
    """
    # Lazy, and importing nothing of torch.distributed by itself.
    from graphamp.integrations import fsdp

    if fsdp.is_sharded(model):
        return fsdp.convert_sharded(model, args, kwargs, spec, check=check)
    with autocast_off():
        gm = _rewrite(model, args, kwargs, spec, check=check)
        amp = emit(gm, model, spec, example=(args, kwargs))
    if spec.mode == "autotune" and spec.config.plan is None and checks_accuracy():
        amp = _no_less_accurate(amp, model, args, kwargs, spec)
    return amp


def _no_less_accurate(amp: AmpModule, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> AmpModule:
    """Autotune's end-to-end check: on the example, the raised program's error against fp32 is at
    most eager autocast's. Else, where the measurements say raising every op is faster than
    autocast's dtypes, the program with every op raised (fp32 wherever autocast runs low), checked
    the same way; else every raise is undone (the plan replayed with autocast's dtypes).

    The error (:func:`_error`) is the largest relative RMS difference over the floating outputs
    and, where the conversion keeps gradients, over the parameters' gradients of a fixed random
    projection of the outputs. An RMS over every element, not the largest single difference: raising
    an op never makes that op less precise, but the ops after it round other values, so one element
    (or a scalar loss, all a ``TrainStep``'s graph returns) can come out a little above autocast's by
    chance, and the whole plan would be undone for it.
    """
    plan = amp.meta.get(PLAN_META)
    if plan is None or not plan.raised:
        return amp
    start = time.perf_counter()
    try:
        measured = errors_against_fp32({"plan": amp}, model, args, kwargs, spec)
        err_tuned, err_low = measured["plan"], measured["autocast"]
        over = "outputs and gradients" if _checked_params(model, spec) else "outputs"
        errors = f"relative RMS error vs fp32 on the example ({over}) {err_tuned:.3g}, eager autocast's {err_low:.3g}"
        if err_tuned <= err_low:
            amp.meta[PLAN_META] = dataclasses.replace(plan, accuracy=errors, check_s=time.perf_counter() - start)
            return amp
    except Exception as e:  # the check is advisory: a model that cannot run eagerly keeps its plan
        amp.meta[PLAN_META] = dataclasses.replace(
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
            raised.meta[PLAN_META] = dataclasses.replace(everything, check_s=time.perf_counter() - start, accuracy=(
                f"every op raised instead: with {len(plan.raised)} op(s) raised, {errors}; with every op raised "
                f"(measured {fp32_ms:.3g} ms in fp32 against {low_ms:.3g} ms in {short_dtype(spec.dtype)}) {err_all:.3g}"
            ))
            return raised
    undone = dataclasses.replace(plan, decisions=dict.fromkeys(plan.decisions, spec.dtype), accuracy=(
        f"raises undone: with {len(plan.raised)} op(s) raised, {errors}"
    ))
    again = replay(model, args, kwargs, spec, undone)
    again.meta[PLAN_META] = dataclasses.replace(undone, check_s=time.perf_counter() - start)
    return again


def replay(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, decisions: AutotunePlan) -> AmpModule:
    """The conversion again with ``decisions`` as its plan (no measuring, no accuracy check)."""
    return _convert(model, args, kwargs, dataclasses.replace(spec, config=dataclasses.replace(spec.config, plan=decisions)))


def errors_against_fp32(programs: dict[str, nn.Module], model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> dict[str, float]:
    """:func:`_error` of each program on the example against the model in fp32, and of eager
    autocast under the key ``"autocast"``: the measure of :func:`_no_less_accurate`."""
    params = _checked_params(model, spec)
    ref = _outputs_and_grads_of(model, model, args, kwargs, params)
    with ambient_autocast(spec.device_type, spec.dtype):
        errors = {"autocast": _error(_outputs_and_grads_of(model, model, args, kwargs, params), ref)}
    for name, program in programs.items():
        errors[name] = _error(_outputs_and_grads_of(program, model, args, kwargs, params), ref)
    return errors


def _checked_params(model: nn.Module, spec: AmpSpec) -> list[torch.Tensor]:
    return [] if spec.inference else [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]


def _outputs_and_grads_of(program: nn.Module, model: nn.Module, args: tuple, kwargs: dict, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
    with _state_restored(model):  # buffers and RNG as they were, after
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


def _error(got: tuple[list[torch.Tensor], ...], ref: tuple[list[torch.Tensor], ...]) -> float:
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


def _guard_eager_reads(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, grads: bool) -> None:
    """Guards in ``gm`` on the tensor values eager reads to choose its program (see
    ``capture.values.guard_eager_reads``); a warning for those no guard can check."""
    unguarded = guard_eager_reads(gm, model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype, grads=grads)
    if spec.target == "export":  # a deployed program may not call graphamp: ATen assertions instead
        unguarded += guards_as_asserts(gm)
    if unguarded:
        warnings.warn(
            f"{type(model).__name__}'s eager code reads tensor values to choose its program ({', '.join(unguarded[:3])}"
            f"{' ...' if len(unguarded) > 3 else ''}), which the graph torch.export captured does not read: it follows "
            "the example's path there, and graphamp cannot check as it runs that a call takes the same path. Inputs "
            "whose values take another path in eager may differ from eager autocast. Way out: graphamp.verify on "
            "such inputs, or convert with an example that takes their path.",
            EagerPathWarning,
            stacklevel=4,
        )


def _rewrite(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, check: bool | None = None) -> torch.fx.GraphModule:
    """Capture, observe eager and run the passes: the rewritten graph, before emit (graphamp.export
    hands it to torch.export instead)."""
    grads = not (spec.inference or spec.grad_free) and spec.target == "module"
    with capture_lock(), autocast_off():
        if spec.capture == "values":
            gm = capture_by_values(model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype, grads=grads)
        else:
            gm = capture(model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype, grads=grads)
            if spec.target in ("module", "export"):
                _guard_eager_reads(gm, model, args, kwargs, spec, grads)
        observe_eager(gm, model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype)
        run_passes(gm, spec, build_pipeline(spec, check=check))
        return gm
