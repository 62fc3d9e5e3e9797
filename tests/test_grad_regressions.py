"""Gradient regressions of issue 17: the BERT-derived families whose gradients differed from eager.

BigBird, BigBird-Pegasus, ConvBERT, LiLT, LUKE, Megatron-BERT, Nyströmformer, RemBERT, RoFormer,
SqueezeBERT and TAPAS build their attention bias with transformers' ``eager_mask``. In eager, a
padding mask with no zeros is skipped (``padding_mask.all()``), so the scores stay in autocast's
low dtype and softmax runs there. Any trace (``torch.export``, ``torch.compile``, graphamp) cannot
read that value, so transformers materialises an fp32 bias of zeros instead: adding it promotes
the scores to fp32, and softmax runs in fp32. The forward rounds to the same values; the softmax
backward does not. The graph is another program than eager's, chosen by the model's own code, not
by a cast graphamp places or prunes: torch's dispatcher-placed casts on the same capture give the
same gradients, and with padding in the mask (eager then builds the bias too) graphamp is bitwise.

So the contract these tests hold is: where eager and the graph run one program (padded mask, tied
embeddings included), every gradient is ``torch.equal``; where the model's eager path takes
another branch on the example, ``convert`` says so (its self-check raises) instead of returning a
module that differs silently.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp.errors import PolicyDriftError
from helpers import assert_same_outputs, run_converted, run_eager

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH, SEQ, VOCAB = 2, 8, 50


def _traced(t: torch.Tensor) -> bool:
    # transformers' is_tracing(): a trace cannot read a tensor's values, so it takes the other path.
    return isinstance(t, torch._subclasses.FakeTensor) or torch.compiler.is_compiling()


class MaskedEncoder(nn.Module):
    """BERT's embeddings, one self-attention with an fp32 additive padding bias, and an output head
    tied to the word embeddings (the word table gets gradient from two uses)."""

    def __init__(self, d: int = 32, heads: int = 2, *, skip_bias_without_padding: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.skip_bias_without_padding = skip_bias_without_padding
        self.word = nn.Embedding(VOCAB, d)
        self.position = nn.Embedding(SEQ, d)
        self.token_type = nn.Embedding(2, d)
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        positions = torch.arange(s, device=ids.device)
        h = self.norm(self.word(ids) + self.position(positions) + self.token_type(torch.zeros_like(ids)))
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        bias = self._bias(mask, h.dtype)
        if bias is not None:
            # h is fp32 (layer_norm runs in fp32 under CPU autocast): the bias promotes the scores.
            scores = scores + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        h = h + self.proj(context)
        return F.linear(h, self.word.weight)

    def _bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        # transformers' _ignore_bidirectional_mask_sdpa: eager skips a bias that would be all zeros.
        if self.skip_bias_without_padding and not _traced(mask) and bool(mask.all()):
            return None
        keep = mask[:, None, None, :].bool()
        return torch.where(keep, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def _inputs(*, padded: bool) -> tuple[tuple, dict]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[0, -3:] = 0
    return (ids, mask), {}


def _grad_differences(amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> list[str]:
    ref, ref_grads = run_eager(model, args, kwargs, dtype, grads=True)
    out, grads = run_converted(amp, model, args, kwargs, grads=True)
    assert_same_outputs(out, ref)
    assert ref_grads and grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    return [name for name in ref_grads if not torch.equal(grads[name], ref_grads[name])]


def _assert_exact_or_refused(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> None:
    """Exact, or convert's self-check refuses and names the first node where the programs part."""
    try:
        amp = graphamp.convert(model, args, kwargs, dtype=dtype)
    except PolicyDriftError as e:
        assert "softmax" in str(e), str(e)
        return
    assert _grad_differences(amp, model, args, kwargs, dtype) == []


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("skip", [False, True], ids=["always_bias", "skips_zero_bias"])
def test_embeddings_and_tied_head_exact_with_padding(dtype: torch.dtype, skip: bool) -> None:
    model = MaskedEncoder(skip_bias_without_padding=skip).train()
    args, kwargs = _inputs(padded=True)
    amp = graphamp.convert(model, args, kwargs, dtype=dtype)
    assert _grad_differences(amp, model, args, kwargs, dtype) == []


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_zero_bias_skipped_in_eager_is_not_silent(dtype: torch.dtype) -> None:
    model = MaskedEncoder(skip_bias_without_padding=True).train()
    args, kwargs = _inputs(padded=False)
    _assert_exact_or_refused(model, args, kwargs, dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_zero_bias_skipped_in_eager_really_differs(dtype: torch.dtype) -> None:
    # Guards the construct above: if this stops differing, the test before it checks nothing.
    model = MaskedEncoder(skip_bias_without_padding=True).train()
    args, kwargs = _inputs(padded=False)
    amp = graphamp.convert(model, args, kwargs, dtype=dtype, self_check="off")
    assert _grad_differences(amp, model, args, kwargs, dtype)


def test_padded_example_then_unpadded_batch() -> None:
    # Converted on a padded example, the graph adds the bias; eager skips it for an unpadded batch
    # by reading the mask's values. The graph checks that read (a guard from the capture on values,
    # graphamp/capture/values.py: guard_eager_reads), so the unpadded batch gets its own graph.
    from graphamp.emit import _VARIANTS
    from graphamp.runtime import guard_value

    model = MaskedEncoder(skip_bias_without_padding=True).train()
    amp = graphamp.convert(model, *_inputs(padded=True), dtype=torch.bfloat16)
    assert amp.graphamp_info.capture == "export" and any(n.target is guard_value for n in amp.graph.nodes)
    args, kwargs = _inputs(padded=False)
    assert _grad_differences(amp, model, args, kwargs, torch.bfloat16) == []
    assert len(amp.__dict__[_VARIANTS]) == 1
    padded, _ = _inputs(padded=True)
    assert _grad_differences(amp, model, padded, {}, torch.bfloat16) == []
    assert len(amp.__dict__[_VARIANTS]) == 1


def test_a_padded_example_takes_other_sizes_with_its_guard() -> None:
    # The guard reads the mask whole (no size baked in), so the export graph keeps its symbolic sizes.
    from graphamp.emit import _VARIANTS

    model = MaskedEncoder(skip_bias_without_padding=True).eval()
    amp = graphamp.convert(model, *_inputs(padded=True), dtype=torch.bfloat16)
    (ids, mask), _ = _inputs(padded=True)
    assert_same_outputs(*_both(amp, model, (ids[:1], mask[:1])))
    assert not amp.__dict__.get(_VARIANTS)


def _both(amp: nn.Module, model: nn.Module, args: tuple) -> tuple:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(*args)
    with torch.no_grad():
        return amp(*args), want


def _roformer(*, masked_lm: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.RoFormerConfig(
        vocab_size=VOCAB, hidden_size=32, embedding_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=2 * SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    cls = transformers.RoFormerForMaskedLM if masked_lm else transformers.RoFormerModel
    return cls(config).train()


def _roformer_inputs(*, padded: bool) -> tuple[tuple, dict]:
    (ids, mask), _ = _inputs(padded=padded)
    return (ids,), {"attention_mask": mask}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_roformer_exact_with_padding(dtype: torch.dtype) -> None:
    model = _roformer(masked_lm=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    args, kwargs = _roformer_inputs(padded=True)
    amp = graphamp.convert(model, args, kwargs, dtype=dtype)
    assert _grad_differences(amp, model, args, kwargs, dtype) == []


def test_roformer_without_padding_is_not_silent() -> None:
    model = _roformer(masked_lm=False)
    args, kwargs = _roformer_inputs(padded=False)
    _assert_exact_or_refused(model, args, kwargs, torch.bfloat16)


class DropsAllOnesMask(MaskedEncoder):
    """transformers' newer mask utilities: a keyword mask that masks nothing is dropped by its
    values in eager (``padding_mask.all()``), as if none was passed; a trace always builds it."""

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None and not _traced(attention_mask) and bool(attention_mask.all()):
            attention_mask = None
        self.skip_bias_without_padding = False
        if attention_mask is None:
            return self._no_mask(ids)
        return super().forward(ids, attention_mask)

    def _no_mask(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        h = self.norm(self.word(ids) + self.position(torch.arange(s)) + self.token_type(torch.zeros_like(ids)))
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        context = ((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        return F.linear(h + self.proj(context), self.word.weight)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_an_all_ones_mask_the_model_drops_is_converted_without_it(dtype: torch.dtype) -> None:
    import copy

    from graphamp.emit import ALL_ONES_AS_NONE

    model = DropsAllOnesMask().train()
    (ids, mask), _ = _inputs(padded=False)
    amp = graphamp.convert(model, (ids,), {"attention_mask": mask}, dtype=dtype)
    assert amp.__dict__[ALL_ONES_AS_NONE] == ("attention_mask",)
    assert _grad_differences(amp, model, (ids,), {"attention_mask": mask}, dtype) == []
    (ids, padded), _ = _inputs(padded=True)  # keeps its mask: a graph of its own, checked on first use
    assert _grad_differences(amp, model, (ids,), {"attention_mask": padded}, dtype) == []
    again = copy.deepcopy(amp)  # as torch.save and torch.load: a copy of the model comes along
    assert again.__dict__[ALL_ONES_AS_NONE] == ("attention_mask",)
    with torch.autocast("cpu", dtype=dtype):
        expected = model(ids, attention_mask=mask)
    assert torch.equal(again(ids, attention_mask=mask), expected)


def test_without_the_fallback_the_all_ones_mask_really_differs() -> None:
    # Guards the construct above: converted with the mask, the graph's program is not eager's.
    model = DropsAllOnesMask().train()
    (ids, mask), _ = _inputs(padded=False)
    with pytest.raises(PolicyDriftError, match="softmax"):
        from graphamp.pipeline import build as _convert
        from graphamp.self_check import checker_for
        from graphamp.spec import AmpSpec

        spec = AmpSpec.resolve(model, ((ids,), {"attention_mask": mask}), dtype=torch.bfloat16)
        amp = _convert(model, (ids,), {"attention_mask": mask}, spec)
        checker_for(amp)(amp, model, (ids,), {"attention_mask": mask}, spec, on_drift="raise")


class DropsAllOnesMaskUpToBatch2(DropsAllOnesMask):
    """Drops an all-ones mask by value only for batches of at most 2: the example's finding (eager
    runs the same program as without the mask) does not hold at batch 3."""

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None and ids.shape[0] > 2:
            self.skip_bias_without_padding = False
            return MaskedEncoder.forward(self, ids, attention_mask)
        return super().forward(ids, attention_mask)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_all_ones_mask_is_dropped_only_where_eager_was_seen_to_drop_it(training: bool) -> None:
    from graphamp.emit import ALL_ONES_PROVEN

    model = DropsAllOnesMaskUpToBatch2().train(training)
    (ids, mask), _ = _inputs(padded=False)
    amp = graphamp.convert(model, (ids,), {"attention_mask": mask}, dtype=torch.bfloat16)
    assert len(amp.__dict__[ALL_ONES_PROVEN]) == 1 and all(amp.__dict__[ALL_ONES_PROVEN].values())

    def exact(args: tuple, kwargs: dict) -> None:
        if training:
            assert _grad_differences(amp, model, args, kwargs, torch.bfloat16) == []
        else:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                want = model(*args, **kwargs)
            with torch.no_grad():
                assert_same_outputs(amp(*args, **kwargs), want)

    three = torch.cat([ids, ids[:1]]), torch.ones(3, ids.shape[1], dtype=mask.dtype)
    # Eager keeps the all-ones mask at batch 3 (another program): the module must not pass None.
    # (Without grad the two programs' outputs happen to be bitwise equal here: None is fine.)
    exact((three[0],), {"attention_mask": three[1]})
    assert list(amp.__dict__[ALL_ONES_PROVEN].values()) == [True, not training]
    one = ids[:1], mask[:1]  # eager drops it at batch 1: checked once, then passed as None
    exact((one[0],), {"attention_mask": one[1]})
    assert list(amp.__dict__[ALL_ONES_PROVEN].values()) == [True, not training, True]
