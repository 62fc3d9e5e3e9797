"""fuse_encoder_layers: eval TransformerEncoderLayers under inference=True run eager's fused kernel."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp.passes.fuse_encoder_layers import FUSED
from graphamp.node_info import peek
from graphamp.runtime import autocast_op


def encoder(norm_first=False, activation="relu", heads=4, layers=2, d=32):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True,
                                       norm_first=norm_first, activation=activation)
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).eval()


def eager(model, x, dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return model(x)


def fused_nodes(amp):
    return [n for n in amp.graph.nodes if n.target is autocast_op and n.args[0] is FUSED]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (True, "gelu")])
def test_bitwise_to_eager_fused_path_under_no_grad(dtype, norm_first, activation):
    model, x = encoder(norm_first, activation), torch.randn(3, 10, 32)
    amp = graphamp.convert(model, (x,), dtype=dtype, inference=True)
    assert len(fused_nodes(amp)) == 2  # structure first: one fused call per layer
    assert peek(fused_nodes(amp)[0]).eager_kernel == "_transformer_encoder_layer_fwd"
    for inp in (x, torch.randn(1, 7, 32)):  # and other batch and sequence sizes
        want, got = eager(model, inp, dtype), amp(inp)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_saved_module_keeps_the_fused_call():
    model, x = encoder(), torch.randn(2, 5, 32)
    amp = graphamp.convert(model, (x,), inference=True)
    buf = io.BytesIO()
    torch.save(amp, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert len(fused_nodes(loaded)) == 2 and torch.equal(loaded(x), eager(model, x, torch.bfloat16))


def test_not_fused_where_eager_takes_the_ordinary_path():
    model, x = encoder(heads=3, d=30), torch.randn(2, 5, 30)  # an odd head count: eager's ordinary path
    assert not fused_nodes(graphamp.convert(model, (x,), inference=True))
    model = encoder()
    assert not fused_nodes(graphamp.convert(model, (torch.randn(2, 5, 32),)))  # not inference: grad mode
    train = encoder().train()
    assert not fused_nodes(graphamp.convert(train, (torch.randn(2, 5, 32),), inference=True))


class SelfAttention(nn.Module):
    def __init__(self, need_weights=False, cross=False, returns_weights=False, float_mask=False):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.need_weights, self.cross, self.returns_weights, self.float_mask = need_weights, cross, returns_weights, float_mask

    def forward(self, x, padding=None):
        kv = x * 2 if self.cross else x
        if padding is not None and self.float_mask:
            padding = padding.float() * -1e4
        out, weights = self.attn(x, kv, kv, need_weights=self.need_weights or self.returns_weights, key_padding_mask=padding)
        return (out, weights) if self.returns_weights else out


def _padding(batch, seq):
    """Right padding, a row each of lengths seq, seq - 2, seq - 3, ..."""
    lengths = torch.tensor([max(1, seq - 2 * i - (i > 0)) for i in range(batch)])
    return torch.arange(seq) >= lengths[:, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no-weights", "weights-unread"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "key-padding-mask"])
def test_multihead_attention_takes_eagers_fused_op(dtype, need_weights, padded):
    # Eager's fast path runs with need_weights=True (MultiheadAttention's default) and with a bool
    # key_padding_mask too. Before, those kept the ordinary ops: with a mask, inference=True raised
    # PolicyDriftError (max abs 0.0039 in bf16: the kernel's masked softmax is not softmax over -inf).
    torch.manual_seed(0)
    model, x = SelfAttention(need_weights=need_weights).eval(), torch.randn(2, 6, 32)
    args = (x, _padding(2, 6)) if padded else (x,)
    amp = graphamp.convert(model, args, dtype=dtype, inference=True)
    fused = [n for n in amp.graph.nodes if n.target is torch.ops.aten._native_multi_head_attention.default]
    if padded or not need_weights:  # without a mask, the weights' ordinary ops are bitwise the kernel's: either
        assert len(fused) == 1 and peek(fused[0]).category == "lower_precision_fp"  # autocast's list decides its casts
    for inp in (x, torch.randn(3, 4, 32)):
        call = (inp, _padding(inp.shape[0], inp.shape[1])) if padded else (inp,)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            want = model(*call)
        got = amp(*call)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("kwargs", [{"returns_weights": True}, {"cross": True}, {"float_mask": True}])
def test_multihead_attention_not_fused_off_eagers_fast_path(kwargs):
    # (Attention weights read beside a key_padding_mask: eager's kernel computes both, graphamp keeps
    # the ordinary ops, and the self-check refuses the difference: a known limit.)
    torch.manual_seed(0)
    model = SelfAttention(**kwargs).eval()
    x = torch.randn(2, 6, 32)
    amp = graphamp.convert(model, (x, _padding(2, 6)) if kwargs.get("float_mask") else (x,), inference=True)
    assert not [n for n in amp.graph.nodes if n.target is torch.ops.aten._native_multi_head_attention.default]


@pytest.mark.parametrize("inference", [False, True], ids=["exact", "inference"])
def test_a_layer_that_is_the_model_itself_is_fused(inference):
    # The root's parameters have no module prefix ("self_attn.in_proj_weight"): found a layer at
    # path "" before, looked for ".self_attn.in_proj_weight", fused nothing, and returned fp32 where
    # eager's fused kernel returns bf16 (inference=True raised PolicyDriftError).
    torch.manual_seed(0)
    model, x = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval(), torch.randn(4, 12, 32)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=inference)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(x)
        got = amp(x)
    assert want.dtype is torch.bfloat16 and got.dtype is torch.bfloat16 and torch.equal(got, want)


class _PaddedLayers(nn.Module):
    def __init__(self, encoder: bool, float_mask: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False) if encoder else layer
        self.float_mask = float_mask

    def forward(self, x, padding):
        return self.layers(x, src_key_padding_mask=padding.float() * -1e4 if self.float_mask else padding)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("encoder", [False, True], ids=["layer", "encoder"])
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool-mask", "float-mask"])
def test_an_encoder_layer_with_a_key_padding_mask_takes_eagers_fused_kernel(dtype, encoder, float_mask):
    # Eager's fast path takes the (canonicalized) key padding mask as mask type 1; nn.TransformerEncoder
    # hands its layers a float one. Before: inference=True raised PolicyDriftError (fp32 output).
    torch.manual_seed(0)
    model = _PaddedLayers(encoder, float_mask).eval()
    x = torch.randn(2, 6, 32)
    amp = graphamp.convert(model, (x, _padding(2, 6)), dtype=dtype, inference=True)
    assert len(fused_nodes(amp)) == (2 if encoder else 1)
    for inp in (x, torch.randn(3, 5, 32)):
        call = (inp, _padding(inp.shape[0], inp.shape[1]))
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            want = model(*call)
        got = amp(*call)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compiled_keeps_the_fused_layer_under_autocast(dtype):
    # torch.compile traced autocast_op's kernel without the autocast it runs under (fp32 outputs),
    # so compile=True fell back to the uncompiled module: the compiled program calls one graphamp op.
    model, x = encoder(), torch.randn(3, 10, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.CompileFallbackWarning)
        cm = graphamp.convert(model, (x,), dtype=dtype, inference=True, compile=True)
        got = cm(x)
    assert cm.runs_compiled
    want = eager(model, x, dtype)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want)  # inductor's code around the layers: the drift is measured
