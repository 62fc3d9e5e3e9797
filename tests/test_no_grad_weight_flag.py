"""Under no_grad, eager autocast's cached weight cast still requires grad, and matmul reads it.

matmul folds a non-contiguous 3-D input into one mm (a copy, then mm) when the weight operand
requires grad, and runs bmm otherwise; in fp16 the two round differently. Found by the census on
diffusers' AutoencoderKL and UNet2D and timm's xcit and levit (attention over a transposed,
group-normed feature map), which were bitwise with grad and differed silently under no_grad.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphamp
from helpers import TransposedProjection


def _x() -> torch.Tensor:
    return torch.randn(2, 64, 16, 16, generator=torch.Generator().manual_seed(0))


def _eager_no_grad(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return model(x)


def test_eager_cached_cast_requires_grad_under_no_grad() -> None:
    # The fact the fix rests on, asked of the installed torch: the weight operand reaching matmul
    # under no_grad requires grad when autocast's cache made it, and not without the cache.
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
                seen.append((func, args[1].requires_grad))
            return func(*args, **(kwargs or {}))

    lin, x = nn.Linear(4, 4), torch.randn(2, 3, 4).transpose(0, 1)
    for cache in (True, False):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache), Spy():
            lin(x)
    assert seen == [(torch.ops.aten.mm.default, True), (torch.ops.aten.bmm.default, False)]


@pytest.mark.parametrize("inference", [False, True], ids=["exact", "inference"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_no_grad_calls_match_eager_no_grad(dtype: torch.dtype, inference: bool) -> None:
    model, x = TransposedProjection().eval(), _x()
    amp = graphamp.convert(model, (x,), dtype=dtype, inference=inference)
    ref = _eager_no_grad(model, x, dtype)
    with torch.no_grad():
        out = amp(x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    with torch.no_grad():  # and again, from the weight cache
        assert torch.equal(amp(x), ref)


def test_frozen_weight_flag_follows_the_parameter() -> None:
    model = TransposedProjection().eval()
    model.proj.weight.requires_grad_(False)
    amp = graphamp.convert(model, (_x(),), dtype=torch.float16, inference=True)
    with torch.no_grad():
        assert torch.equal(amp(_x()), _eager_no_grad(model, _x(), torch.float16))
