"""Run models on fake CUDA tensors on a machine without a GPU, to exercise the CUDA policy.

Fake CUDA tensors carry CUDA metadata with no data, and the dispatcher's autocast switches work
over them (``graphamp.capture.ambient_autocast``), so eager CUDA autocast's decisions and
graphamp's CUDA conversion can both be observed on a CPU-only build. Two things need help:

* a few Python bindings of ``Tensor`` (``__getitem__``, ``contiguous``, ``copy_``, ``to``,
  ``__invert__``...) open a CUDA device guard before they dispatch, and a CPU-only build has no
  CUDA guard ("PyTorch is not linked with support for cuda devices"). :func:`fake_cuda_bindings`
  routes those calls on fake CUDA tensors to the ATen ops they call on a GPU;
* autograd over fake CUDA tensors aborts the process, so copies never require grad and
  :func:`fake_cuda_session` runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["fake_cuda_bindings", "fake_cuda_inputs", "fake_cuda_model", "fake_cuda_session"]

aten = torch.ops.aten

_lock = threading.Lock()
_depth = 0


def _on_fake_cuda(t: object) -> bool:
    return isinstance(t, FakeTensor) and t.device.type == "cuda"


def _index(x: torch.Tensor, index: Any) -> torch.Tensor | None:
    """``x[index]`` through ATen ops, as ``applySlicing`` does; None for forms it does not cover."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (list, bool)) or (isinstance(i, torch.Tensor) and i.dtype is torch.bool and i.dim() != 1) for i in items):
        return None
    used = sum(0 if i is None or i is Ellipsis else 1 for i in items)
    out, dim, advanced = x, 0, []
    for i in items:
        if i is Ellipsis:
            advanced += [None] * (x.dim() - used)
            dim += x.dim() - used
        elif i is None:
            out = aten.unsqueeze.default(out, dim)
            advanced.append(None)
            dim += 1
        elif isinstance(i, slice):
            if (i.start, i.stop, i.step) != (None, None, None):
                out = aten.slice.Tensor(out, dim, i.start, i.stop, 1 if i.step is None else i.step)
            advanced.append(None)
            dim += 1
        elif isinstance(i, torch.Tensor):
            advanced.append(i)
            dim += 1
        elif isinstance(i, (int, torch.SymInt)):
            out = aten.select.int(out, dim, i)
        else:
            return None
    if any(a is not None for a in advanced):
        while advanced[-1] is None:
            advanced.pop()
        return aten.index.Tensor(out, advanced)
    return aten.alias.default(out) if out is x else out


def _patched(originals: dict[str, Any]) -> dict[str, Any]:
    def contiguous(self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        if _on_fake_cuda(self):
            return aten.contiguous.default(self, memory_format=memory_format)
        return originals["contiguous"](self, memory_format=memory_format)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if _on_fake_cuda(self):
            return aten.copy_.default(self, src, non_blocking)
        return originals["copy_"](self, src, non_blocking)

    def invert(self: torch.Tensor) -> torch.Tensor:
        if _on_fake_cuda(self):
            return aten.bitwise_not.default(self)
        return originals["__invert__"](self)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _on_fake_cuda(self):
            rest = dict(kwargs)
            copy_flag = rest.pop("copy", False)
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **rest)
            if device is not None and device.type == "cuda":
                return aten.to.dtype(self, dtype or self.dtype, non_blocking, copy_flag, memory_format)
        return originals["to"](self, *args, **kwargs)

    def getitem(self: torch.Tensor, index: Any) -> torch.Tensor:
        if _on_fake_cuda(self):
            out = _index(self, index)
            if out is not None:
                return out
        return originals["__getitem__"](self, index)

    def setitem(self: torch.Tensor, index: Any, value: Any) -> None:
        items = index if isinstance(index, tuple) else (index,)
        if _on_fake_cuda(self) and not any(isinstance(i, torch.Tensor) for i in items):
            view = _index(self, index)
            if view is not None:
                if isinstance(value, torch.Tensor):
                    aten.copy_.default(view, value)
                else:
                    aten.fill_.Scalar(view, value)
                return
        originals["__setitem__"](self, index, value)

    return {"contiguous": contiguous, "copy_": copy_, "__invert__": invert, "to": to,
            "__getitem__": getitem, "__setitem__": setitem}


@contextlib.contextmanager
def fake_cuda_bindings() -> Iterator[None]:
    """Route the Tensor bindings that open a CUDA device guard to ATen ops, on fake CUDA tensors only.

    The patch sits on ``FakeTensor`` (real tensors are untouched), nests, and is undone on exit.
    """
    global _depth
    with _lock:
        if _depth == 0:
            originals = {name: getattr(FakeTensor, name) for name in ("contiguous", "copy_", "__invert__", "to", "__getitem__", "__setitem__")}
            for name, fn in _patched(originals).items():
                setattr(FakeTensor, name, fn)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name in ("contiguous", "copy_", "__invert__", "to", "__getitem__", "__setitem__"):
                    delattr(FakeTensor, name)


def fake_cuda_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake CUDA tensors that never require grad.

    Call inside a ``FakeTensorMode``. The model's own tensors are not copied (no memory is used
    for them), and the model is not modified.
    """
    memo: dict[int, Any] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) in memo:
            continue
        fake = torch.empty_like(t, device="cuda")
        memo[id(t)] = nn.Parameter(fake, requires_grad=False) if isinstance(t, nn.Parameter) else fake
    # Tensors that are plain attributes (neither parameter nor buffer) would be copied for real
    # inside the fake mode, which torch refuses; deepcopy them outside it, with the memo above.
    with _disable_current_modes():
        return copy.deepcopy(model, memo)


def fake_cuda_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fake CUDA tensors with the dtypes and shapes of the tensors in ``args``/``kwargs``."""

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="cuda", requires_grad=False)

    return pytree.tree_map_only(torch.Tensor, fake, (tuple(args), dict(kwargs)))


@contextlib.contextmanager
def fake_cuda_session() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode with the bindings patched and grad off: the setting for fake CUDA runs.

    >>> with fake_cuda_session():
    ...     model = fake_cuda_model(nn.Linear(4, 4))
    ...     (x,), _ = fake_cuda_inputs((torch.randn(2, 4),), {})
    ...     y = model(x[:, :4].contiguous())
    >>> assert y.device.type == "cuda" and tuple(y.shape) == (2, 4)
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, fake_cuda_bindings(), torch.no_grad():
        yield mode
