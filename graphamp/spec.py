"""What a conversion is asked for, resolved and validated once: the spec every frontend hands on.

``convert``, ``verify``, ``TrainStep`` and the ``torch.compile`` backend all resolve their
arguments here into one frozen :class:`AmpSpec`; the capture, the pass pipeline and emit read only
the spec. A new mode or option is therefore added here, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphamp.config import Config
from graphamp.errors import DeviceMismatchError
from graphamp.policy import DEVICE_TYPES, Policy, get_policy, resolve_dtype
from graphamp.runtime import AutocastState, autocast_state

__all__ = [
    "AmpSpec",
    "ambient_autocast",
    "MODES",
    "TARGETS",
    "autocast_off",
    "check_device",
    "infer_device_type",
    "resolve_device_type",
]

MODES = ("exact", "autotune", "budget")
TARGETS = ("module", "aot", "export")

# The one table of dtype spellings every frontend and the CLI accept.


def _tensors(model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), *(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]


def infer_device_type(model: nn.Module, inputs: Any) -> str:
    """The device of the model's floating parameters and buffers, else of its inputs ("cpu" if none)."""
    tensors = _tensors(model, inputs)
    return next((t.device.type for t in tensors if t.is_floating_point()), tensors[0].device.type if tensors else "cpu")


def resolve_device_type(device_type: str | torch.device | None, model: nn.Module, inputs: Any) -> str:
    """The autocast device; None means the device of the model's parameters, else of the inputs."""
    if device_type is None:
        device_type = infer_device_type(model, inputs)
        if device_type not in DEVICE_TYPES:
            raise ValueError(
                f"the model's tensors are on {device_type!r}, which has no graphamp policy; pass "
                f"device_type= one of {DEVICE_TYPES}"
            )
        return device_type
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a string such as 'cpu' or 'cuda', got {type(device_type).__name__}")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={device_type!r} is not supported; graphamp has policies for {DEVICE_TYPES}")
    return device_type


def check_device(device_type: str, model: nn.Module, inputs: Any) -> None:
    """Raise DeviceMismatchError if no floating tensor of the model or its inputs is on ``device_type``:
    autocast leaves tensors on other devices alone, so the conversion would cast nothing."""
    floating = [t for t in _tensors(model, inputs) if t.is_floating_point()]
    if floating and not any(t.device.type == device_type for t in floating):
        found = sorted({t.device.type for t in floating})
        raise DeviceMismatchError(
            f"device_type={device_type!r} asks for the {device_type} autocast policy, but the model's parameters "
            f"and inputs are on {', '.join(found)}, where {device_type} autocast casts nothing: the result "
            f"would run entirely in fp32. Way out: move the model and inputs to {device_type} "
            f"(model.to({device_type!r})); or, to check the {device_type} policy without that device, use "
            f"graphamp.verify(model, args, device_type={device_type!r}); or pass device_type={found[0]!r}."
        )


def check_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"mode={mode!r} is not supported; use one of {MODES} ('exact' reproduces eager autocast, "
            "'autotune' keeps the faster of low precision and fp32 per op, 'budget' also lowers ops autocast keeps "
            "in fp32 where the program gets faster within an error budget)"
        )
    return mode


def check_config(config: object) -> Config:
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a graphamp.Config, got {type(config).__name__}")
    return config


@dataclasses.dataclass(frozen=True)
class AmpSpec:
    """One conversion's request, resolved: every field is valid and nothing is left to infer.

    >>> spec = AmpSpec.resolve(nn.Linear(2, 2), (), dtype="fp16")
    >>> assert (spec.device_type, spec.dtype, spec.mode, spec.check) == ("cpu", torch.float16, "exact", True)
    """

    # "cpu" or "cuda": the autocast policy's device.
    device_type: str
    # torch.bfloat16 or torch.float16: the lower-precision dtype.
    dtype: torch.dtype
    # "exact" reproduces eager autocast bit for bit; "autotune" raises to fp32 the low-precision ops
    # that measure faster in fp32 on this machine (never lowers precision against autocast).
    mode: str = "exact"
    # Deployment: no gradient path is kept, casts are shared freely, weights are frozen low.
    inference: bool = False
    # Op overrides and modules kept in fp32.
    config: Config = dataclasses.field(default_factory=Config)
    # What the graph becomes: "module", an AmpModule run as it is (weight cache, frozen weights,
    # kernel paths eager takes); "aot", a graph handed to AOTAutograd by the torch.compile backend;
    # "export", a graph for torch.export (graphamp.export): frozen weights, no graphamp call in it.
    target: str = "module"
    # Floating inputs are taken in fp32 and low-precision floating outputs returned in fp32.
    keep_io_types: bool = False
    # An exact module's graph for calls without grad (AmpModule converts it on the first such call
    # where eager's program differs, e.g. nn.TransformerEncoderLayer's fused kernel): eager's
    # no_grad kernels as inference=True takes them, but weights are not frozen.
    no_grad: bool = False
    # How the graph is captured: "export" (torch.export, symbolic sizes), or "values" (the model run
    # on the example's values, eager's own program, guarded; graphamp.capture.values), which convert
    # takes where export's program is not eager's.
    capture: str = "export"

    @classmethod
    def resolve(
        cls,
        model: nn.Module,
        inputs: Any,
        *,
        dtype: torch.dtype | str | None = None,
        device_type: str | torch.device | None = None,
        mode: str = "exact",
        inference: bool = False,
        config: Config | None = None,
        check_devices: bool = True,
        keep_io_types: bool = False,
        target: str = "module",
    ) -> AmpSpec:
        """Validate the arguments every frontend shares, with the errors they document."""
        if not isinstance(inference, bool):
            raise TypeError(f"inference must be True or False, got {type(inference).__name__}")
        if not isinstance(keep_io_types, bool):
            raise TypeError(
                f"keep_io_types must be True or False, got {type(keep_io_types).__name__}; True takes floating "
                "inputs in fp32 and returns low-precision floating outputs in fp32"
            )
        if target not in TARGETS:
            raise ValueError(f"target={target!r} is not one of {TARGETS}")
        mode = check_mode(mode)
        config = check_config(config)
        wanted = {"AutotunePlan": "autotune", "BudgetPlan": "budget"}.get(type(config.plan).__name__)
        if wanted is not None and mode != wanted:
            raise ValueError(
                f"Config(plan=...) replays {'an autotune' if wanted == 'autotune' else 'a budget'} plan, but mode={mode!r}; "
                f"pass mode={wanted!r} with it, or drop the plan for an exact conversion"
            )
        if config.error_budget is not None and mode != "budget":
            raise ValueError(
                f"Config(error_budget=...) bounds mode='budget', but mode={mode!r}; pass mode='budget' with it"
            )
        device = resolve_device_type(device_type, model, inputs)
        if check_devices:
            check_device(device, model, inputs)
        dtype = resolve_dtype(dtype, device)
        if wanted == "budget":  # an autotune plan is checked against the ops it decides, in its pass
            config.plan.check(device, dtype)
        return cls(device, dtype, mode, inference, config, target, keep_io_types)

    @property
    def policy(self) -> Policy:
        """The built-in autocast policy for the device and dtype, with the config's overrides."""
        return get_policy(self.device_type, self.dtype).with_overrides(self.config.all_overrides)

    @property
    def check(self) -> bool:
        """Whether every node's dtype is checked against eager's: exact mode, built-in policy."""
        return self.mode == "exact" and self.config.keeps_policy

    @property
    def cache_enabled(self) -> bool:
        """As ``torch.autocast(cache_enabled=...)``: whether a weight's cast is shared by its uses
        in one forward (``Config.cache_enabled``)."""
        return self.config.cache_enabled


def ambient_autocast(
    device_type: str, dtype: torch.dtype, enabled: bool = True, *, cache_enabled: bool = True
) -> contextlib.AbstractContextManager:
    """Set the autocast state of ``device_type`` the way ``torch.autocast`` does, and restore it.

    ``torch.autocast("cuda")`` disables itself on a CPU-only build; the low-level switches still
    work over fake CUDA tensors, which is how the CUDA policy is exercised without a GPU.

    >>> with ambient_autocast("cpu", torch.float16):
    ...     assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.float16
    """
    return autocast_state([AutocastState(device_type, enabled, dtype)], cache_enabled)


@contextlib.contextmanager
def autocast_off(device_types: tuple[str, ...] = DEVICE_TYPES) -> Iterator[None]:
    """Switch off any ambient autocast on ``device_types`` for the duration, then restore it.

    Converted graphs carry their casts; an enclosing ``torch.autocast`` must not apply a policy
    twice, and conversion itself re-derives dtypes on fake tensors that autocast must not touch.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off():
    ...     assert not torch.is_autocast_enabled("cpu")
    """
    with contextlib.ExitStack() as stack:
        for device_type in device_types:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(ambient_autocast(device_type, torch.get_autocast_dtype(device_type), enabled=False))
        yield
