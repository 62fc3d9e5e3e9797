"""capture's fallbacks: static sizes where symbolic ones fail, a conversion per shape class, and
what stays refused (outputs a graph cannot return) with the way out."""

import copy
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
import graphamp.emit
from helpers import assert_exact


class SymBoolCausal(nn.Module):
    """``is_causal`` computed from a length: with a symbolic length it reaches sdpa as a SymBool,
    which sdpa refuses (DETR, Conditional DETR and Segformer build their masks so)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=n > 1).transpose(1, 2).reshape(b, n, 8)


class BatchNotOne(nn.Module):
    """Branches on ``batch != 1``, as transformers' masking_utils does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if x.shape[0] != 1:
            return h.softmax(-1) * 2
        return h


def _variants(amp):
    return amp.__dict__.get("_graphamp_variants", [])


def test_symbolic_sizes_that_fail_are_captured_static_and_exact():
    model, x = SymBoolCausal(), torch.randn(2, 5, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert amp.meta["graphamp"].captured_static
    assert_exact(model, amp, (x,), {}, torch.bfloat16)


def test_other_shapes_convert_again_once_each_and_share_the_parameters(caplog):
    model = SymBoolCausal()
    amp = graphamp.convert(model, (torch.randn(2, 5, 8),), dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="graphamp"):
        for shape in [(3, 5, 8), (2, 1, 8), (3, 5, 8), (1, 7, 8)]:
            assert_exact(model, amp, (torch.randn(shape),), {}, torch.bfloat16)
    assert len(_variants(amp)) == 3  # (3, 5, 8) the second time runs the module converted the first
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO", "INFO"]
    assert "input class 1 of at most 8" in caplog.records[0].getMessage()
    for variant in _variants(amp):
        assert variant.get_parameter("qkv.weight") is model.qkv.weight
        assert variant.meta["graphamp"].self_check.ok  # checked against eager on the call's inputs, as convert checks
    assert list(amp.state_dict()) == list(model.state_dict())  # the variants are not submodules


def test_a_branch_on_batch_not_one_is_checked_not_silently_taken():
    # backed_size_oblivious leaves batch's range open at 1: the graph of batch 2 holds the
    # `!= 1` branch, so the guard must test the condition itself.
    model = BatchNotOne()
    amp = graphamp.convert(model, (torch.randn(2, 4),), dtype=torch.bfloat16)
    assert_exact(model, amp, (torch.randn(1, 4),), {}, torch.bfloat16)
    assert_exact(model, amp, (torch.randn(3, 4),), {}, torch.bfloat16)
    assert len(_variants(amp)) == 1


def test_dtype_rank_and_structure_stay_input_mismatches():
    model, x = SymBoolCausal(), torch.randn(2, 5, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    for call in [lambda: amp(x.double()), lambda: amp(x[0]), lambda: amp(x, x)]:
        with pytest.raises(graphamp.InputMismatchError) as info:
            call()
        assert not isinstance(info.value, graphamp.InputShapeError)
    assert not _variants(amp)


def test_a_shape_the_model_rejects_is_an_input_shape_error_naming_both():
    amp = graphamp.convert(SymBoolCausal(), (torch.randn(2, 5, 8),))
    with pytest.raises(graphamp.InputShapeError, match=r"dim 2 is 6, .*fixed it to 8.*Converting SymBoolCausal again .* failed"):
        amp(torch.randn(2, 5, 6))
    assert not _variants(amp)


def test_the_number_of_shape_classes_is_bounded(monkeypatch):
    monkeypatch.setattr(graphamp.emit, "MAX_SHAPE_CLASSES", 2)
    model = SymBoolCausal()
    amp = graphamp.convert(model, (torch.randn(2, 5, 8),))
    amp(torch.randn(1, 5, 8))
    amp(torch.randn(3, 5, 8))
    with pytest.raises(graphamp.InputShapeError, match="already converted itself for 2 other input classes.*Way out: pad"):
        amp(torch.randn(4, 5, 8))
    amp(torch.randn(1, 5, 8))  # the shape classes it holds still run


def test_a_model_left_in_another_mode_converts_again_in_the_modules_mode():
    model = nn.Sequential(SymBoolCausal(), nn.Dropout(0.0), nn.BatchNorm1d(5))
    amp = graphamp.convert(model, (torch.randn(2, 5, 8),))
    model.eval()
    flags = [m.training for m in model.modules()]
    amp(torch.randn(3, 5, 8))
    assert _variants(amp)[0].graphamp_info.training
    assert [m.training for m in model.modules()] == flags  # restored after the conversion


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SymBoolCausal()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.attn(x))


def _save_load(amp):
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_a_loaded_module_converts_again_with_the_model_saved_along():
    model = Stateful()
    amp = graphamp.convert(model, (torch.randn(2, 5, 8),))
    loaded = _save_load(amp)
    source = loaded.__dict__["_graphamp_model"]
    assert loaded.get_parameter("attn.qkv.weight") is source.attn.qkv.weight  # one object, as before saving
    assert sorted(loaded.state_dict()) == sorted(model.state_dict())  # loading orders them as the code reads them
    assert_exact(source, loaded, (torch.randn(3, 4, 8),), {}, torch.bfloat16)
    assert _variants(loaded)[0].get_parameter("norm.weight") is source.norm.weight


def test_a_model_that_cannot_be_pickled_is_saved_without_and_says_so():
    class Local(SymBoolCausal):  # pickle cannot find a class defined in a function
        pass

    amp = graphamp.convert(Local(), (torch.randn(2, 5, 8),))
    loaded = _save_load(amp)
    loaded(torch.randn(2, 5, 8))
    with pytest.raises(graphamp.InputShapeError, match="holds no reference to its model.*Way out: call graphamp.convert again"):
        loaded(torch.randn(3, 5, 8))


def test_training_through_a_shape_class_updates_the_models_parameters():
    model = SymBoolCausal()
    amp = graphamp.convert(model, (torch.randn(2, 5, 8),))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.qkv.weight.detach().clone()
    amp(torch.randn(3, 5, 8)).float().pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model.qkv.weight, before)
    assert_exact(model, amp, (torch.randn(3, 5, 8),), {}, torch.bfloat16)  # sees the updated weights


class ReturnsState:
    """An object no pytree knows, holding tensors, as a Hugging Face cache is."""

    def __init__(self, t):
        self.t = t


class WithState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), ReturnsState(x)


def test_an_unknown_output_type_is_named_with_the_way_out(capfd):
    with pytest.raises(graphamp.CaptureError, match=r"returns a .*ReturnsState in its outputs.*register_pytree_node") as info:
        graphamp.convert(WithState(), (torch.randn(2, 4),))
    assert "cannot vary" not in str(info.value)
    assert capfd.readouterr().out == ""


def test_a_decoder_returning_its_cache_returns_it_as_eager_does():
    # transformers' own pytree registration of its cache classes (its exporter's) lets the graph
    # return the cache; the module's cache holds eager's tensors and the model takes it back.
    transformers = pytest.importorskip("transformers")
    from torch.utils import _pytree as pytree

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 6))
    amp = graphamp.convert(model, (ids,), dtype=torch.bfloat16)
    out = amp(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(ids)
    assert type(out.past_key_values) is type(ref.past_key_values) and out.past_key_values.get_seq_length() == 6
    assert torch.equal(out.logits, ref.logits)
    got, want = pytree.tree_leaves(out.past_key_values), pytree.tree_leaves(ref.past_key_values)
    assert len(got) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = model(ids[:, :1], past_key_values=out.past_key_values)  # the model takes the cache back
    assert again.logits.shape == (2, 1, 64) and out.past_key_values.get_seq_length() == 7


def test_swin_takes_batch_one_after_batch_two():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1], num_heads=[1], window_size=2)
    model = transformers.SwinModel(config).eval()
    amp = graphamp.convert(model, (torch.randn(2, 3, 16, 16),), dtype=torch.bfloat16)
    assert_exact(model, amp, (torch.randn(1, 3, 16, 16),), {}, torch.bfloat16)
    # Swin pads a width that is not a multiple of the patch size: a condition the guard checks.
    assert any("% 4" in source for source, _, _ in amp._graphamp_guard.conditions)
    assert_exact(model, amp, (torch.randn(2, 3, 16, 18),), {}, torch.bfloat16)
    assert len(_variants(amp)) == 2


def test_detr_converts_static_and_takes_other_shapes():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"])
    config = transformers.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        num_queries=5,
    )
    model = transformers.DetrModel(config).eval()
    x = torch.randn(2, 3, 32, 32)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert amp.meta["graphamp"].captured_static
    assert_exact(model, amp, (x,), {}, torch.bfloat16)
    assert_exact(model, amp, (torch.randn(1, 3, 32, 48),), {}, torch.bfloat16)


def test_a_failed_symbolic_capture_leaves_the_inputs_unmarked():
    x = torch.randn(2, 5, 8)
    graphamp.convert(SymBoolCausal(), (x,))
    assert not [k for k in vars(x) if re.match("_dynamo|_has_dynamo", k)]
    copy.deepcopy(x)  # a plain tensor again


class ValueBranch(nn.Module):
    """A Python branch on a tensor's value: torch.export refuses it at any size."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.a(x)
        if h.float().sum() > 0:
            h = self.b(h).softmax(-1)
        else:
            h = self.norm(h) @ self.b.weight
        return self.norm(h)


def test_a_value_branch_falls_back_to_dynamo_and_is_exact_on_both_branches(capfd):
    model = ValueBranch()
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert isinstance(amp, graphamp.DynamoAmpModule) and "dynamo fallback" in repr(amp)
    assert amp.cast_summary()["fallback"] == "dynamo" and "data-dependent" in amp.cast_summary()["reason"]
    assert list(amp.state_dict()) == list(model.state_dict())
    assert all(p is q for p, q in zip(amp.parameters(), model.parameters()))
    assert not model._forward_pre_hooks and not model._forward_hooks and "_orig_mod" not in model._modules
    signs = set()
    for i in range(6):
        torch.manual_seed(i)
        x = torch.randn(4, 8)
        signs.add(bool(model.a(x).sum() > 0))
        assert_exact(model, amp, (x,), {}, torch.bfloat16)
    assert signs == {True, False}
    assert_exact(model, amp, (torch.randn(3, 2, 8),), {}, torch.bfloat16)  # dynamo recompiles for the rank
    assert capfd.readouterr().out == ""


def test_a_dynamo_fallback_refuses_pickling_with_the_way_out():
    amp = graphamp.convert(ValueBranch(), (torch.randn(4, 8),))
    with pytest.raises(TypeError, match="state_dict"):
        torch.save(amp, io.BytesIO())


class FailsOnTheExample(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            raise ValueError("positive sums are not supported")
        return x


def test_what_dynamo_cannot_run_either_is_a_capture_error_with_file_and_line():
    with pytest.raises(graphamp.CaptureError, match=r"torch.compile with graph breaks failed too, at test_capture_fallback.py:\d+: ValueError") as info:
        graphamp.convert(FailsOnTheExample(), (torch.ones(3),))
    assert isinstance(info.value.__cause__, ValueError)


def test_fsmt_converts_with_graph_breaks_and_is_exact():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FSMTConfig(
        langs=["en", "de"], src_vocab_size=64, tgt_vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
    )
    model = transformers.FSMTModel(config).eval()
    kwargs = {"input_ids": torch.randint(4, 64, (2, 6)), "decoder_input_ids": torch.randint(4, 64, (2, 5)), "use_cache": False}
    amp = graphamp.convert(model, (), kwargs, dtype=torch.bfloat16)
    assert isinstance(amp, graphamp.DynamoAmpModule)
    assert_exact(model, amp, (), kwargs, torch.bfloat16)
