"""``graphamp.convert``: the frontend. Its arguments, :meth:`AmpSpec.resolve`, the dynamo fallback
and ``compile=True``; the conversion itself is the engine's (:mod:`graphamp.pipeline`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from graphamp import hardware
from graphamp.backend.fallback import dynamo_fallback, needs_graph_breaks
from graphamp.config import Config
from graphamp.eager import inputs_copied
from graphamp.emit import AmpModule
from graphamp.errors import CaptureError, PolicyDriftError
from graphamp.inputs import CACHE_WAY_OUT, key_value_cache
from graphamp.node_info import graph_info
from graphamp.pipeline import build, conversions_of_one_capture, exact_again, self_checked
from graphamp.self_check import applies, check_self_check
from graphamp.spec import AmpSpec
from graphamp.autotune.budget import within_budget
from graphamp.autotune.compiled import fastest_compiled
from graphamp.compiled import compile_converted
from graphamp.integrations import fsdp

__all__ = ["convert", "check_inputs"]


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
            (never less precise than autocast; ``graphamp.AutotunePlan.of(amp)`` is its plan);
            "budget" goes past autocast: op types, also those autocast keeps in fp32 (norms,
            softmax, pointwise ops), move to the other dtype where the whole program measures
            faster and its error against fp32, on the example and a held-back batch, stays within
            ``Config(error_budget=...)`` (default: twice eager autocast's own error);
            ``graphamp.BudgetPlan.of(amp)`` lists every op type tried (:mod:`graphamp.autotune.budget`).
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
            in ``amp.meta["graphamp"].self_check`` (a ``graphamp.node_info.GraphInfo``).
        compile: hand the converted graph, with its casts, to AOTAutograd and inductor (with
            freezing when ``inference``): faster, and no longer bitwise equal to eager autocast
            (inductor fuses and reduces its own way). The example runs through it once now, which
            compiles it (a failure raises :class:`graphamp.CompileError`) and measures its drift
            from eager autocast (``cm.drift``). Returns a :class:`graphamp.CompiledAmpModule`.
            With ``mode="autotune"`` (and no plan given) up to three programs are compiled, the
            plan's, autocast's dtypes and every op raised, and the fastest on the example is
            returned (:mod:`graphamp.autotune.compiled`; ``AutotunePlan.of(cm.amp).compiled``).
            With ``mode="budget"`` each program the search tries is compiled and timed compiled.

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

        fsdp.refuse_compile(model, "graphamp.convert")
    on_drift = check_self_check(self_check)
    spec = AmpSpec.resolve(
        model, (args, kwargs), dtype=dtype, device_type=device_type, mode=mode, inference=inference, config=config,
        keep_io_types=keep_io_types,
    )
    if spec.mode == "exact":
        hardware.warn_if_emulated(spec.device_type, spec.dtype)
    refused: CaptureError | None = None
    # The budget search converts many times from one capture: the first conversion makes it.
    searches = spec.mode == "budget" and spec.config.plan is None
    convert_with = conversions_of_one_capture(model, args, kwargs, spec) if searches else functools.partial(build, model, args, kwargs)
    try:
        amp = convert_with(spec)
    except CaptureError as e:
        if not needs_graph_breaks(e):
            raise
        refused = e
        try:
            amp = dynamo_fallback(model, args, kwargs, spec, e)
        except CaptureError as failed:  # dynamo cannot run it either: the capture on values may
            spec = dataclasses.replace(spec, capture="values")
            try:
                amp = build(model, args, kwargs, spec)
            except CaptureError:
                raise failed  # noqa: B904 (its own cause, the error dynamo met, is the one to show)
    if on_drift != "off" and applies(spec, model, args, kwargs):
        try:
            # Undiagnosed where other conversions follow: locating a difference costs a run or a compile.
            quick = on_drift == "raise" and spec.mode == "exact"
            graph_info(amp).self_check = self_checked(amp, model, args, kwargs, spec, on_drift=on_drift, diagnose=not quick)
        except PolicyDriftError as drift:
            amp = exact_again(model, args, kwargs, spec, drift, refused, first=amp)
    if searches and isinstance(amp, AmpModule):
        compile_fn = (lambda program: compile_converted(program, model, args, kwargs)) if compile else None
        return within_budget(amp, model, args, kwargs, spec, convert_with, compile_fn)
    if compile:
        if spec.mode == "autotune" and spec.config.plan is None and isinstance(amp, AmpModule) and graph_info(amp).plan is not None:
            return fastest_compiled(amp, model, args, kwargs, spec)
        return compile_converted(amp, model, args, kwargs)
    return amp


def check_inputs(model: object, args: object, kwargs: object, frontend: str) -> tuple[tuple, dict]:
    """The model and example inputs every frontend takes, checked and normalised (the tensors
    copied: :func:`graphamp.eager.inputs_copied`)."""
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
    cache = key_value_cache(tuple(args), dict(kwargs or {}))
    if cache is not None:
        raise CaptureError(f"{frontend}: the example passes a key/value cache, {cache}. {CACHE_WAY_OUT}")
    # graphamp runs the model on the example many times (capture, probes, the self-check): on its
    # own copy, so code that writes its inputs in place never writes the user's tensors.
    return inputs_copied((tuple(args), dict(kwargs or {})))

