"""Constructed cases for each eligibility rule and region kind, exact against eager autocast."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from helpers import assert_exact, assert_same_grads, assert_same_outputs, matmul_function, run_converted, run_eager

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


class NestedRegions(nn.Module):
    """autocast(enabled=False) inside, a custom-dtype region, and a region for another device."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            fp32 = self.b(h.float())  # fp32: the region switches autocast off
            still_low = h @ h.transpose(-1, -2)  # no cast back: stays in h's dtype
        with torch.autocast("cpu", dtype=torch.float16):
            half = self.c(x)
        with torch.autocast("cuda", enabled=False):  # another device: no effect on CPU tensors
            low = self.d(x)
        return fp32, still_low, half, low


class ExplicitDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return (
            h.softmax(-1, dtype=torch.float32),
            torch.log_softmax(h, -1, dtype=torch.float64),
            h.sum(-1, dtype=torch.float32),
            torch.cumsum(h, 0, dtype=torch.float32),
            h.to(torch.float32).norm(dim=-1),
        )


class Float64Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w64 = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))

    def forward(self, x):
        h = self.lin(x)
        d = x.double() @ self.w64  # fp64 is never eligible: stays fp64
        mixed = torch.cat([h, x.double()], -1)  # promote ignores fp64 arguments
        return h, d, mixed, torch.stack([x, h.float()]), h + d.float()


class IntegerOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        counts = ids @ ids.transpose(0, 1)  # integer matmul: ineligible
        h = self.lin(self.emb(ids))
        picked = h[:, ids[0, :2] % 8]
        return counts, h, picked, torch.cat([ids.float(), ids.float()], -1)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        h.mul_(0.5)  # in-place on a low tensor stays low
        y = x.clone()
        y.add_(1.0)
        acc = torch.zeros(x.shape[0], 8)
        acc.addmm_(x, x.t()[:, :8] if x.shape[0] >= 8 else torch.ones(8, 8))  # in-place addmm: never cast
        z = x.exp()
        z.sub_(h.float())
        return h, y, acc, z


_MatMulFp32 = matmul_function(cast_inputs=torch.float32)
_MatMulAmbient = matmul_function()


class CustomFwd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return _MatMulFp32.apply(h, h.t()), _MatMulAmbient.apply(h, x.t())


class SharedActivation(nn.Module):
    """One activation feeding several matmuls (eager casts it once per consumer)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        scores = self.q(h) @ self.k(h).transpose(-1, -2)
        return scores.softmax(-1) @ self.v(h), h @ self.q.weight


class NoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            frozen = self.a(x)
        return self.b(x) + frozen, self.a(x)


class Losses(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, target):
        logits = self.lin(x)
        return F.cross_entropy(logits, target), F.mse_loss(logits, torch.zeros_like(logits)), F.nll_loss(logits.log_softmax(-1), target)


class EinsumAndConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding="same")
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        c = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return torch.einsum("bsd,de->bse", c, self.w), torch.einsum("bsd->bd", x)


class Recurrent(nn.Module):
    """GRU and the RNN cells: decomposed, since their gates promote with an fp32 state."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 8, num_layers=2, batch_first=True)
        self.gru_cell, self.lstm_cell = nn.GRUCell(8, 8), nn.LSTMCell(8, 8)
        self.rnn = nn.RNN(8, 8, batch_first=True)

    def forward(self, x):
        out, h = self.gru(x)
        step = x[:, 0]
        g = self.gru_cell(step)
        c = self.lstm_cell(step, (g, g))
        r, _ = self.rnn(out)
        return out, h, g, c[0], r


CASES = {
    "nested_regions": (NestedRegions, lambda: (torch.randn(4, 8),)),
    "explicit_dtypes": (ExplicitDtypes, lambda: (torch.randn(4, 8),)),
    "float64_branch": (Float64Branch, lambda: (torch.randn(4, 8),)),
    "integer_ops": (IntegerOps, lambda: (torch.randint(0, 16, (4, 8)),)),
    "in_place": (InPlace, lambda: (torch.randn(8, 8),)),
    "custom_fwd": (CustomFwd, lambda: (torch.randn(4, 8),)),
    "shared_activation": (SharedActivation, lambda: (torch.randn(2, 4, 8),)),
    "no_grad_region": (NoGradRegion, lambda: (torch.randn(4, 8),)),
    "losses": (Losses, lambda: (torch.randn(6, 8), torch.randint(0, 4, (6,)))),
    "einsum_and_conv": (EinsumAndConv, lambda: (torch.randn(2, 5, 8),)),
    "recurrent": (Recurrent, lambda: (torch.randn(2, 5, 8),)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_case_exact(name, dtype):
    make_model, make_args = CASES[name]
    model, args = make_model(), make_args()
    amp = graphamp.convert(model, args, dtype=dtype)
    assert_exact(model, amp, args, {}, dtype)


class Tagger(nn.Module):
    """Embedding -> LSTM -> Linear: the LSTM gets the embedding's fp32 output, and eager runs it
    on oneDNN, whose listed mkldnn_rnn_layer casts it whole to the low dtype."""

    def __init__(self, proj_size: int = 0):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, bidirectional=True, batch_first=True, proj_size=proj_size)
        self.out = nn.Linear(2 * (proj_size or 24), 5)

    def forward(self, tokens):
        h, (hn, cn) = self.lstm(self.emb(tokens))
        return self.out(h), hn * 2, cn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("proj_size", [0, 8], ids=["plain", "projections"])
def test_lstm_on_fp32_input(proj_size, dtype):
    model, args = Tagger(proj_size).train(), (torch.randint(0, 50, (3, 7)),)
    try:
        with torch.autocast("cpu", dtype=dtype):
            model(*args)
    except RuntimeError as e:  # oneDNN has no fp16 LSTM on CPUs without avx512_fp16/AMX-FP16
        pytest.skip(f"eager autocast itself cannot run this LSTM here: {str(e).splitlines()[0]}")
    if not proj_size:
        amp = graphamp.convert(model, args, dtype=dtype)
        assert_exact(model, amp, args, {}, dtype)
        assert graphamp.verify(model, args, dtype=dtype).ok
        return
    # With projections eager runs native C++ cells. The export graph's decomposition casts the
    # projection weight once: it says so, and the self-check finds the weight_hr gradients differ;
    # convert then captures the model on values, whose lstm decomposes with the C++ kernel as eager
    # runs it: exact. Asked only to warn, it keeps the export graph.
    with pytest.warns(graphamp.EagerPathWarning, match="proj_size"):
        exact = graphamp.convert(model, args, dtype=dtype)
    assert exact.graphamp_info.capture == "values"
    assert_exact(model, exact, args, {}, dtype)
    with pytest.warns(graphamp.EagerPathWarning, match="proj_size"), pytest.warns(graphamp.PolicyDriftWarning, match="weight_hr"):
        amp = graphamp.convert(model, args, dtype=dtype, self_check="warn")
    ref, ref_grads = run_eager(model, args, {}, dtype, grads=True)
    out, out_grads = run_converted(amp, model, args, {}, grads=True)
    assert_same_outputs(out, ref)
    assert_same_grads({k: v for k, v in out_grads.items() if "weight_hr" not in k}, {k: v for k, v in ref_grads.items() if "weight_hr" not in k})


class PermutedLSTM(nn.Module):
    """Conv1d -> permute -> LSTM: the LSTM reads a strided activation, which eager's oneDNN kernel
    copies into a contiguous one first."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.lstm = nn.LSTM(8, 8, num_layers=2)

    def forward(self, x):
        h = self.conv(x).permute(2, 0, 1)
        return self.lstm(h)[0] + h


def _eager_lstm_runs(model, args, dtype):
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            model(*args)
    except RuntimeError as e:  # oneDNN has no fp16 LSTM on CPUs without avx512_fp16/AMX-FP16
        pytest.skip(f"eager autocast itself cannot run this LSTM here: {str(e).splitlines()[0]}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inference", [False, True], ids=["train-graph", "inference"])
def test_lstm_on_a_strided_activation_is_exact(dtype, inference):
    # Before: inference=True raised PolicyDriftError (max abs 0.165 in bf16): the traced oneDNN path
    # lacked eager's contiguous copy, so oneDNN read the strided activation in the wrong order.
    torch.manual_seed(0)
    model, args = PermutedLSTM().eval(), (torch.randn(2, 8, 16),)
    _eager_lstm_runs(model, args, dtype)
    amp = graphamp.convert(model, args, dtype=dtype, inference=inference)
    assert_exact(model, amp, args, {}, dtype, grads=not inference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inference", [False, True], ids=["train-graph", "inference"])
def test_lstm_converted_on_a_contiguous_input_is_exact_on_a_strided_one(dtype, inference):
    # Before: silently different (max abs 0.089 in bf16) on the strided call, in both modes.
    torch.manual_seed(0)
    model, x = nn.LSTM(8, 8, num_layers=2).eval(), torch.randn(16, 2, 8)
    _eager_lstm_runs(model, (x,), dtype)
    amp = graphamp.convert(model, (x,), dtype=dtype, inference=inference)
    strided = torch.randn(2, 16, 8).permute(1, 0, 2)
    assert not strided.is_contiguous()
    assert_exact(model, amp, (strided,), {}, dtype, grads=not inference)


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)  # written in place, as eager runs it
        return self.a(x)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_model_that_writes_its_input_converts_exactly_and_leaves_the_example_alone(train):
    torch.manual_seed(0)
    model, x = WritesItsInput().train(train), torch.randn(4, 8)
    before = x.clone()
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)  # its self-check runs both sides from the same values
    assert torch.equal(x, before)  # graphamp's runs wrote graphamp's copy
    mine, theirs = before.clone(), before.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(theirs)
    got = amp(mine)
    assert torch.equal(got, want) and torch.equal(mine, theirs)  # the call writes the input once, as eager does


def test_verify_runs_each_side_from_the_same_input_values():
    model, x = WritesItsInput().eval(), torch.randn(4, 8)
    before = x.clone()
    assert graphamp.verify(model, (x,), dtype=torch.bfloat16).ok
    assert torch.equal(x, before)


def test_converting_again_on_a_call_leaves_that_calls_inputs_to_the_call():
    torch.manual_seed(0)
    model = WritesItsInput().eval()
    amp = graphamp.convert(model, (torch.randn(4, 8),), dtype=torch.bfloat16)
    amp.train()  # the next call converts again, in training mode, on that call's inputs
    model.train()
    x = torch.randn(4, 8)
    mine, theirs = x.clone(), x.clone()
    got = amp(mine)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(theirs)
    assert torch.equal(got, want) and torch.equal(mine, theirs)
