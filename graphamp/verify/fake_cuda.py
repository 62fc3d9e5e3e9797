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

__all__ = ["PATCHES", "fake_cuda_bindings", "fake_cuda_inputs", "fake_cuda_model", "fake_cuda_session"]

aten = torch.ops.aten

_lock = threading.Lock()
_depth = 0  # open fake_cuda_bindings contexts, in all threads; guarded by _lock
_thread = threading.local()  # .depth: open contexts in this thread


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


def _routed(t: object) -> bool:
    """Whether a patched binding handles ``t`` itself: a fake CUDA tensor, in a thread with a session open."""
    return getattr(_thread, "depth", 0) > 0 and _on_fake_cuda(t)


def _contiguous(self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    if _routed(self):
        return aten.contiguous.default(self, memory_format=memory_format)
    return _originals["contiguous"](self, memory_format=memory_format)


def _copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if _routed(self):
        return aten.copy_.default(self, src, non_blocking)
    return _originals["copy_"](self, src, non_blocking)


def _invert(self: torch.Tensor) -> torch.Tensor:
    if _routed(self):
        return aten.bitwise_not.default(self)
    return _originals["__invert__"](self)


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if _routed(self):
        rest = dict(kwargs)
        copy_flag = rest.pop("copy", False)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **rest)
        if device is not None and device.type == "cuda":
            return aten.to.dtype(self, dtype or self.dtype, non_blocking, copy_flag, memory_format)
    return _originals["to"](self, *args, **kwargs)


def _getitem(self: torch.Tensor, index: Any) -> torch.Tensor:
    if _routed(self):
        out = _index(self, index)
        if out is not None:
            return out
    return _originals["__getitem__"](self, index)


def _setitem(self: torch.Tensor, index: Any, value: Any) -> None:
    items = index if isinstance(index, tuple) else (index,)
    if _routed(self) and not any(isinstance(i, torch.Tensor) for i in items):
        view = _index(self, index)
        if view is not None:
            if isinstance(value, torch.Tensor):
                aten.copy_.default(view, value)
            else:
                aten.fill_.Scalar(view, value)
            return
    _originals["__setitem__"](self, index, value)


# Every attribute this module sets on FakeTensor, with its replacement. Nothing else is patched;
# tests/test_fake_cuda.py derives its checks from this table.
PATCHES: dict[str, Any] = {
    "contiguous": _contiguous,
    "copy_": _copy_,
    "__invert__": _invert,
    "to": _to,
    "__getitem__": _getitem,
    "__setitem__": _setitem,
}

_ABSENT = object()
# What the patched bindings delegate to, and what FakeTensor's own ``__dict__`` held for each
# name (``_ABSENT`` when the binding was inherited from TensorBase), taken on the first entry.
_originals: dict[str, Any] = {}
_own: dict[str, Any] = {}


def _apply() -> None:
    _originals.clear()
    _own.clear()
    for name in PATCHES:
        _originals[name] = getattr(FakeTensor, name)
        _own[name] = vars(FakeTensor).get(name, _ABSENT)
    try:
        for name, fn in PATCHES.items():
            setattr(FakeTensor, name, fn)
    except BaseException:
        _restore()
        raise


def _restore() -> None:
    for name, own in _own.items():
        if own is not _ABSENT:
            setattr(FakeTensor, name, own)
        elif name in vars(FakeTensor):
            delattr(FakeTensor, name)


@contextlib.contextmanager
def fake_cuda_bindings() -> Iterator[None]:
    """Route the Tensor bindings that open a CUDA device guard to ATen ops, on fake CUDA tensors only.

    The patch sits on ``FakeTensor`` (real tensors are untouched) for exactly as long as some
    ``fake_cuda_bindings`` context is open in some thread: the first entry sets the attributes
    in :data:`PATCHES`, the last exit puts back the originals, also when the body raises. Calls
    nest and may overlap across threads (a lock guards a global count). The class attributes are
    shared by all threads, so while a session is open anywhere, other threads see the patched
    functions too; those behave as the originals except in a thread that has a context open
    itself (a per-thread count), so a thread outside any session observes torch's own behaviour.

    >>> from torch._subclasses.fake_tensor import FakeTensor
    >>> before = FakeTensor.contiguous
    >>> with fake_cuda_bindings():
    ...     assert FakeTensor.contiguous is PATCHES["contiguous"]
    >>> assert FakeTensor.contiguous is before
    """
    global _depth
    with _lock:
        if _depth == 0:
            _apply()
        _depth += 1
    try:
        _thread.depth = getattr(_thread, "depth", 0) + 1
        try:
            yield
        finally:
            _thread.depth -= 1
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _restore()


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
