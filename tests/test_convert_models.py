"""End to end on real models: exact mode is bitwise equal to eager CPU autocast, forward and grads."""

import pytest
import torch

import graphamp
from conftest import build_case
from helpers import assert_exact, eager_cast_count, graphamp_cast_count

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]

# (zoo name, train mode). TransformerEncoder and MultiheadAttention run in train mode (dropout 0):
# in eval under no_grad, eager takes a fused fast path that traced graphs never take.
MODELS = [
    ("bert", False),
    ("gpt2", False),
    ("vit", False),
    ("resnet", False),
    ("transformer_encoder", True),
    ("lstm", False),
    ("mha", True),
]
# Other input shapes than the example's (batch, seq). torch.export pins nn.LSTM's sequence length
# (it unrolls the recurrence while tracing), so the LSTM model varies its batch only.
OTHER_SHAPES = {"lstm": [(1, 8), (3, 8), (5, 8)], "resnet": [(1, 4), (3, 12), (4, 6)]}
DEFAULT_SHAPES = [(1, 5), (3, 11), (4, 3)]


@pytest.fixture(scope="module", params=MODELS, ids=[m for m, _ in MODELS])
def case(request):
    name, train = request.param
    return build_case(name, train=train)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_forward_and_grads(case, dtype):
    args, kwargs = case.inputs
    amp = graphamp.convert(case.model, args, kwargs, dtype=dtype)
    assert_exact(case.model, amp, args, kwargs, dtype)
    for batch, seq in OTHER_SHAPES.get(case.name, DEFAULT_SHAPES):
        other_args, other_kwargs = case.make_inputs(batch, seq)
        assert_exact(case.model, amp, other_args, other_kwargs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_executes_no_more_casts_than_eager(case, dtype):
    args, kwargs = case.inputs
    amp = graphamp.convert(case.model, args, kwargs, dtype=dtype)
    ours = graphamp_cast_count(amp, args, kwargs)
    eager = eager_cast_count(case.model, args, kwargs, dtype)
    assert 0 < ours <= eager, f"{case.name}: graphamp executes {ours} casts, eager autocast {eager}"
