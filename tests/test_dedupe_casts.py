"""dedupe_casts: share casts exactly where eager shares them or no gradient can tell."""

import pytest
import torch
from torch import nn

import graphamp
from graphamp.passes import dedupe_casts, insert_casts
from graphamp.runtime import autocast_cached
from graphamp.policy import get_policy
from helpers import spec_of, assert_exact, captured, casts

BF16 = get_policy("cpu", torch.bfloat16)


class Shared(nn.Module):
    """An activation with three low-precision consumers, and one weight used twice."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(4, 4))

    def forward(self, x):
        h = x.relu()
        out = self.q(h) + self.k(h) + self.v(h)
        tied = h @ self.q.weight  # q.weight's second low-precision use
        from_buffer = (self.table @ self.table) + (self.table @ self.table.t())
        return out, tied, from_buffer


def _rewritten():
    gm = captured(Shared(), (torch.randn(2, 4),))
    insert_casts(gm, spec_of(BF16))
    return gm


def _sources(gm):
    return sorted(n.args[0].name for n in casts(gm))


def test_shares_eager_cached_weight_casts_and_grad_free_casts_only():
    gm = _rewritten()
    before = _sources(gm)
    assert before.count("relu") == 4 and before.count("q_weight") == 2 and before.count("table") == 3
    assert dedupe_casts(gm, spec_of(BF16)).modified
    after = _sources(gm)
    assert after.count("relu") == 4  # may carry gradients: one cast per consumer, as eager
    assert after.count("q_weight") == 1  # eager's autocast cache shares a grad-requiring weight's cast
    assert after.count("table") == 1  # a buffer never carries a gradient
    assert not dedupe_casts(gm, spec_of(BF16)).modified  # idempotent


def test_no_grad_shares_everything():
    gm = _rewritten()
    dedupe_casts(gm, spec_of(BF16, inference=True))
    assert _sources(gm).count("relu") == 1


def test_exact_with_and_without_dedupe():
    model, x = Shared(), torch.randn(2, 4)
    assert_exact(model, graphamp.convert(model, (x,)), (x,), {}, torch.bfloat16)


class TwoViews(nn.Module):
    """A float input with two low-precision consumers (found by tests/test_fuzz.py)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) * self.b(x)


def _run(fn, model, kind):
    model.zero_grad(set_to_none=True)
    base = torch.linspace(-2, 3, 12).reshape(3, 4).requires_grad_(kind != "no_grad")
    x = base * 1.0 if kind == "non_leaf" else base
    out = fn(x)
    if base.requires_grad:
        out.float().sum().backward()
    return out, base.grad, [p.grad for p in model.parameters()]


def _autocast(model):
    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    return run


@pytest.mark.parametrize("kind", ["leaf", "non_leaf", "no_grad"])
def test_input_casts_are_shared_exactly_when_eager_caches_them(kind):
    # Eager's cast cache covers any float32 leaf that requires grad, inputs included: its
    # consumers then share one cast, and the input's gradient is summed in the low dtype.
    model = TwoViews()
    amp = graphamp.convert(model, (torch.randn(3, 4),))
    assert len(casts(amp)) == 1 and sum(n.target is autocast_cached for n in amp.graph.nodes) == 1
    assert not dedupe_casts(amp, spec_of(BF16)).modified  # idempotent, also over cache_weights' cached casts
    want, got = _run(_autocast(model), model, kind), _run(amp, model, kind)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None and want[1] is None) or torch.equal(got[1], want[1])
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got[2], want[2]))
