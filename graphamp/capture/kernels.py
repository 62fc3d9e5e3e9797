"""Fake (meta) kernels that refuse what the device's eager kernel runs, widened while graphamp traces.

torch's meta kernel for ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``) copies the CUDA
kernel's checks and refuses anything but bf16 inputs, while the CPU kernel multiplies fp32, fp16 and
bf16. transformers' MoE experts call it in fp32 on CPU (autocast does not cast it): eager runs, every
trace of that eager program fails, and graphamp would have to trace the model's compile path instead,
another program (LaraMini's gated delta rule solves its triangular system another way there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["eager_kernel_metas"]

# What the CPU kernel of aten._grouped_mm takes besides bf16 (it refuses fp64).
_CPU_GROUPED_MM_DTYPES = (torch.float32, torch.float16)


def _widened_grouped_mm(fake_mode: Any, func: Any, mat_a: Any, mat_b: Any, *args: Any, **kwargs: Any) -> Any:
    """FakeTensorMode's implementation of aten._grouped_mm on CPU fp32/fp16 operands: the output of
    bf16 operands of the same layout (torch's checks of shapes and strides), in their dtype."""
    dtype = mat_a.dtype
    if not (mat_a.device.type == mat_b.device.type == "cpu" and mat_b.dtype == dtype and dtype in _CPU_GROUPED_MM_DTYPES):
        return NotImplemented
    low = [t.new_empty_strided(t.shape, t.stride(), dtype=torch.bfloat16) for t in (mat_a, mat_b)]
    out = func(*low, *args, **kwargs)
    out_dtype = kwargs.get("out_dtype", args[2] if len(args) > 2 else None)
    return out if out_dtype is not None else out.new_empty_strided(out.shape, out.stride(), dtype=dtype)


@contextlib.contextmanager
def eager_kernel_metas() -> Iterator[None]:
    """While tracing, fake kernels accept what the eager CPU kernels accept (see the module doc)."""
    from torch._subclasses import fake_impls

    op = torch.ops.aten._grouped_mm.default
    entry = (lambda func: func is op, _widened_grouped_mm)
    # FakeTensorMode asks these before it runs an op's meta kernel (by either dispatch route).
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
        _forget_fake_results(op)


def _forget_fake_results(op: Any) -> None:
    """Drop ``op``'s entries from FakeTensorMode's process-wide cache, which would otherwise answer
    later calls with what the widened implementation gave."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = FakeTensorMode.cache
    for key in [k for k in cache if getattr(k, "key", None) and k.key[0] is op]:
        del cache[key]
