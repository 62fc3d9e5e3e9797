"""PyTorch Lightning: ``Trainer(plugins=[GraphampPrecision("bf16-mixed")])``, bitwise to ``precision="bf16-mixed"``;
``Fabric(plugins=[GraphampFabricPrecision("bf16-mixed")])``, bitwise to ``Fabric(precision="bf16-mixed")``.

Lightning's ``MixedPrecision`` plugin runs every step (``training_step``, ``validation_step``, ...)
under ``torch.autocast(device, dtype, cache_enabled=False)``. :class:`GraphampPrecision` keeps that
region and everything else Lightning does (the loss under autocast, ``GradScaler`` for
``"16-mixed"``, gradient clipping, optimizers, hooks, logging, checkpoints), and runs the model's
forward as a graph converted by :func:`graphamp.convert` on the first batch, with
``Config(cache_enabled=False)``: Lightning's recipe exactly, so losses, gradients and parameters are
bitwise those of ``precision="bf16-mixed"`` (or ``"16-mixed"``).

Splitting the step this way is exact because, without autocast's cache, every cast is local to the
op that makes it: the forward's casts and the loss's casts never share a tensor.

For the duration of each step the converted module's ``forward`` (the LightningModule's own, or the
submodule named by ``module=``) is bound to one :class:`~graphamp.AmpModule`, converted on first use
and checked against eager autocast on that batch (``self_check``); it converts itself again, checked
alike, for the other training mode (``train()`` for training steps, ``eval()`` for validation, test
and predict) and for another input structure or shape class. Outside the steps the model is
untouched.

Validation, test and predict run without grad, where eager sometimes takes another kernel than any
traced graph (``nn.MultiheadAttention``'s fused inference kernel in eval mode). Where the
conversion's self-check finds such a difference, those calls run the model eagerly under the
step's autocast, as Lightning does, with one ``PolicyDriftWarning`` saying so: the numbers stay
Lightning's, only the speed-up is lost there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import graphamp
from graphamp.config import Config
from graphamp.eager import rng_kept, state_restored
from graphamp.errors import OptionError, PolicyDriftWarning
from graphamp.policy import DEVICE_TYPES

try:
    import pytorch_lightning as pl
    from lightning_fabric.plugins.precision import (
        MixedPrecision as FabricMixedPrecision,
    )
    from pytorch_lightning.plugins.precision import MixedPrecision
except ImportError as e:  # pragma: no cover - exercised only without the optional dependency
    raise ImportError(
        "graphamp.integrations.lightning needs PyTorch Lightning: pip install pytorch-lightning"
    ) from e

__all__ = ["GraphampFabricPrecision", "GraphampPrecision"]

_PRECISIONS = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_SELF_CHECKS = ("raise", "warn", "off")
_NO_GRAD_ONLY = "under torch.no_grad"  # how convert's self-check words a difference only without grad
# Set while a routed call runs: a routed forward called meanwhile is called by a conversion (or its
# self-check, or the AmpModule converting itself again), which runs the model eagerly, including
# another routed module inside it.
_CONVERTING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphamp_lightning_converting", default=False)


def _precision_error(precision: object, owner: str = "GraphampPrecision", flag: str = "Trainer") -> OptionError:
    if precision in ("32", "32-true", 32, "64", "64-true", 64):
        way_out = f"train in full precision with {flag}(precision={precision!r}) and no graphamp plugin"
    elif precision in ("bf16-true", "16-true", "bf16", "16", 16, "transformer-engine", "transformer-engine-float16"):
        way_out = (
            f"{flag}(precision={precision!r}) without this plugin (graphamp reproduces autocast, which keeps "
            f"weights in fp32), or {owner}('bf16-mixed') / {owner}('16-mixed') for mixed precision"
        )
    else:
        way_out = f"{owner}('bf16-mixed'), or {owner}('16-mixed') for fp16 with a GradScaler"
    return OptionError(
        f"{owner}(precision={precision!r}): graphamp converts autocast's mixed precision, which "
        f"Lightning names 'bf16-mixed' and '16-mixed'. Way out: {way_out}."
    )


class _Router:
    """Binds a module's ``forward`` to its converted module for the duration of a step.

    One :class:`~graphamp.AmpModule`, converted by :func:`graphamp.convert` at the first call from
    that call's inputs; the AmpModule converts itself again for the other training mode and for
    another input structure or shape class. Those conversions, and their self-checks, see the
    module's own forward. ``owner`` and ``recipe`` name the plugin and the eager recipe in messages.
    """

    def __init__(
        self, target: nn.Module, *, dtype: torch.dtype, device: str, config: Config, self_check: str,
        owner: str, recipe: str,
    ) -> None:
        self.target = target
        self.dtype, self.device, self.config, self.self_check = dtype, device, config, self_check
        self.owner, self.recipe = owner, recipe
        self.amp: nn.Module | None = None
        # By training mode, once its graph ran: what its self-check found only without grad ("" if nothing).
        self.no_grad_problem: dict[bool, str] = {}
        self.calls = 0
        self._warned: set[bool] = set()

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        target = self.target
        previous = target.__dict__.get("forward")  # an instance-level forward of the user's, if any
        eager = previous if previous is not None else type(target).forward.__get__(target)

        @functools.wraps(eager)
        def forward(*args: Any, **kwargs: Any) -> Any:
            # Conversion, its self-check and the AmpModule's own conversions call the model: eagerly.
            if _CONVERTING.get():
                return eager(*args, **kwargs)
            self.calls += 1
            token = _CONVERTING.set(True)
            try:
                return self._call(eager, previous, args, kwargs)
            finally:
                _CONVERTING.reset(token)

        target.forward = forward
        try:
            yield
        finally:
            if previous is None:
                del target.forward
            else:
                target.forward = previous

    def _call(self, eager: Any, previous: Any, args: tuple, kwargs: dict) -> Any:
        training = self.target.training
        if training not in self.no_grad_problem:
            # The first call in this mode converts its graph (graphamp.convert, or the AmpModule
            # again), whose self-check says whether eager takes another kernel without grad. A call
            # without grad runs it from a restored state: it may run eagerly after all.
            if torch.is_grad_enabled():
                return self._first_in_mode(training, previous, args, kwargs)
            with state_restored(self.target):
                self._first_in_mode(training, previous, args, kwargs)
        if not torch.is_grad_enabled() and self._eager_without_grad(training):
            return eager(*args, **kwargs)  # under the step's autocast: the recipe's own program
        return self._run(args, kwargs)

    def _first_in_mode(self, training: bool, previous: Any, args: tuple, kwargs: dict) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.amp is None:
                self.amp = self._convert(previous, args, kwargs)
            out = self._run(args, kwargs)
        problem = ""
        for w in caught:
            text = str(w.message)
            # A difference only without grad is the router's to handle (_eager_without_grad).
            if issubclass(w.category, PolicyDriftWarning) and _NO_GRAD_ONLY in text:
                problem = text[text.index(_NO_GRAD_ONLY):].split(". ")[0]
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.no_grad_problem[training] = problem
        return out

    def _run(self, args: tuple, kwargs: dict) -> Any:
        """The AmpModule in the module's training mode on these inputs. A step under
        inference_mode (validation) hands in inference tensors, which a conversion the AmpModule
        makes on the way (another mode, structure or shape class: capture, the self-check with
        grad) cannot use: such calls run on copies, in the step's grad mode."""
        amp = self.amp
        if amp.training != self.target.training:
            amp.train(self.target.training)
        if not torch.is_inference_mode_enabled():
            return amp(*args, **kwargs)
        grad = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            args, kwargs = pytree.tree_map(_normal_tensor, (args, kwargs))
            return amp(*args, **kwargs)

    def _convert(self, previous: Any, args: tuple, kwargs: dict) -> nn.Module:
        target = self.target
        # Tracing must see the model's own forward, and a step under inference_mode (validation)
        # hands in inference tensors, which a conversion (capture, self-check with grad) cannot use.
        routed = target.__dict__.pop("forward")
        if previous is not None:
            target.forward = previous
        try:
            with torch.inference_mode(False), torch.enable_grad(), rng_kept():
                ex_args, ex_kwargs = pytree.tree_map(_normal_tensor, (args, kwargs))
                return graphamp.convert(
                    target, ex_args, ex_kwargs, dtype=self.dtype, device_type=self.device, config=self.config,
                    self_check=self.self_check,
                )
        finally:
            target.forward = routed

    def _eager_without_grad(self, training: bool) -> bool:
        """Whether calls without grad run the model eagerly: the self-check of this mode's graph
        found that without grad eager takes another kernel path than the graph (a fused inference
        kernel such as nn.MultiheadAttention's), so the graph would not give the recipe's numbers."""
        problem = self.no_grad_problem.get(training, "")
        if not problem:
            return False
        if training not in self._warned:
            self._warned.add(training)
            warnings.warn(
                f"{self.owner}: {type(self.target).__name__}'s calls without grad in {'training' if training else 'eval'} "
                f"mode (validation, test, predict) run in eager autocast, as {self.recipe} runs them: without grad "
                f"eager takes another kernel path than graphamp's graph ({problem[:200]}). Calls with grad run "
                "the converted graph. Results are the recipe's either way.",
                PolicyDriftWarning,
                stacklevel=4,
            )
        return True

    @property
    def converted(self) -> dict[bool, nn.Module]:
        """The one converted module, under each training mode it has run in."""
        return dict.fromkeys(self.no_grad_problem, self.amp) if self.amp is not None else {}


class GraphampPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` with the model's forward converted by graphamp.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"`` (fp16 with a ``torch.amp.GradScaler``, also on
            CPU, where ``Trainer(precision="16-mixed")`` itself falls back to bf16).
        device: the autocast device, ``"cpu"`` or ``"cuda"``; None takes the LightningModule's.
        scaler: a ``torch.amp.GradScaler`` of your own for ``"16-mixed"``; None makes one.
        module: the qualified name of the submodule ``training_step`` calls (``"model"`` for
            ``self.model(x)``); None converts the LightningModule's own ``forward`` (``self(x)``).
        config: a :class:`graphamp.Config` (op overrides, modules kept in fp32). Its
            ``cache_enabled`` is set to False, as Lightning runs autocast.
        self_check: as :func:`graphamp.convert`'s: on each conversion, the converted module and
            eager autocast run that batch once more and must agree bitwise ("raise", "warn", "off").
            With "off", nothing tells whether eager takes another kernel without grad, so
            validation, test and predict always run the graph.

    Attributes:
        converted: the converted module under each training mode it has run in (True for
            ``train()``): one :class:`~graphamp.AmpModule`, made on first use in each
            ``fit``/``validate``/``test``/``predict`` and kept after it for inspection, which holds
            the graphs of both modes and of every input structure and shape class it met.

    >>> import pytorch_lightning as pl
    >>> class Lit(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def training_step(self, batch, i):
    ...         x, y = batch
    ...         return nn.functional.mse_loss(self(x), y)
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
    >>> plugin = GraphampPrecision("bf16-mixed")
    >>> trainer = pl.Trainer(accelerator="cpu", max_steps=2, plugins=[plugin], logger=False,
    ...                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(Lit(), torch.utils.data.DataLoader(data, batch_size=4))
    >>> assert list(plugin.converted) == [True]
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        module: str | None = None,
        config: Config | None = None,
        self_check: str = "raise",
    ) -> None:
        if not isinstance(precision, str) or precision not in _PRECISIONS:
            raise _precision_error(precision)
        if device is not None and device not in DEVICE_TYPES:
            raise OptionError(
                f"GraphampPrecision(device={device!r}): graphamp has autocast policies for {DEVICE_TYPES}. "
                f"Way out: Trainer(precision={precision!r}) without this plugin on {device!r}."
            )
        if scaler is not None and precision == "bf16-mixed":
            raise OptionError(
                "GraphampPrecision('bf16-mixed') got a GradScaler: bf16 needs no loss scaling, and Lightning's "
                "bf16-mixed uses none. Way out: drop scaler=, or use GraphampPrecision('16-mixed', scaler=...)."
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise OptionError(f"GraphampPrecision(scaler=...) must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if module is not None and not isinstance(module, str):
            raise OptionError(
                f"GraphampPrecision(module=...) is the qualified name of a submodule, such as 'model', got "
                f"{type(module).__name__}"
            )
        if config is not None and not isinstance(config, Config):
            raise OptionError(f"GraphampPrecision(config=...) must be a graphamp.Config, got {type(config).__name__}")
        if self_check not in _SELF_CHECKS:
            raise OptionError(f"GraphampPrecision(self_check={self_check!r}) is not one of {_SELF_CHECKS}")
        # MixedPrecision makes the 16-mixed scaler for its device; with device=None, connect() makes
        # it again once the model's device is known.
        super().__init__(precision, device or "cpu", scaler)
        self._device_given = device
        self._scaler_given = scaler is not None
        self.dtype = _PRECISIONS[precision]
        self.module_name = module
        self.config = dataclasses.replace(config or Config(), cache_enabled=False)
        self.self_check = self_check
        self._lightning_module: pl.LightningModule | None = None
        self._router: _Router | None = None

    @property
    def converted(self) -> dict[bool, nn.Module]:
        return self._router.converted if self._router is not None else {}

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple[nn.Module, list, list]:
        if not isinstance(model, pl.LightningModule):
            raise OptionError(
                f"GraphampPrecision runs on a single device (the strategy handed it a {type(model).__name__}, not "
                "the LightningModule). Way out: Trainer(precision='bf16-mixed') for this strategy, or "
                "graphamp.TrainStep, which converts the model and loss under DistributedDataParallel."
            )
        self._lightning_module = model
        target = self._find_target(model)
        device = self._device_given or model.device.type
        if device not in DEVICE_TYPES:
            raise OptionError(
                f"the LightningModule is on {device!r}, where graphamp has no autocast policy ({DEVICE_TYPES}). "
                f"Way out: Trainer(precision={self.precision!r}) without GraphampPrecision."
            )
        if self.precision == "16-mixed" and not self._scaler_given and device != self.device:
            self.scaler = torch.amp.GradScaler(device=device)
        self.device = device
        # A new fit/validate/...: this model, converted afresh.
        self._router = _Router(
            target, dtype=self.dtype, device=device, config=self.config, self_check=self.self_check,
            owner="GraphampPrecision", recipe=f"precision={self.precision!r}",
        )
        return super().connect(model, optimizers, lr_schedulers)

    def _find_target(self, model: pl.LightningModule) -> nn.Module:
        if not self.module_name:
            return model
        try:
            return model.get_submodule(self.module_name)
        except AttributeError:
            children = ", ".join(repr(n) for n, _ in model.named_children()) or "none"
            raise OptionError(
                f"GraphampPrecision(module={self.module_name!r}): {type(model).__name__} has no such submodule. "
                f"Way out: name the submodule training_step calls (its children: {children}), or module=None for "
                "the LightningModule's own forward."
            ) from None

    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        before = self._router.calls if self._router is not None else 0
        with super().train_step_context(), self._routed():
            yield
        if self._router is not None and True not in self.converted and self._router.calls == before:
            raise self._nothing_converted()

    @contextlib.contextmanager
    def val_step_context(self) -> Iterator[None]:
        with super().val_step_context(), self._routed():
            yield

    @contextlib.contextmanager
    def test_step_context(self) -> Iterator[None]:
        with super().test_step_context(), self._routed():
            yield

    @contextlib.contextmanager
    def predict_step_context(self) -> Iterator[None]:
        with super().predict_step_context(), self._routed():
            yield

    def _routed(self) -> contextlib.AbstractContextManager:
        # Not connected: a step run outside Trainer.fit/validate/test/predict.
        return self._router.routed() if self._router is not None else contextlib.nullcontext()

    def _nothing_converted(self) -> OptionError:
        model = self._lightning_module
        name = type(model).__name__ if model is not None else "the LightningModule"
        what = f"{name}.{self.module_name}" if self.module_name else f"{name}.forward (self(...))"
        children = ", ".join(repr(n) for n, _ in model.named_children()) if model is not None else ""
        return OptionError(
            f"GraphampPrecision converts {what}, but training_step did not call it: the step ran in eager "
            f"autocast and nothing was converted. Way out: GraphampPrecision(module=...) naming the submodule "
            f"training_step calls (children: {children or 'none'}), or call self(...) in training_step."
        )


def _normal_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_inference():
        return value.clone()
    return value


class GraphampFabricPrecision(FabricMixedPrecision):
    """Lightning Fabric's ``MixedPrecision`` with each module's forward converted by graphamp.

    ``Fabric(precision="bf16-mixed")`` casts a module's floating inputs to bf16, runs its forward
    under ``torch.autocast(device, dtype)`` (with the weight-cast cache, unlike the Trainer's plugin),
    and casts floating outputs back to fp32; the loss and backward run outside autocast. This plugin
    keeps all of that and runs each forward (of each module ``fabric.setup`` was given) as the
    :class:`~graphamp.AmpModule` converted at its first call, which converts itself again for
    another training mode or input structure, so outputs, gradients and
    parameters are bitwise those of ``Fabric(precision=...)``; ``"16-mixed"`` keeps Fabric's GradScaler.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"``.
        device: the autocast device, ``"cpu"`` or ``"cuda"``; None takes each module's at its first call.
        scaler: a ``torch.amp.GradScaler`` of your own for ``"16-mixed"``; None makes one.
        config: a :class:`graphamp.Config`; ``cache_enabled`` must stay True, as Fabric's autocast runs.
        self_check: as :func:`graphamp.convert`'s ("raise", "warn", "off").

    >>> from lightning_fabric import Fabric
    >>> fabric = Fabric(accelerator="cpu", plugins=[GraphampFabricPrecision("bf16-mixed")])
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    >>> model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
    >>> fabric.backward(loss)
    >>> opt.step()
    >>> assert list(fabric.strategy.precision.converted) == [True]
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        config: Config | None = None,
        self_check: str = "raise",
    ) -> None:
        owner = "GraphampFabricPrecision"
        if not isinstance(precision, str) or precision not in _PRECISIONS:
            raise _precision_error(precision, owner, "Fabric")
        if device is not None and device not in DEVICE_TYPES:
            raise OptionError(
                f"{owner}(device={device!r}): graphamp has autocast policies for {DEVICE_TYPES}. "
                f"Way out: Fabric(precision={precision!r}) without this plugin on {device!r}."
            )
        if scaler is not None and precision == "bf16-mixed":
            raise OptionError(
                f"{owner}('bf16-mixed') got a GradScaler: bf16 needs no loss scaling, and Fabric's bf16-mixed uses "
                f"none. Way out: drop scaler=, or use {owner}('16-mixed', scaler=...)."
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise OptionError(f"{owner}(scaler=...) must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if config is not None and not isinstance(config, Config):
            raise OptionError(f"{owner}(config=...) must be a graphamp.Config, got {type(config).__name__}")
        if config is not None and not config.cache_enabled:
            raise OptionError(
                f"{owner}(config=Config(cache_enabled=False)): Fabric's {precision} runs torch.autocast with its "
                "weight-cast cache, which the graph must reproduce. Way out: drop cache_enabled=False (the "
                "Trainer's GraphampPrecision runs without the cache, as Trainer(precision=...) does)."
            )
        if self_check not in _SELF_CHECKS:
            raise OptionError(f"{owner}(self_check={self_check!r}) is not one of {_SELF_CHECKS}")
        super().__init__(precision, device or "cpu", scaler)
        self._device_given = device
        self._scaler_given = scaler is not None
        self.dtype = _PRECISIONS[precision]
        self.config = config or Config()
        self.self_check = self_check
        self._modules: list[nn.Module] = []
        self._routers: dict[int, _Router] = {}

    @property
    def converted(self) -> dict[bool, nn.Module]:
        """The first module's conversions by training mode (True for ``train()``), once made."""
        router = self._routers.get(id(self._modules[0])) if self._modules else None
        return router.converted if router is not None else {}

    def convert_module(self, module: nn.Module) -> nn.Module:
        # fabric.setup hands each module here before the strategy wraps it: the module Fabric's
        # wrapper calls inside forward_context, whose forward is routed then. Not modified.
        if all(m is not module for m in self._modules):
            self._modules.append(module)
        return super().convert_module(module)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().forward_context())
            for module in self._modules:
                stack.enter_context(self._router_for(module).routed())
            yield

    def _router_for(self, module: nn.Module) -> _Router:
        router = self._routers.get(id(module))
        if router is None:
            device = self._device_given or next(
                (t.device.type for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()), "cpu"
            )
            if device not in DEVICE_TYPES:
                raise OptionError(
                    f"{type(module).__name__} is on {device!r}, where graphamp has no autocast policy "
                    f"({DEVICE_TYPES}). Way out: Fabric(precision={self.precision!r}) without GraphampFabricPrecision."
                )
            if self.precision == "16-mixed" and not self._scaler_given and device != self.device:
                self.scaler = torch.amp.GradScaler(device=device)
            self.device = device
            router = self._routers[id(module)] = _Router(
                module, dtype=self.dtype, device=device, config=self.config, self_check=self.self_check,
                owner="GraphampFabricPrecision", recipe=f"Fabric(precision={self.precision!r})",
            )
        return router
