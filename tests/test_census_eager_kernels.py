"""Fake kernels stricter than the CPU kernel (issue 17's census, LaraMini): torch's meta kernel of
``aten._grouped_mm`` refuses fp32, which the CPU kernel (and so eager) runs; graphamp widens it
while it traces, so the eager program is captured instead of the model's compile path."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp.capture.kernels import eager_kernel_metas
from helpers import assert_exact

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")


class GroupedExperts(nn.Module):
    """transformers' grouped_mm experts: the tokens in fp32 (a float router) through 3D expert weights."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x, offs):
        h = self.proj(x)
        return F.grouped_mm(h.float(), self.w.transpose(-2, -1), offs=offs)


def _fake_grouped_mm(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, w = torch.empty(8, 16, dtype=dtype), torch.empty(2, 16, 16, dtype=dtype).transpose(-2, -1)
        return torch._grouped_mm(a, w, offs=torch.tensor([3, 8], dtype=torch.int32))


def test_fp32_grouped_mm_on_cpu_is_captured_as_eager_runs_it_and_exact():
    torch.manual_seed(0)
    model, x, offs = GroupedExperts(), torch.randn(8, 16), torch.tensor([3, 8], dtype=torch.int32)
    amp = graphamp.convert(model, (x, offs))
    assert not isinstance(amp, graphamp.DynamoAmpModule)
    assert_exact(model, amp, (x, offs), {}, torch.bfloat16)


def test_the_widened_fake_kernel_takes_the_cpu_dtypes_only_while_graphamp_traces():
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatcher, checks = torch._C._dispatch_dump("aten::_grouped_mm"), list(fake_impls.op_implementations_checks)
    with pytest.raises(RuntimeError, match="BF16"):
        _fake_grouped_mm(torch.float32)
    with eager_kernel_metas():
        out = _fake_grouped_mm(torch.float32)
        assert out.dtype == torch.float32 and out.shape == (8, 16)
        assert _fake_grouped_mm(torch.float16).dtype == torch.float16
        with pytest.raises(RuntimeError, match="BF16"):
            _fake_grouped_mm(torch.float64)  # the CPU kernel refuses fp64 too
    with pytest.raises(RuntimeError, match="BF16"):  # torch's own kernel again
        _fake_grouped_mm(torch.float32)
    # Nothing is left behind: no kernel registered with the dispatcher, the fake-kernel table as it
    # was, and no fake result of the widened kernel in FakeTensorMode's cache.
    assert torch._C._dispatch_dump("aten::_grouped_mm") == dispatcher
    assert fake_impls.op_implementations_checks == checks
    assert not [k for k in FakeTensorMode.cache if getattr(k, "key", None) and k.key[0] is torch.ops.aten._grouped_mm.default]


@pytest.mark.parametrize("inference", [False, True], ids=["training", "inference"])
def test_fp32_grouped_mm_compiles_too(inference):
    """compile=True: dynamo traces the converted graph with the same widened fake kernel, so an MoE
    model's experts compile instead of falling back to the uncompiled module (Mixtral did)."""
    import warnings

    torch.manual_seed(0)
    model, x, offs = GroupedExperts(), torch.randn(8, 16), torch.tensor([3, 8], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.CompileFallbackWarning)
        cm = graphamp.convert(model, (x, offs), inference=inference, compile=True)
        out = cm(x, offs)
        if not inference:
            out.sum().backward()
    assert cm.runs_compiled and not cm.__dict__.get("_refused_shapes")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, offs)
    assert out.dtype == want.dtype
    torch.testing.assert_close(out.detach(), want.detach(), rtol=0.02, atol=0.02)
    assert not inference or model.proj.weight.grad is None
    assert inference or model.w.grad is not None
    # Outside the compiled call, torch's own fake kernel again.
    with pytest.raises(RuntimeError, match="BF16"):
        _fake_grouped_mm(torch.float32)
