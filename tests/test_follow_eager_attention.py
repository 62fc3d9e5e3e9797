"""follow_eager_attention: SDPA gets grouped key/value heads exactly where eager gave it them."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch import nn

import graphamp
from graphamp.passes.follow_eager_attention import SDPA, repeated_heads
from helpers import assert_same_outputs, run_converted, run_eager

HEADS, KV_HEADS, DIM = 4, 2, 8


def _repeat_kv(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, HEADS // KV_HEADS, s, d).reshape(b, HEADS, s, d)


class GroupedAttention(nn.Module):
    """Grouped-query attention that, like transformers' SDPA integration, repeats the key/value
    heads itself when traced (it sees fake tensors) but lets SDPA group them in eager."""

    def __init__(self, traced_differs: bool = True) -> None:
        super().__init__()
        self.q = nn.Linear(DIM * HEADS, DIM * HEADS)
        self.kv = nn.Linear(DIM * HEADS, 2 * DIM * KV_HEADS)
        self.traced_differs = traced_differs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2 * KV_HEADS, DIM).transpose(1, 2).chunk(2, dim=1)
        if self.traced_differs and not isinstance(k, FakeTensor):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, _repeat_kv(k), _repeat_kv(v), is_causal=True)
        return out.transpose(1, 2).reshape(b, s, HEADS * DIM)


def _grads_equal(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> tuple[graphamp.AmpModule, list[str]]:
    amp = graphamp.convert(model, (x,), dtype=dtype)
    out, got = run_converted(amp, model, (x,), {}, grads=True)
    ref, want = run_eager(model, (x,), {}, dtype, grads=True)
    assert_same_outputs(out, ref)
    assert got.keys() == want.keys()
    return amp, [name for name in want if not torch.equal(got[name], want[name])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_heads_where_eager_grouped_them(dtype):
    model = GroupedAttention()
    amp, differing = _grads_equal(model, torch.randn(2, 16, DIM * HEADS), dtype)
    assert differing == []
    (sdpa,) = amp.graph.find_nodes(op="call_function", target=SDPA)
    assert sdpa.kwargs["enable_gqa"] and "enable_gqa" in sdpa.meta["graphamp"].attention
    # Other shapes keep the rewrite's forward equal to eager (it never changes values).
    for shape in [(1, 5, DIM * HEADS), (3, 9, DIM * HEADS)]:
        x = torch.randn(shape)
        with torch.autocast("cpu", dtype=dtype):
            want = model(x)
        assert torch.equal(amp(x), want)


def test_repeated_heads_kept_where_eager_repeated_them():
    model = GroupedAttention(traced_differs=False)
    amp, differing = _grads_equal(model, torch.randn(2, 16, DIM * HEADS), torch.bfloat16)
    assert differing == []
    (sdpa,) = amp.graph.find_nodes(op="call_function", target=SDPA)
    assert not sdpa.kwargs.get("enable_gqa") and repeated_heads(sdpa.args[2]) is not None


def test_probe_leaves_the_model_untouched():
    model = nn.Sequential(nn.BatchNorm1d(DIM * HEADS), nn.Dropout(0.5), GroupedAttention()).train()
    x = torch.randn(2, 16, DIM * HEADS).transpose(1, 2)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.drop, self.attn = model

        def forward(self, x):
            return self.attn(self.drop(self.norm(x).transpose(1, 2)))

    wrapped = Wrap()
    stats = {k: v.clone() for k, v in wrapped.state_dict().items()}
    torch.manual_seed(1)
    before = torch.rand(3)
    torch.manual_seed(1)
    graphamp.convert(wrapped, (x,), dtype=torch.bfloat16)
    assert torch.equal(torch.rand(3), before)  # no draw from the global generator
    assert all(torch.equal(v, stats[k]) for k, v in wrapped.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_grouped_query_attention_gradients(dtype):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 12))
    amp = graphamp.convert(model, (ids,), dtype=dtype)
    out, got = run_converted(amp, model, (ids,), {}, grads=True)
    ref, want = run_eager(model, (ids,), {}, dtype, grads=True)
    assert_same_outputs(out, ref)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
