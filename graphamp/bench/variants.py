"""The bench's variants: what each one runs, and how it is built from a model and its inputs.

:func:`prepare` builds one variant of a :class:`graphamp.testing.zoo.Case` for a task (``infer``,
``forward``, ``train``): a :class:`Variant` whose ``step()`` is what the bench times. The constants
name the variants and the groups the bench compares (``ALTERNATIVES``: what a user gets without
graphamp at autocast's accuracy or better; ``PURE_LOW``: weights and activations all low).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import graphamp
from graphamp.autotune import compiled as autotune_compiled
from graphamp.autotune.plan import AutotunePlan, BudgetPlan
from graphamp.backend.inductor import inductor_freezing
from graphamp.testing import zoo

__all__ = [
    "ALTERNATIVES", "BENCH_MODELS", "COMPILED", "CPP_WRAPPER_TRIED", "DEFAULT_MODELS", "DTYPES", "INFER_ONLY", "PURE_LOW", "TASKS",
    "TRAIN_ONLY", "VARIANTS", "CallModule", "Variant", "faster_with_cpp_wrapper", "max_err", "prepare", "sized",
]

DTYPES = ("bf16", "fp16")  # the short names of graphamp.policy.DTYPE_ALIASES

# Benchmark sizes: large enough that compute, not Python, is most of a call.
BENCH_MODELS: dict[str, Callable[[], zoo.Case]] = {
    "mlp": lambda: zoo.mlp(),
    "checkerboard": lambda: zoo.checkerboard(),
    "transformer_encoder": lambda: sized(zoo.transformer_encoder(d_model=256, layers=4, heads=8), 8, 128),
    "many_small_ops": lambda: zoo.many_small_ops(),
    "bert": lambda: sized(zoo.bert(layers=4, hidden=256, heads=4), 8, 128),
    "gpt2": lambda: sized(zoo.gpt2(layers=4, hidden=256, heads=4), 8, 128),
    "vit": lambda: sized(zoo.vit(layers=4, hidden=256, heads=4, image=64), 8, 0),
}
# The main job's model: torch.nn's own Transformer encoder, so a fresh machine needs no transformers
# install (about 30 s of set-up and imports) for the first answer.
DEFAULT_MODELS = ("transformer_encoder",)

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
    "graphamp_budget",
    "graphamp_budget_compiled",
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
    "graphamp_backend", "graphamp_compiled", "graphamp_autotune_compiled", "graphamp_budget_compiled", "trainstep_compiled",
    "trainstep_autotune_compiled",
}
# What a user gets without graphamp at autocast's accuracy or better: ``vs best`` divides by the
# fastest of these that ran.
ALTERNATIVES = ("fp32", "autocast", "compile_autocast", "compile_autocast_freezing", "compile_fp32", "compile_fp32_freezing")
# Pure low precision (weights and activations in bf16/fp16), eager and compiled: faster where the CPU
# computes it natively, and less accurate than autocast; ``vs pure low`` divides by the fastest.
PURE_LOW = ("pure_low", "compile_pure_low")
# mode="budget": may be less accurate than autocast, within its budget (twice autocast's error by
# default); recommended as at autocast's accuracy only where it measured so.
BUDGETED = ("graphamp_budget", "graphamp_budget_compiled")
# Compiled alternatives whose inductor options include what graphamp's compiled variants try: for
# inference, graphamp_autotune_compiled also builds its program with inductor's C++ wrapper and keeps
# it where it times faster, so each of these does the same when that variant runs.
CPP_WRAPPER_TRIED = ("graphamp_autotune_compiled",)


def sized(case: zoo.Case, batch: int, seq: int) -> zoo.Case:
    case.batch, case.seq = batch, seq or case.seq
    return case


def _cast_inputs(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)


def _outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class Variant:
    """A prepared variant: ``step()`` runs one forward (infer) or one training step (train).

    ``profiled`` is the step the bench profiles to split its time into matmul kernels and the rest:
    ``step`` itself, or, where ``step`` runs a program built with inductor's C++ wrapper (whose
    kernel calls bypass the profiler, so its matmuls would count as 0%), the same program with the
    Python wrapper."""

    def __init__(self, step: Callable[[], Any], forward: Callable[[], Any] | None, lowerable: Callable[[], Any] | None) -> None:
        self.step = step
        self.forward = forward
        self.lowerable = lowerable
        self.note = ""
        self.profiled: Callable[[], Any] = step


def faster_with_cpp_wrapper(
    call: Callable[[], Any], compiled_call: Callable[[dict[str, Any]], Callable[[], Any]],
    as_step: Callable[[Callable[[], Any], Any], Callable[[], Any]],
) -> tuple[Callable[[], Any], str]:
    """``call``, or the same program built with inductor's C++ wrapper where that times faster, by the
    rule graphamp's autotune applies to its own (:mod:`graphamp.autotune.compiled`). Where the C++
    wrapper is kept, ``call`` stays the program to profile (:attr:`Variant.profiled`)."""
    cpp = compiled_call({"cpp_wrapper": True})
    steps = {"plan": as_step(call, ()), "C++ wrapper": as_step(cpp, ())}
    for step in steps.values():
        step()  # compiles
    samples = autotune_compiled.time_programs(steps)
    ratio = autotune_compiled.ratios_to_plan(samples)["C++ wrapper"]
    if autotune_compiled.pick(samples) == "C++ wrapper":
        return cpp, f"inductor's C++ wrapper kept ({ratio:.2f}x without it)"
    return call, f"inductor's C++ wrapper tried, not kept ({ratio:.2f}x)"


def prepare(name: str, case: zoo.Case, task: str, dtype: torch.dtype, *, cpp_wrapper: bool = False) -> Variant:
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
        return Variant(as_step(call, model.parameters()), call, call)
    if name == "autocast":
        def call() -> Any:
            with autocast_ctx():
                return model(*args, **kwargs)
        return Variant(as_step(call, model.parameters()), call, call)
    if name == "pure_low":
        low = model.to(dtype)
        low_args, low_kwargs = _cast_inputs((args, kwargs), dtype)
        call = lambda: low(*low_args, **low_kwargs)  # noqa: E731
        return Variant(as_step(call, low.parameters()), call, call)
    if name in ("graphamp", "graphamp_inference"):
        amp = graphamp.convert(model, args, kwargs, dtype=dtype, inference=name == "graphamp_inference")
        call = lambda: amp(*args, **kwargs)  # noqa: E731
        return Variant(as_step(call, model.parameters()), call, call)
    if name == "graphamp_autotune":
        amp = graphamp.convert(model, args, kwargs, dtype=dtype, mode="autotune", inference=task == "infer")
        call = lambda: amp(*args, **kwargs)  # noqa: E731
        variant = Variant(as_step(call, model.parameters()), call, call)
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

        python_wrapper = call = compiled_call({})
        note = ""
        if cpp_wrapper:
            call, note = faster_with_cpp_wrapper(call, compiled_call, as_step)
        variant = Variant(as_step(call, target.parameters()), call, None)
        variant.note = note
        if call is not python_wrapper:  # the C++ wrapper was kept
            variant.profiled = as_step(python_wrapper, target.parameters())
        return variant
    if name == "graphamp_backend":
        compiled = torch.compile(model, backend="graphamp", options={"dtype": dtype})
        call = lambda: compiled(*args, **kwargs)  # noqa: E731
        return Variant(as_step(call, model.parameters()), call, None)
    if name in ("graphamp_compiled", "graphamp_autotune_compiled"):
        inference = task == "infer"
        mode = "autotune" if name == "graphamp_autotune_compiled" else "exact"
        cm = graphamp.convert(model, args, kwargs, dtype=dtype, inference=inference, mode=mode, compile=True)
        call = lambda: cm(*args, **kwargs)  # noqa: E731
        variant = Variant(as_step(call, model.parameters()), call, None)
        if getattr(cm, "options", {}).get("cpp_wrapper"):
            # Autotune kept the C++ wrapper: profile the same program (frozen or not) with the Python wrapper.
            twin = graphamp.CompiledAmpModule(cm.amp, freezing=cm.freezing)
            variant.profiled = as_step(lambda: twin(*args, **kwargs), model.parameters())
        ran = "" if getattr(cm, "runs_compiled", False) else " (the compiled program was refused: runs uncompiled)"
        variant.note = (f"inference={inference}; drift on the example: {cm.drift.line()}" if getattr(cm, "drift", None) else "") + ran
        if mode == "autotune":
            variant.note = f"{AutotunePlan.of(getattr(cm, 'amp', cm)).summary()}; {variant.note}"
        return variant
    if name in ("graphamp_budget", "graphamp_budget_compiled"):
        # Past autocast within the default budget (twice eager autocast's error against fp32, on the
        # example and a held-back batch); the compiled one times each program it tries compiled.
        compile_ = name.endswith("_compiled")
        program = graphamp.convert(model, args, kwargs, dtype=dtype, mode="budget", inference=task == "infer", compile=compile_)
        call = lambda: program(*args, **kwargs)  # noqa: E731
        variant = Variant(as_step(call, model.parameters()), call, None if compile_ else call)
        variant.note = BudgetPlan.of(program).summary()
        return variant
    if name in TRAIN_ONLY:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mode = "autotune" if "autotune" in name else "exact"
        step = graphamp.TrainStep(model, lambda out, target: _loss(out), opt, dtype=dtype, compile=name.endswith("_compiled"), mode=mode)

        def train() -> Any:
            return step(*args, target=None, **kwargs)

        # TrainStep's graph ends in the loss, so it has no model outputs to compare (max err n/a).
        variant = Variant(train, None, None)
        if mode == "autotune":
            train()  # converts (and measures) now, not inside the first timed round
            variant.note = AutotunePlan.of(step.module).summary()
        return variant
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def max_err(out: Any, ref: Any) -> float:
    got, want = _outputs(out), _outputs(ref)
    if len(got) != len(want):
        return float("nan")
    err = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return float("nan")
        err = max(err, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return err


class CallModule(nn.Module):
    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self) -> Any:
        return self.fn()
