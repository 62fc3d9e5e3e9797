"""inline_regions: region higher-order ops and autocast markers become region-tagged nodes."""

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import graphamp
from graphamp.capture import capture
from graphamp.passes import inline_regions
from graphamp.node_info import AutocastFrame, GradFrame, region_of
from graphamp.spec import AmpSpec
from helpers import assert_exact

SPEC = AmpSpec("cpu", torch.bfloat16)


class Regions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = self.a(x)
            with torch.autocast("cpu", dtype=torch.float16):
                g = self.b(h)
        with torch.no_grad():
            k = self.c(x)
        return h, g, k


def _hops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)]


def test_export_regions_become_tagged_nodes():
    gm = capture(Regions(), (torch.randn(2, 4),), {}, device_type="cpu", dtype=torch.bfloat16)
    assert len(_hops(gm)) == 2  # one autocast region (with a nested one inside), one no_grad region
    result = inline_regions(gm, SPEC)
    assert result.modified and not _hops(gm)
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert region_of(linears[0]) == (AutocastFrame("cpu", torch.bfloat16, False),)
    assert region_of(linears[1]) == (AutocastFrame("cpu", torch.bfloat16, False), AutocastFrame("cpu", torch.float16, True))
    assert region_of(linears[2]) == (GradFrame(False),)
    assert not inline_regions(gm, SPEC).modified  # idempotent


def test_no_grad_region_keeps_its_semantics():
    model, x = Regions(), torch.randn(2, 4)
    amp = graphamp.convert(model, (x,))
    h, g, k = amp(x)
    assert h.requires_grad and g.requires_grad and not k.requires_grad
    assert torch.is_grad_enabled()
    with torch.no_grad():
        amp(x)
        assert not torch.is_grad_enabled()  # the region restores the caller's mode, not "True"
    assert_exact(model, amp, (x,), {}, torch.bfloat16)


def test_autocast_markers_from_make_fx():
    model = Regions()

    def f(x):
        return model(x)

    gm = make_fx(f, pre_dispatch=True)(torch.randn(2, 4))
    assert any(n.target is torch.amp.autocast_mode._enter_autocast for n in gm.graph.nodes)
    inline_regions(gm, SPEC)
    assert not any(n.target in (torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast) for n in gm.graph.nodes)
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert region_of(linears[0])[0] == AutocastFrame("cpu", None, False) or region_of(linears[0])[0].enabled is False


class WithCond(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))


def test_unknown_higher_order_op_is_refused():
    with pytest.raises(graphamp.CaptureError, match="higher-order op cond"):
        graphamp.convert(WithCond(), (torch.randn(2, 4),))
