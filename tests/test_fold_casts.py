"""fold_casts: drop same-dtype casts and low->fp32->low round trips; never fp32->low->fp32."""

import torch
from torch import nn

import graphamp
from graphamp.passes import fold_casts, insert_casts
from graphamp.policy import get_policy
from helpers import spec_of, assert_exact, captured, casts

BF16 = get_policy("cpu", torch.bfloat16)
aten = torch.ops.aten


class RoundTrip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        low = self.a(x)
        up = low.float()  # user cast up...
        back = self.b(up)  # ...and autocast casts it back down: a bf16 -> fp32 -> bf16 round trip
        same = back.to(torch.bfloat16)  # a same-dtype .to(): returns its input
        kept = self.b(x.float())  # fp32 input: the cast down rounds and must stay
        return same, kept.float()


def _rewritten():
    gm = captured(RoundTrip(), (torch.randn(2, 4),))
    insert_casts(gm, spec_of(BF16))
    return gm


def test_folds_round_trips_and_same_dtype_casts():
    gm = _rewritten()
    to_nodes = [n for n in gm.graph.nodes if n.target is aten.to.dtype]
    assert len(to_nodes) == 4
    assert fold_casts(gm, spec_of(BF16)).modified
    b_linears = [n for n in gm.graph.nodes if n.target is aten.linear.default][1:]
    assert b_linears[0].args[0].name == "linear"  # fed straight from a's bf16 output
    assert b_linears[1].args[0].target is aten._to_copy.default  # fp32 -> bf16 kept
    remaining = [n for n in gm.graph.nodes if n.target is aten.to.dtype]
    assert [n.args[0] for n in remaining] == [b_linears[1]]  # only the real up-cast at the end
    assert not fold_casts(gm, spec_of(BF16)).modified


def test_never_folds_fp32_low_fp32():
    class Down(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16).float()

    gm = captured(Down(), (torch.randn(3),))
    insert_casts(gm, spec_of(BF16))
    assert not fold_casts(gm, spec_of(BF16)).modified


def test_branching_round_trip_is_kept_when_gradients_can_flow():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            up = self.a(x).float()
            return self.b(up), up.exp()  # up has two consumers: its grads sum in fp32 in eager

    model, x = Branch(), torch.randn(2, 4)
    gm = captured(model, (x,))
    insert_casts(gm, spec_of(BF16))
    n_before = len(casts(gm))
    fold_casts(gm, spec_of(BF16))
    assert len(casts(gm)) == n_before
    fold_casts(gm, spec_of(BF16, inference=True))
    assert len(casts(gm)) == n_before - 1
    assert_exact(model, graphamp.convert(model, (x,)), (x,), {}, torch.bfloat16)


def test_exact_end_to_end():
    model, x = RoundTrip(), torch.randn(2, 4)
    assert_exact(model, graphamp.convert(model, (x,)), (x,), {}, torch.bfloat16)
