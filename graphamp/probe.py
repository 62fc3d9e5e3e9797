"""Observe eager autocast on the example inputs, for choices the traced graph cannot see.

Model code may branch on whether it is being traced (``torch.compiler.is_compiling()``, a
``FakeTensor`` check) and then run another, forward-equivalent program. The traced graph holds
the traced program; where the two differ in gradient rounding, graphamp needs to know what eager
did. The probe runs the model once, eagerly, under the same autocast, on the real example, and
records only what the passes ask for. The model's buffers and the random state are restored
afterwards, so the probe leaves no trace on the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from graphamp.eager import state_restored
from graphamp.spec import ambient_autocast

__all__ = ["SdpaCall", "eager_sdpa_calls"]


class SdpaCall(NamedTuple):
    """One eager call of ``F.scaled_dot_product_attention``: whether key/value heads were grouped,
    whether it passed a mask, and ``is_causal``."""

    enable_gqa: bool
    kv_heads: int
    masked: bool = False
    is_causal: bool = False


class _RecordSdpa(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[SdpaCall] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            key = args[1] if len(args) > 1 else kwargs["key"]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            is_causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            heads = int(key.shape[-3]) if key.dim() >= 3 else 1
            self.calls.append(SdpaCall(bool(kwargs.get("enable_gqa", False)), heads, mask is not None, bool(is_causal)))
        return func(*args, **kwargs)


def eager_sdpa_calls(model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype) -> list[SdpaCall] | None:
    """The model's SDPA calls under eager autocast on this example, in order; None if it fails.

    Runs without grad (the attention path does not depend on it, and no activations are kept).

    >>> class Attn(nn.Module):
    ...     def forward(self, q, k, v):
    ...         return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    >>> q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    >>> assert eager_sdpa_calls(Attn(), (q, kv, kv), {}, device_type="cpu", dtype=torch.bfloat16) == [SdpaCall(True, 2)]
    """
    recorder = _RecordSdpa()
    try:
        with state_restored(model), torch.no_grad(), ambient_autocast(device_type, dtype), recorder:
            model(*args, **kwargs)
    except Exception:
        # The probe is advisory: a model that cannot run here keeps its traced attention.
        return None
    return recorder.calls


@contextlib.contextmanager
def attribute_bound(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.<name>`` is ``value`` for the duration, as an instance attribute (it shadows the class's:
    a module's ``forward``, an optimizer's ``step``); an instance attribute there before comes back."""
    previous = obj.__dict__.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if previous is None:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)
