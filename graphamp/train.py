"""``graphamp.TrainStep``: the canonical mixed-precision training step, with the forward and loss as one graph.

PyTorch's AMP recipe is six lines that are easy to get subtly wrong (clipping before unscaling,
backward inside autocast, a GradScaler with bf16)::

    with torch.autocast(device_type, dtype):                    # 1. forward and loss
        loss = loss_fn(model(x), target)
    scaler.scale(loss).backward()                               # 2. scaled backward
    scaler.unscale_(optimizer)                                  # 3. unscale
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # 4. clip
    scaler.step(optimizer)                                      # 5. step, skipped on inf/nan
    scaler.update()                                             # 6. scale update

:class:`TrainStep` runs exactly these steps, bit for bit, with step 1 replaced by one graph that
:func:`graphamp.convert` rewrote from the model *and* the loss, so no runtime autocast is involved.
``scaler="graph"`` replaces the host sync in ``GradScaler.step`` with a tensor-level select.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from numbers import Real
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from graphamp.config import Config
from graphamp.pipeline import build, conversions_of_one_capture
from graphamp.emit import AmpModule
from graphamp.errors import InputMismatchError
from graphamp.probe import attribute_bound
from graphamp.eager import state_restored
from graphamp.node_info import GraphInfo, graph_info, peek_graph_info
from graphamp.runtime import grad_casts_kept
from graphamp.self_check import applies, check_against_eager, check_self_check
from graphamp.spec import AmpSpec, autocast_off, check_device
from graphamp.autotune.budget import within_budget
from graphamp.autotune.compiled import fastest_compiled
from graphamp.compiled import CompiledOptimizerStep, compiled_for_training
from graphamp.integrations import fsdp

__all__ = ["TrainStep", "LossModule", "SCALER_MODES"]

SCALER_MODES = ("auto", "graph")
_STATE_KEYS = {"calls", "steps", "scaler", "applied"}


class _Tensor:
    """Stands for a tensor input in a call's signature (tensors may change between calls)."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()


class LossModule(nn.Module):
    """A model and its loss as one module, so one graph holds both.

    Autocast's docs put the loss inside the autocast region; converting the two together gives
    the loss the same casts. Its parameters are the model's own (and the loss module's, if any).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, args: tuple, kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*args, **kwargs), target)


def _signature(inputs: Any) -> tuple[Any, tuple]:
    """The inputs' structure and non-tensor values, which the converted graph fixed."""
    leaves, spec = pytree.tree_flatten(inputs)
    return spec, tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)


def _describe_signature(signature: tuple[Any, tuple] | None) -> str:
    if signature is None:
        return "nothing"
    spec, constants = signature
    args, kwargs, target = pytree.tree_unflatten(list(constants), spec)
    return f"args={args!r} kwargs={kwargs!r} target={target!r}"


def _check_scaler(scaler: object, device_type: str, dtype: torch.dtype) -> torch.amp.GradScaler | None:
    """The GradScaler that ``scaler=`` asks for, or None for no loss scaling."""
    if scaler is None:
        return None
    if isinstance(scaler, str):
        if scaler not in SCALER_MODES:
            raise ValueError(
                f"scaler={scaler!r} is not a scaler mode; use 'auto' (a GradScaler for fp16, none for "
                f"bf16), 'graph' (sync-free scaling), None, or a torch.amp.GradScaler"
            )
        if scaler == "auto" and dtype == torch.bfloat16:
            return None
        if dtype == torch.bfloat16:
            _warn_bf16_scaler()
        return torch.amp.GradScaler(device_type)
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be 'auto', 'graph', None or a torch.amp.GradScaler, got {type(scaler).__name__}"
        )
    if scaler._device != device_type:
        raise ValueError(
            f"the GradScaler is for device {scaler._device!r} but the step runs on {device_type!r}; "
            f"build it as torch.amp.GradScaler({device_type!r})"
        )
    if dtype == torch.bfloat16 and scaler.is_enabled():
        _warn_bf16_scaler()
    return scaler if scaler.is_enabled() else None


def _warn_bf16_scaler() -> None:
    warnings.warn(
        "loss scaling with bfloat16 is legal but pointless: bf16 has float32's exponent range, so "
        "gradients do not underflow. The step runs as asked (it matches the same eager loop); pass "
        "scaler=None (or 'auto') to skip the scaler's work.",
        UserWarning,
        stacklevel=3,
    )


def _check_args(
    model: object, loss_fn: object, optimizer: object, max_grad_norm: object, accumulate: object, config: object
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"TrainStep expects a torch.nn.Module as model, got {type(model).__name__}")
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if isinstance(inner, AmpModule):
        raise ValueError(
            "TrainStep converts the model together with its loss; pass the original model, not an "
            "AmpModule graphamp.convert returned"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = {id(p) for p in inner.parameters()}
    if not any(id(p) in params for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer holds none of the model's parameters (was it built on a copy of the "
            "model?); build it on model.parameters()"
        )
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, Real):
            raise TypeError(f"max_grad_norm must be a number or None, got {type(max_grad_norm).__name__}")
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}; pass None not to clip")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int):
        raise TypeError(f"accumulate must be a positive int, got {type(accumulate).__name__}")
    if accumulate < 1:
        raise ValueError(f"accumulate must be at least 1 (1 steps on every call), got {accumulate}")


def _forward_through(module: nn.Module, forward: Callable[..., Any]) -> contextlib.AbstractContextManager:
    """Bind ``module.forward`` to ``forward`` for the duration, so a wrapper calling it runs the graph."""
    return attribute_bound(module, "forward", forward)


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The inf/nan flag ``scaler.unscale_(optimizer)`` recorded, summed over devices, without a sync."""
    per_device = scaler._found_inf_per_device(optimizer)
    flags = [t.to(scaler._scale.device, non_blocking=True) for t in per_device.values()]
    total = flags[0].clone()
    for flag in flags[1:]:
        total += flag
    return total


def _stepped_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _state_is_ready(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter the step will update already has optimizer state."""
    return all(optimizer.state.get(p) for p in _stepped_params(optimizer))


def _select_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()``, then keep the old parameters and state where ``found_inf`` is set: no host sync.

    ``torch.where`` copies the chosen values bit for bit, so a skipped step leaves parameters and
    optimizer state (AdamW's step count and moments, SGD's momentum) exactly as GradScaler's skip does.
    """
    params = _stepped_params(optimizer)
    skip = found_inf.reshape(()) != 0
    with torch.no_grad():
        old_params = [p.detach().clone() for p in params]
        old_state: list[dict[str, torch.Tensor]] = []
        for p in params:
            saved = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    saved[key] = value.clone()
                elif value is not None:
                    raise TypeError(
                        f"scaler='graph' selects the optimizer's state with tensor ops, but "
                        f"{type(optimizer).__name__} keeps {key!r} as a {type(value).__name__}. Way out: "
                        "use scaler='auto' (GradScaler's synced skip), or an optimizer with tensor state"
                    )
            old_state.append(saved)
        optimizer.step()
        for p, old in zip(params, old_params):
            p.copy_(torch.where(skip, old, p))
        for p, saved in zip(params, old_state):
            state = optimizer.state[p]
            for key, old in saved.items():
                new = state[key]
                new.copy_(torch.where(skip.to(new.device), old, new))


class TrainStep:
    """One mixed-precision training step, exact to PyTorch's canonical eager AMP loop.

    ``step(*args, target=target, **kwargs)`` zeroes the gradients (at the start of each
    accumulation window), runs the model and ``loss_fn(output, target)`` as one graph converted by
    :func:`graphamp.convert` on the first call, runs the scaled backward, and at the end of the
    window unscales, clips (``max_grad_norm``), steps (skipped on inf/nan, as GradScaler skips it)
    and updates the scale. It returns the loss, detached and unscaled.

    Args:
        model: the module to train, or a ``DistributedDataParallel`` around it. With DDP, the
            inner module (plus the loss) is converted, and each call runs that graph inside DDP's
            own forward (the inner module's ``forward`` is bound to the graph for the duration of
            the call), so DDP's buffer broadcast, reducer and communication hooks apply unchanged.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``; it runs inside the converted graph,
            as autocast's docs put the loss inside the autocast region.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
        dtype: ``torch.bfloat16`` or ``torch.float16``; None takes autocast's default for the device.
        device_type: "cpu" or "cuda"; None takes the device of the model's parameters.
        scaler: "auto" (``torch.amp.GradScaler(device_type)`` for fp16, no scaling for bf16), a
            ``torch.amp.GradScaler`` of your own, None (no scaling), or "graph" (a GradScaler whose
            skip decision is taken with tensor ops, with no host sync; see below). A scaler with
            bf16 is legal but pointless: it runs, with a ``UserWarning``.
        max_grad_norm: clip the unscaled gradients' total norm to this (``clip_grad_norm_``).
        accumulate: step the optimizer once every ``accumulate`` calls. Each call back-propagates
            ``loss / accumulate`` (scaled), as the AMP docs' accumulation loop does, so the summed
            gradient is that of the mean loss; under DDP the calls before the last of a window run
            under ``no_sync()``. Checkpoint at window ends (``step.stepped``).
        config: a :class:`graphamp.Config` passed to :func:`graphamp.convert`.
        self_check: as :func:`graphamp.convert`'s: on the first call, the converted model-and-loss
            and eager autocast run that batch once more (same random state, buffers restored) and
            the loss and every parameter gradient must be bitwise equal; "raise" (default),
            "warn" or "off".
        compile: run the converted model-and-loss (forward and backward) through AOTAutograd and
            inductor, and the optimizer's step compiled too
            (:class:`graphamp.compiled.CompiledOptimizerStep`; not a ``fused=True`` optimizer,
            which runs its own kernel). Faster; no longer bitwise equal to the eager loop (inductor
            rounds its fused kernels its own way, dropout draws from inductor's generator). The
            self-check still checks the converted graph, uncompiled. The first call compiles
            (with ``mode="autotune"``: up to three candidate programs, keeping the fastest forward
            and backward on that batch, as :func:`graphamp.convert` does).
        mode: "exact" (default: the step equals the eager AMP loop bit for bit) or "autotune":
            :func:`graphamp.convert`'s autotune on the model and loss, timing each op's forward and
            backward on this machine and raising to fp32 the low-precision ops that run faster in
            fp32 (fp16 matmuls on a CPU that emulates fp16), never less accurate than autocast on the
            first batch. Not bitwise: the self-check does not apply; the plan (decisions, times,
            accuracy against autocast's) is ``graphamp.AutotunePlan.of(step.module)``. "budget":
            :func:`graphamp.convert`'s budget search on the model and loss (the loss and every
            gradient within the error budget, on the first batch and a held-back one); its plan is
            ``graphamp.BudgetPlan.of(step.module)``.

    Attributes:
        module: the converted model+loss (an :class:`AmpModule`), after the first call.
        scaler: the GradScaler in use, or None.
        calls, steps: calls made, and optimizer steps taken (skipped ones included).
        stepped: whether the last call ended an accumulation window (ran the optimizer step).

    ``scaler="graph"``: ``GradScaler.step`` reads the inf/nan flag on the host (``.item()``) to
    decide whether to call ``optimizer.step()``. In graph mode, the step uses the scaler's own
    ``unscale_`` (``torch._amp_foreach_non_finite_check_and_unscale_``) and ``update``
    (``torch._amp_update_scale_``), which never sync, and replaces the decision by always stepping
    and then selecting, with ``torch.where``, the old or the new parameters and optimizer state.
    That is exactly GradScaler's skip for optimizers whose state is all tensors updated in place
    (SGD, Adam, AdamW, ...): parameters, moments and step counts match bit for bit. Until the
    optimizer holds state for every parameter it steps (or one step has been applied), graph mode
    takes GradScaler's synced path, so a skipped first step does not leave zero-filled state behind
    that GradScaler would not have created. Optimizers that handle the flag themselves (``fused=True``)
    get it through ``GradScaler.step``, which does not sync for them. On CUDA, keep the optimizer
    state on the device (``capturable=True`` for Adam/AdamW, whose step counters otherwise live on
    the CPU, where selecting them needs the flag on the host). Graph mode costs a copy of the
    parameters and optimizer state per step; it pays off where a host sync is expensive (GPUs).

    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> step = TrainStep(model, nn.functional.mse_loss, opt, dtype=torch.bfloat16, max_grad_norm=1.0)
    >>> loss = step(torch.randn(4, 8), target=torch.randn(4, 1))
    >>> assert loss.dtype == torch.float32 and not loss.requires_grad and not step.last_step_skipped
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        dtype: torch.dtype | str | None = None,
        device_type: str | None = None,
        scaler: str | torch.amp.GradScaler | None = "auto",
        max_grad_norm: float | None = None,
        accumulate: int = 1,
        config: Config | None = None,
        self_check: str | bool = "raise",
        compile: bool = False,
        mode: str = "exact",
    ) -> None:
        _check_args(model, loss_fn, optimizer, max_grad_norm, accumulate, config)
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        self.on_drift = check_self_check(self_check)
        self.model = model
        self.inner = model.module if isinstance(model, DistributedDataParallel) else model
        if compile:  # refused for a sharded model here, before any step gathers or captures

            fsdp.refuse_compile(self.inner, "graphamp.TrainStep")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.spec = AmpSpec.resolve(self.inner, (), dtype=dtype, device_type=device_type, mode=mode, config=config, check_devices=False)
        self.device_type, self.dtype = self.spec.device_type, self.spec.dtype
        self.scaler = _check_scaler(scaler, self.device_type, self.dtype)
        self.sync_free = scaler == "graph"
        self.max_grad_norm = max_grad_norm
        self.accumulate = accumulate
        self.config = config
        self.module: AmpModule | None = None
        self._first_signature: tuple[Any, tuple] | None = None
        self.calls = 0
        self.steps = 0
        self.stepped = False
        # Graph mode selects only once the optimizer state exists (or a step has been applied).
        self._applied = False
        self._found_inf: torch.Tensor | None = None
        self.compile = compile
        self._compiled: nn.Module | None = None  # the compiled model-and-loss, made on first use
        self._compiled_step: Any = None  # the compiled optimizer step (CompiledOptimizerStep)
        # Each weight's low-precision cast, kept for one accumulation window (see _casts_kept).
        self._window_casts: dict = {}

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for inf/nan gradients (reading it syncs)."""
        return self._found_inf is not None and bool(self._found_inf.item())

    def __call__(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        signature = _signature((args, kwargs, target))
        if self.module is None:
            self.module = self._convert(args, kwargs, target)
            self._first_signature = signature
        elif signature != self._first_signature:
            raise InputMismatchError(
                "this call's inputs differ in structure (positional count, keyword names, target) or in "
                "non-tensor values from the first call's, which the converted graph was built for: "
                f"{_describe_signature(signature)} vs {_describe_signature(self._first_signature)}. Way out: "
                "pass the same arguments on every call, or build a new TrainStep for these inputs."
            )
        elif self.inner.training != self.module.graphamp_info.training:
            mode = "training" if self.module.graphamp_info.training else "eval"
            raise RuntimeError(
                f"the model was converted in {mode} mode, and dropout and batch-norm behaviour are part "
                f"of the graph, but it is now in {'training' if self.inner.training else 'eval'} mode. "
                f"Way out: call model.{'train' if self.module.graphamp_info.training else 'eval'}() "
                "before stepping, or build a new TrainStep for the other mode."
            )
        with autocast_off((self.device_type,)):  # the graph carries its casts
            if self.calls % self.accumulate == 0:
                self.optimizer.zero_grad(set_to_none=True)
            last = (self.calls + 1) % self.accumulate == 0
            with self._grad_sync(last), self._casts_kept():
                loss = self._loss(args, kwargs, target)
                scaled = loss / self.accumulate if self.accumulate > 1 else loss
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            self.calls += 1
            self.stepped = last
            if last:
                if self.compile and self._compiled_step is None:
                    self._compiled_step = CompiledOptimizerStep(self.optimizer)
                with self._compiled_step.bound() if self.compile else contextlib.nullcontext():
                    self._step()
                self._window_casts.clear()
                self.steps += 1
            return loss.detach()

    def _convert(self, args: tuple, kwargs: dict[str, Any], target: Any) -> AmpModule:
        wrapper = LossModule(self.inner, self.loss_fn)
        inputs = (args, kwargs, target)
        check_device(self.spec.device_type, wrapper, inputs)
        amp = build(wrapper, inputs, {}, self.spec)
        if self.on_drift != "off" and applies(self.spec, wrapper, inputs, {}):
            # A model with FSDP2 units is converted unit by unit, and checked with FSDP's hooks.

            check = fsdp.self_check if graph_info(amp).fsdp_units is not None else check_against_eager
            graph_info(amp).self_check = check(amp, wrapper, inputs, {}, self.spec, on_drift=self.on_drift)
        if self.compile and self.spec.mode == "autotune" and self.spec.config.plan is None and graph_info(amp).plan is not None:
            self._compiled = fastest_compiled(amp, wrapper, inputs, {}, self.spec, compile_fn=_compiled_for_training_now)
            amp = getattr(self._compiled, "amp", self._compiled)
        if self.spec.mode == "budget" and self.spec.config.plan is None:
            compile_fn = (lambda program: _compiled_for_training_now(program, wrapper, inputs, {})) if self.compile else None
            chosen = within_budget(amp, wrapper, inputs, {}, self.spec, conversions_of_one_capture(wrapper, inputs, {}, self.spec), compile_fn)
            if self.compile:
                self._compiled = chosen
            amp = getattr(chosen, "amp", chosen)
        return amp

    def _loss(self, args: tuple, kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        module = self.module
        if self.compile:
            if self._compiled is None:
                self._compiled = compiled_for_training(module)
            module = self._compiled
        if isinstance(self.model, DistributedDataParallel):
            with _forward_through(self.inner, lambda *a, **kw: module(a, kw, target)):
                loss = self.model(*args, **kwargs)
        else:
            loss = module(args, kwargs, target)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(
                f"loss_fn must return a scalar floating tensor, got {got}; reduce it (e.g. .mean())"
            )
        return loss

    def _casts_kept(self) -> contextlib.AbstractContextManager:
        """Under accumulation, each weight's low-precision cast once per window, not per micro-batch
        (``runtime.grad_casts_kept``): the same values and gradients as eager's recasts. Not for the
        compiled step (inductor fuses the casts) nor FSDP2 units (which refill gathered parameters
        in place each forward)."""
        if self.accumulate == 1 or self.compile or (peek_graph_info(self.module) or GraphInfo()).fsdp_units is not None:
            return contextlib.nullcontext()
        return grad_casts_kept(self._window_casts)

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP's canonical accumulation all-reduces once per window, on its last backward.
        if not last and isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _clip(self) -> None:
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.inner.parameters(), self.max_grad_norm)

    def _step(self) -> None:
        scaler, optimizer = self.scaler, self.optimizer
        if scaler is None:
            self._clip()
            optimizer.step()
            self._found_inf = None
            self._applied = True
            return
        scaler.unscale_(optimizer)
        self._clip()
        found_inf = _found_inf(scaler, optimizer)
        if (
            self.sync_free
            and (self._applied or _state_is_ready(optimizer))
            and not getattr(optimizer, "_step_supports_amp_scaling", False)
        ):
            _select_step(optimizer, found_inf)
        else:
            # GradScaler.step syncs (except for optimizers that take found_inf themselves).
            scaler.step(optimizer)
            if self.sync_free and not self._applied:
                self._applied = not bool(found_inf.item())
        scaler.update()
        self._found_inf = found_inf

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the step counters; the model and optimizer keep their own."""
        if self.calls % self.accumulate:
            warnings.warn(
                f"TrainStep.state_dict() in the middle of an accumulation window ({self.calls % self.accumulate} "
                f"of {self.accumulate} calls): the accumulated gradients are not saved, so a resumed run "
                "diverges. Checkpoint when step.stepped is True.",
                UserWarning,
                stacklevel=2,
            )
        return {
            "calls": self.calls,
            "steps": self.steps,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "applied": self._applied,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, so the run continues as if uninterrupted."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(
                f"not a TrainStep state_dict: expected keys {sorted(_STATE_KEYS)}, got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        if (state["scaler"] is None) != (self.scaler is None):
            saved = "no scaler" if state["scaler"] is None else "a GradScaler"
            here = "no scaler" if self.scaler is None else "a GradScaler"
            raise ValueError(
                f"the state was saved by a TrainStep with {saved}, but this one has {here}; build it "
                "with the same dtype and scaler= as the saved run"
            )
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.calls = int(state["calls"])
        self.steps = int(state["steps"])
        self._applied = bool(state["applied"])
        self.stepped = self.calls % self.accumulate == 0 and self.calls > 0


def _compiled_for_training_now(program: AmpModule, model: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
    """``TrainStep(compile=True)``'s compiled model-and-loss for ``program``, its forward compiled
    now (on the example, the model's state restored after)."""
    compiled = compiled_for_training(program)
    with state_restored(model):
        compiled(*args, **kwargs)
    return compiled
