"""The conversion engine: capture, rewrite, emit, and the self-check's fallback ladder.

Every conversion runs here: ``graphamp.convert`` (the frontend: arguments, the dynamo fallback,
``compile=True``), ``graphamp.export``, verify, explain, search, ``TrainStep``, FSDP2 units, and
every re-conversion of an :class:`~graphamp.emit.AmpModule` that meets another training mode, grad
mode, shape class or input structure.

- :func:`rewrite`: capture, observe eager where the trace may differ, run the passes.
- :func:`build`: :func:`rewrite`, then emit the module (and autotune's accuracy check).
- :func:`exact_again`: after the self-check found a difference, the other conversions that may be
  exact (all-ones masks passed as None, the capture on the example's values), each checked.
- :func:`reconvert`: convert again for a call the module's graphs cannot take, checked as the
  first conversion was.

Nothing below the engine imports it. :func:`emit` is handed :func:`reconvert` and each module keeps
it (a saved module pickles it by its qualified name, ``graphamp.pipeline.reconvert``); FSDP's unit
conversion is handed :func:`build`; autotune's accuracy check is handed :func:`replay`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Callable

import torch
from torch import nn

from graphamp.autotune.accuracy import no_less_accurate
from graphamp.backend.fallback import needs_graph_breaks
from graphamp.capture import capture
from graphamp.capture.export import size_conditions_since, size_guard_count
from graphamp.capture.stacks import source_lines_read_lazily
from graphamp.capture.values import capture_by_values, guard_eager_reads
from graphamp.emit import ALL_ONES_AS_NONE, ALL_ONES_PROVEN, AmpModule, all_ones_key, emit, is_all_ones
from graphamp.errors import CaptureError, EagerPathWarning, PolicyDriftError
from graphamp.passes import build_pipeline, run_passes
from graphamp.autotune.measure import checks_accuracy
from graphamp.passes.export_guards import guards_as_asserts
from graphamp.passes.follow_eager_attention import SDPA, repeated_heads
from graphamp.autotune.plan import AutotunePlan
from graphamp.node_info import graph_info
from graphamp.probe import eager_sdpa_calls
from graphamp.self_check import applies, check_against_eager, checker_for
from graphamp.shared_state import capture_lock
from graphamp.spec import AmpSpec, autocast_off
from graphamp.integrations import fsdp

_log = logging.getLogger("graphamp")

__all__ = ["build", "exact_again", "reconvert", "replay", "rewrite", "self_checked"]


def observe_eager(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype) -> None:
    """Record in the graph's GraphInfo what eager did where the traced graph may hold another program.

    Only attention whose key/value heads the traced code repeats needs it (see
    passes/follow_eager_attention.py); other models pay nothing.
    """
    if any(repeated_heads(n.args[1]) for n in gm.graph.find_nodes(op="call_function", target=SDPA)):
        graph_info(gm).eager_sdpa = eager_sdpa_calls(model, args, kwargs, device_type=device_type, dtype=dtype)


@source_lines_read_lazily()
def build(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, check: bool | None = None) -> AmpModule:
    """The conversion core every frontend calls: capture, observe eager, run the passes, emit.

    ``check`` overrides ``spec.check`` (verify rebuilds a drifted conversion without the check, to
    report where it differs). A model holding FSDP2 (``fully_shard``) units is converted unit by
    unit (:mod:`graphamp.integrations.fsdp`).
    """
    if fsdp.is_sharded(model):
        return fsdp.convert_sharded(model, args, kwargs, spec, check=check, build=build)
    with autocast_off():
        gm = rewrite(model, args, kwargs, spec, check=check)
        amp = emit(gm, model, spec, example=(args, kwargs), engine=reconvert)
    if spec.mode == "autotune" and spec.config.plan is None and checks_accuracy():
        amp = no_less_accurate(amp, model, args, kwargs, spec, replay)
    return amp


def conversions_of_one_capture(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> Callable[[AmpSpec], AmpModule]:
    """A function converting ``model`` with a spec like ``spec`` (another config: the budget search's
    trials), each from a copy of one capture, made on the first call: capturing is most of a
    conversion's time, and the passes only read the captured graph's sizes."""
    first: list[torch.fx.GraphModule] = []

    def convert_with(trial: AmpSpec) -> AmpModule:
        if fsdp.is_sharded(model) or trial.capture != spec.capture:
            return build(model, args, kwargs, trial)
        with source_lines_read_lazily(), autocast_off():
            if not first:
                first.append(captured(model, args, kwargs, spec))
            gm = rewritten(_copy_of_capture(first[0]), trial)
            return emit(gm, model, trial, example=(args, kwargs), engine=reconvert)

    return convert_with


def _copy_of_capture(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the captured graph and its records; the parameters and buffers stay the model's own.

    The pytree specs (immutable) are shared: deep-copying a LeafSpec makes torch warn that
    constructing one is deprecated. fx's Graph deep-copies its codegen without the memo, so the
    codegen is set aside during the copy and copied shallow.
    """
    specs = [getattr(gm, name) for name in ("_in_spec", "_out_spec") if getattr(gm, name, None) is not None]
    codegen = gm.graph._codegen
    gm.graph._codegen = torch.fx.graph.CodeGen()
    try:
        new = copy.deepcopy(gm, {id(t): t for t in (*gm.parameters(), *gm.buffers(), *specs)})
    finally:
        gm.graph._codegen = codegen
    new.graph._codegen = copy.copy(codegen)
    new.recompile()
    return new


def replay(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, decisions: AutotunePlan) -> AmpModule:
    """The conversion again with ``decisions`` as its plan (no measuring, no accuracy check)."""
    return build(model, args, kwargs, dataclasses.replace(spec, config=dataclasses.replace(spec.config, plan=decisions)))


def self_checked(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, on_drift: str, diagnose: bool = True,
) -> Any:
    """The self-check for ``amp``'s kind; ``diagnose=False``: a difference raises at once, unlocated
    (:func:`graphamp.self_check.check_against_eager`; the FSDP check always says where)."""
    check = checker_for(amp)
    if diagnose or check is not check_against_eager:
        return check(amp, model, args, kwargs, spec, on_drift=on_drift)
    return check(amp, model, args, kwargs, spec, on_drift=on_drift, diagnose=False)


def exact_again(
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
    tries = [] if refused is not None else [lambda: all_ones_masks_dropped(model, args, kwargs, spec, drift)]
    if spec.capture != "values":
        tries.append(lambda: checked_again(build(model, args, kwargs, dataclasses.replace(spec, capture="values")), model, args, kwargs, spec))
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
        graph_info(first).self_check = self_checked(first, model, args, kwargs, spec, on_drift="raise")
        return first  # the difference did not show again (it raises, as a rule)
    raise drift


def checked_again(amp: AmpModule, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> AmpModule:
    graph_info(amp).self_check = self_checked(amp, model, args, kwargs, spec, on_drift="raise", diagnose=False)
    return amp


def all_ones_masks_dropped(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, drift: PolicyDriftError) -> AmpModule:
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
        amp = build(model, args, {**kwargs, **dict.fromkeys(names)}, spec)
    except Exception:  # the model needs the mask: the first conversion's difference stands
        raise drift from None
    if not isinstance(amp, AmpModule):
        raise drift
    amp.__dict__[ALL_ONES_AS_NONE] = names
    # What the self-check below proves, for these masks' shapes only (emit.AmpModule._all_ones_dropped).
    amp.__dict__[ALL_ONES_PROVEN] = {all_ones_key(kwargs, names, model.training): True}
    try:
        graph_info(amp).self_check = self_checked(amp, model, args, kwargs, spec, on_drift="raise", diagnose=False)
    except PolicyDriftError:
        raise drift from None
    _log.info("graphamp: %s drops an all-ones %s by value; converted without it", type(model).__name__, ", ".join(names))
    return amp


def _guard_eager_reads(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, grads: bool) -> None:
    """Guards in ``gm`` on the tensor values eager reads to choose its program (see
    ``capture.values.guard_eager_reads``); a warning for those no guard can check."""
    unguarded = guard_eager_reads(
        gm, model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype, grads=grads, keep_functions=spec.target != "export",
    )
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


def rewrite(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, check: bool | None = None) -> torch.fx.GraphModule:
    """Capture, observe eager and run the passes: the rewritten graph, before emit (graphamp.export
    hands it to torch.export instead)."""
    with capture_lock(), autocast_off():
        return rewritten(captured(model, args, kwargs, spec), spec, check=check)


def captured(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> torch.fx.GraphModule:
    """The model's graph as the passes take it: captured (by torch.export, or on values), its eager
    value reads guarded, and what eager did at its attention calls observed."""
    grads = not (spec.inference or spec.no_grad) and spec.target == "module"
    # An exported program runs no backward and may not call graphamp: custom Functions are traced through.
    keep = spec.target != "export"
    with capture_lock(), autocast_off():
        if spec.capture == "values":
            gm = capture_by_values(model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype, grads=grads, keep_functions=keep)
        else:
            gm = capture(model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype, grads=grads, keep_functions=keep)
            if spec.target in ("module", "export"):
                _guard_eager_reads(gm, model, args, kwargs, spec, grads)
        observe_eager(gm, model, args, kwargs, device_type=spec.device_type, dtype=spec.dtype)
        return gm


def rewritten(gm: torch.fx.GraphModule, spec: AmpSpec, *, check: bool | None = None) -> torch.fx.GraphModule:
    """``gm`` (from :func:`captured`) through the passes, in place."""
    with capture_lock(), autocast_off():
        guards = size_guard_count(gm)
        run_passes(gm, spec, build_pipeline(spec, check=check))
        # A size a pass fixed to the example's (a composite's decomposition reading it as an int)
        # is checked at call time like the model's own conditions.
        taken = size_conditions_since(gm, guards, "a composite op's decomposition, traced for the example's sizes")
        if taken:
            record = graph_info(gm)
            record.size_conditions = [*record.size_conditions, *taken]
        return gm


def reconvert(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, checked: Any) -> AmpModule:
    """``model`` converted again with ``spec`` (another training mode, grad mode, shape class or
    input structure, for an :class:`AmpModule` that met such a call), checked as the first
    conversion was: ``checked`` is its self-check record (None: it was not checked). A difference the first conversion warned about warns again; else it
    raises, after the fallbacks convert tries (all-ones masks as None, the capture on values).

    The module calls this through the engine it was emitted with (``AmpModule._engine``).
    Where torch.export refuses the model on these inputs (a branch the example did not take), the
    variant is captured on their values, as convert's last fallback: the dynamo fallback is no
    graph to emit in a converted module's place."""
    try:
        variant = build(model, args, kwargs, spec)
    except CaptureError as refused:
        if spec.capture == "values" or not needs_graph_breaks(refused):
            raise
        spec = dataclasses.replace(spec, capture="values")
        try:
            variant = build(model, args, kwargs, spec)
        except CaptureError:
            raise refused  # noqa: B904 (its own cause, what torch.export met, is the one to show)
    if checked is None or not applies(spec, model, args, kwargs):
        return variant
    ok = checked.ok
    # A graph for calls without grad is checked as an inference conversion is: forward only, under no_grad.
    check_spec = dataclasses.replace(spec, inference=True) if spec.no_grad else spec
    try:
        graph_info(variant).self_check = checker_for(variant)(
            variant, model, args, kwargs, check_spec, on_drift="raise" if ok else "warn"
        )
    except PolicyDriftError as drift:
        if spec.no_grad:
            raise
        variant = exact_again(model, args, kwargs, spec, drift, None)
    return variant
