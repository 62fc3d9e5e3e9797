"""Peak tensor memory of one call, tracked per op output by a dispatch mode (the bench's peak MiB)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes", "peak_mib"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors created under the mode and still alive (views count with their base)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None and not _is_input(t, args, kwargs):
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


def _is_input(t: torch.Tensor, args: Any, kwargs: Any) -> bool:
    # In-place ops and aliases return one of their inputs: not a new allocation.
    return any(t is a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))


def peak_mib(fn: Callable[[], Any]) -> float | None:
    gc.collect()
    mode = LiveBytes()
    with mode:
        out = fn()
    del out
    return mode.peak / 2**20
