"""Census models that convert's dynamo fallback could not make exact (issue 17): the DETR family,
ViLT, Switch Transformers and NLLB-MoE differ in gradients, and plain torch.compile differs from
eager the same way. The self-check must say so, not call it a graphamp bug."""

import pytest
import torch
from torch import nn

import graphamp
from helpers import _run, run_eager


class SharedAcrossBreak(nn.Module):
    """DETR's encoder layer in training: a value branch (``if not torch.isfinite(h).all()``) breaks
    the graph, and the tensor before it is both returned and used three times after it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        if not torch.isfinite(h).all():
            h = h.clamp(-1e4, 1e4)
        return h, self.a(h) + self.b(h) + self.c(h)


def _compiled_grads(model, x, *, autocast: bool):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return compiled(x)

    try:
        return _run(call, model, grads=True)[1]
    finally:
        torch._dynamo.reset()


def test_torch_compile_alone_sums_gradients_across_a_graph_break_in_another_order_even_in_fp32():
    # The mechanism, without graphamp: AOTAutograd sums the three uses of h inside the second
    # graph's backward, then the engine adds the returned h's gradient; eager adds all four in turn.
    torch.manual_seed(0)
    model, x = SharedAcrossBreak(), torch.randn(2, 8, 16)
    fp32 = _run(lambda: model(x), model, grads=True)[1]
    assert not torch.equal(_compiled_grads(model, x, autocast=False)["norm.weight"], fp32["norm.weight"])
    bf16 = run_eager(model, (x,), {}, torch.bfloat16, grads=True)[1]
    assert not torch.equal(_compiled_grads(model, x, autocast=True)["norm.weight"], bf16["norm.weight"])


def _self_check_warning(caught) -> str:
    """The self-check's PolicyDriftWarning among those caught (others: the emulated precision, the
    backend's own CheckSkippedWarning at the graph break)."""
    (message,) = [str(w.message) for w in caught if issubclass(w.category, graphamp.PolicyDriftWarning) and "self-check" in str(w.message)]
    return message


def test_the_fallbacks_gradient_difference_that_torch_compile_shares_is_named_as_torch_compiles():
    torch.manual_seed(0)
    model, x = SharedAcrossBreak(), torch.randn(2, 8, 16)
    with pytest.warns(graphamp.PolicyDriftWarning) as info:  # raising, convert takes the capture on values
        graphamp.convert(model, (x,), self_check="warn")
    message = _self_check_warning(info)
    assert "gradient of norm.weight differs" in message
    assert "torch.compile's own, not graphamp's casts" in message and "graph break" in message
    assert "graphamp bug" not in message
    assert "data-dependent" in message  # why torch.export refused, which is the way out


def test_the_fallback_computes_what_torch_compile_computes():
    torch.manual_seed(0)
    model, x = SharedAcrossBreak(), torch.randn(2, 8, 16)
    with pytest.warns(graphamp.PolicyDriftWarning, match="torch.compile's own"):
        amp = graphamp.convert(model, (x,), self_check="warn")
    assert isinstance(amp, graphamp.DynamoAmpModule)
    got = _run(lambda: amp(x), model, grads=True)[1]
    want = _compiled_grads(model, x, autocast=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _traced(t):
    """transformers' ``is_tracing``: a fake or functional tensor (any trace), not a real one."""
    return isinstance(t, torch._subclasses.FakeTensor) or torch._is_functional_tensor(t)


class DropsAnAllOnesMask(nn.Module):
    """AIMv2's text attention (issue 17): transformers drops an all-ones causal mask in eager and
    leaves causality to SDPA's is_causal, which this attention passes as False; a trace keeps it."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if attention_mask is None or (not _traced(attention_mask) and bool(attention_mask.all())):
            mask = None
        else:
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.out(y.transpose(1, 2).reshape(b, n, 16))


def test_an_attention_mask_eager_dropped_by_value_is_named_with_the_way_out():
    torch.manual_seed(0)
    model, x = DropsAnAllOnesMask(), torch.randn(2, 6, 16)
    with pytest.warns(graphamp.PolicyDriftWarning) as info:
        graphamp.convert(model, (x, torch.ones(2, 6, dtype=torch.long)), self_check="warn")
    message = _self_check_warning(info)
    assert "Eager called scaled_dot_product_attention in the model's own forward with no mask, and without is_causal" in message
    assert "dropped the mask by its value" in message and "self_check='warn'" in message


class TwiceAfterBreak(SharedAcrossBreak):
    """Conditional DETR's case: after the break a weight is used twice, where eager's autocast shares
    one cast (graphamp too) and torch.compile alone casts per use, so it differs from eager in more
    gradients than the fallback, and the graph-break gradients the same way."""

    def forward(self, x):
        h = self.norm(x)
        if not torch.isfinite(h).all():
            h = h.clamp(-1e4, 1e4)
        y = self.a(h)
        return h, self.b(y) + torch.nn.functional.linear(y * 2, self.b.weight) + self.a(h * 3)


def test_a_fallback_difference_within_torch_compiles_own_is_named_as_most_likely_torch_compiles():
    torch.manual_seed(0)
    model, x = TwiceAfterBreak(), torch.randn(2, 8, 16)
    with pytest.warns(graphamp.PolicyDriftWarning) as info:
        graphamp.convert(model, (x,), self_check="warn")
    message = _self_check_warning(info)
    assert "differs from eager autocast in every gradient this module differs in" in message
    assert "more where this module follows eager" in message and "most likely torch.compile's own" in message
    assert "graphamp bug" not in message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["shared_across_break", "twice_after_break", "drops_all_ones_mask"])
def test_convert_takes_the_capture_on_values_where_the_other_captures_differ(case, dtype):
    # Where the self-check finds the dynamo fallback's or export's program differs from eager's,
    # convert captures the model on the example's values: eager's own program, exact.
    from helpers import assert_exact

    torch.manual_seed(0)
    model, args = {
        "shared_across_break": lambda: (SharedAcrossBreak(), (torch.randn(2, 8, 16),)),
        "twice_after_break": lambda: (TwiceAfterBreak(), (torch.randn(2, 8, 16),)),
        "drops_all_ones_mask": lambda: (DropsAnAllOnesMask(), (torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.long))),
    }[case]()
    amp = graphamp.convert(model.train(), args, dtype=dtype)
    assert isinstance(amp, graphamp.AmpModule) and amp.graphamp_info.capture == "values"
    assert_exact(model, amp, args, {}, dtype)
