"""``graphamp.convert``: capture, rewrite into explicit mixed precision, emit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphamp.capture import ambient_autocast, capture
from graphamp.config import Config
from graphamp.emit import AmpModule, emit
from graphamp.errors import DeviceMismatchError
from graphamp.passes import run_pipeline
from graphamp.passes.follow_eager_attention import EAGER_SDPA, SDPA, repeated_heads
from graphamp.probe import eager_sdpa_calls
from graphamp.policy import DEVICE_TYPES, LOW_DTYPES, Policy, get_policy

__all__ = ["convert", "MODES", "resolve_dtype", "resolve_device_type"]

MODES = ("exact",)

_DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, device_type: str) -> torch.dtype:
    """The lower-precision dtype to use; None means autocast's default for ``device_type``."""
    if dtype is None:
        return torch.get_autocast_dtype(device_type)
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPE_ALIASES:
            raise ValueError(f"dtype={dtype!r} is not a lower-precision float; use torch.bfloat16 ('bf16') or torch.float16 ('fp16')")
        return _DTYPE_ALIASES[dtype.removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {type(dtype).__name__}")
    if dtype not in LOW_DTYPES:
        kind = "a floating" if dtype.is_floating_point else "not a floating"
        raise ValueError(
            f"dtype={dtype} is {kind} dtype autocast can lower to; use torch.bfloat16 or torch.float16"
        )
    return dtype


def resolve_device_type(device_type: str | torch.device | None, model: nn.Module, inputs: Any) -> str:
    """The autocast device; None means the device of the model's parameters, else of the inputs."""
    if device_type is None:
        tensors = [*model.parameters(), *model.buffers(), *(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
        device_type = next((t.device.type for t in tensors if t.is_floating_point()), tensors[0].device.type if tensors else "cpu")
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
    tensors = [*model.parameters(), *model.buffers(), *(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
    floating = [t for t in tensors if t.is_floating_point()]
    if floating and not any(t.device.type == device_type for t in floating):
        found = sorted({t.device.type for t in floating})
        raise DeviceMismatchError(
            f"device_type={device_type!r} asks for the {device_type} autocast policy, but the model's parameters "
            f"and inputs are on {', '.join(found)}, where {device_type} autocast casts nothing: the result "
            f"would run entirely in fp32. Way out: move the model and inputs to {device_type} "
            f"(model.to({device_type!r})); or, to check the {device_type} policy without that device, use "
            f"graphamp.verify(model, args, device_type={device_type!r}); or pass device_type={found[0]!r}."
        )


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    # The passes re-derive dtypes on fake tensors; an ambient autocast must not apply to them.
    with contextlib.ExitStack() as stack:
        for device_type in DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(ambient_autocast(device_type, torch.get_autocast_dtype(device_type), enabled=False))
        yield


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
) -> AmpModule:
    """Rewrite ``model`` into explicit mixed precision, equal to running it under ``torch.autocast``.

    Args:
        model: the module to convert; it is not modified.
        args, kwargs: example inputs, as for ``torch.export.export``. Batch and sequence sizes of
            later calls may differ.
        dtype: ``torch.bfloat16`` or ``torch.float16``; None takes autocast's default for the device.
        device_type: "cpu" or "cuda"; None takes the device of the model's parameters.
        mode: "exact" reproduces eager autocast bit for bit.
        config: a :class:`graphamp.Config` with op overrides and modules kept in fp32.
        inference: deployment mode: no gradient path is kept (calls run under ``no_grad``),
            casts are shared freely, and weights used only in low precision are cast once, now,
            and held in low precision only. Outputs stay bitwise equal to eager autocast.

    Returns:
        An :class:`AmpModule`: a GraphModule with the casts in its code, sharing the model's
        parameters and buffers, with the model's input and output pytree.

    >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    >>> x = torch.randn(4, 8)
    >>> amp = convert(model, (x,), dtype=torch.bfloat16)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     expected = model(x)
    >>> assert torch.equal(amp(x), expected)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"graphamp.convert expects a torch.nn.Module, got {type(model).__name__}; wrap a function "
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
    if not isinstance(inference, bool):
        raise TypeError(f"inference must be True or False, got {type(inference).__name__}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; use one of {MODES}")
    if config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a graphamp.Config, got {type(config).__name__}")
    kwargs = dict(kwargs or {})
    device_type = resolve_device_type(device_type, model, (args, kwargs))
    check_device(device_type, model, (args, kwargs))
    dtype = resolve_dtype(dtype, device_type)
    policy: Policy = get_policy(device_type, dtype).with_overrides(config.op_overrides)

    with _autocast_off():
        gm = capture(model, tuple(args), kwargs, device_type=device_type, dtype=dtype)
        observe_eager(gm, model, tuple(args), kwargs, device_type=device_type, dtype=dtype)
        run_pipeline(gm, policy, config, check=mode == "exact" and config.is_default, inference=inference)
        return emit(gm, model, policy, mode, config, inference=inference, example=(tuple(args), kwargs))
