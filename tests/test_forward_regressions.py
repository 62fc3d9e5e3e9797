"""Forward differences the census of 2026-11-24 found, one construct per test, against eager autocast here.

Each construct has a hand-built module (no transformers needed) and, where transformers builds it,
the tiny model the census measured. Two kinds:

* fixed: graphamp now gives outputs, dtypes and gradients ``torch.equal`` to eager autocast;
* not capturable faithfully: the model's eager program depends on a tensor's *values* (or on a
  fake kernel torch lacks), so no trace can hold it for every input. Those must never be silent:
  ``convert``'s self-check raises :class:`graphamp.PolicyDriftError`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import graphamp
from helpers import assert_exact

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _quiet_fp16_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", graphamp.EmulatedPrecisionWarning)
        yield


def _transformers(name: str):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    try:
        return getattr(transformers, name)
    except Exception as e:  # a model module whose optional imports fail here
        pytest.skip(f"transformers.{name} cannot be imported here: {type(e).__name__}: {e}")


# Converting under torch.no_grad: export records a model's own no_grad region only when grad is on.
# Without it, a bias the model computes without grad requires grad when the module runs with grad,
# and CPU SDPA then takes its math kernel where eager took the flash kernel (LayoutLMv3's relative
# position bias, census max abs 0.01).

SEQ, HEADS, HEAD_DIM = 16, 2, 16


class NoGradBiasAttention(nn.Module):
    """SDPA whose float mask is a learned bias the model reads under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)
        self.bias = nn.Parameter(torch.randn(1, HEADS, SEQ, SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        with torch.no_grad():
            mask = self.bias * 1.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_converted_under_no_grad_keeps_the_models_no_grad_region(dtype):
    torch.manual_seed(0)
    model, x = NoGradBiasAttention(), torch.randn(2, SEQ, HEADS * HEAD_DIM)
    with torch.no_grad():
        amp = graphamp.convert(model, (x,), dtype=DTYPES[dtype], self_check="off")
    assert_exact(model, amp, (x,), {}, DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_layoutlmv3_converted_under_no_grad(dtype):
    config_cls, model_cls = _transformers("LayoutLMv3Config"), _transformers("LayoutLMv3Model")
    torch.manual_seed(0)
    config = config_cls(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, input_size=32,
        patch_size=16, max_position_embeddings=64, max_2d_position_embeddings=128, coordinate_size=6,
        shape_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=100, rel_pos_bins=8,
        max_rel_pos=16, rel_2d_pos_bins=16, max_rel_2d_pos=32,
    )
    model = model_cls(config).eval()
    bbox = torch.randint(0, 60, (2, 7, 4))
    bbox[..., 2:] += bbox[..., :2]
    kwargs = dict(input_ids=torch.randint(0, 100, (2, 7)), bbox=bbox, pixel_values=torch.randn(2, 3, 32, 32))
    with torch.no_grad():
        amp = graphamp.convert(model, (), kwargs, dtype=DTYPES[dtype])  # its self-check runs with grad
    assert_exact(model, amp, (), kwargs, DTYPES[dtype])


# A mask eager drops by its values: transformers' masking_utils skips an all-ones padding mask after
# reading it (`mask.all()`), but under any trace (`is_tracing(tensor)` is True for a FakeTensor) it
# always materialises an fp32 additive mask of zeros. bf16 scores + an fp32 mask promote to fp32, so
# softmax and the returned attention weights are fp32 where eager's are bf16 (BridgeTower), or the
# attention program itself changes (PaliGemma: eager skips the causal mask and calls SDPA with
# is_causal=False, the trace keeps the causal mask; export differs from eager even in fp32).


class MaskDroppedWhenAllOnes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        if isinstance(mask, FakeTensor) or not bool(mask.all()):
            scores = scores + (1.0 - mask[:, None, :].float()) * -1e4
        return scores.softmax(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_eager_drops_by_value_is_detected_and_converted_on_values(dtype):
    torch.manual_seed(0)
    model = MaskDroppedWhenAllOnes()
    args = (torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.long))
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        assert model(*args).dtype == DTYPES[dtype]  # the construct: eager never adds the fp32 mask here
    with pytest.warns(graphamp.PolicyDriftWarning, match="comes back torch.float32"):  # export's program
        graphamp.convert(model, args, dtype=DTYPES[dtype], self_check="warn")
    amp = graphamp.convert(model, args, dtype=DTYPES[dtype])  # raising, convert captures it on values
    assert amp.graphamp_info.capture == "values"
    assert_exact(model, amp, args, {}, DTYPES[dtype])


def test_a_difference_another_conversion_fixes_is_not_located(monkeypatch):
    # Locating a difference (a run per node, or a torch.compile) is for the error the user sees:
    # where the capture on values is exact, convert never pays for it.
    import graphamp.self_check as self_check

    def not_expected(*args, **kwargs):
        raise AssertionError("located a difference that the capture on values makes exact")

    monkeypatch.setattr(self_check, "_first_divergence", not_expected)
    monkeypatch.setattr(self_check, "_torch_compile_verdict", not_expected)
    torch.manual_seed(0)
    model = MaskDroppedWhenAllOnes()
    args = (torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.long))
    amp = graphamp.convert(model, args, dtype=torch.bfloat16)
    assert amp.graphamp_info.capture == "values"
    assert_exact(model, amp, args, {}, torch.bfloat16)


# bf16 only: the mask's path does not depend on the dtype (fp16 took 15 s more of CI for the same path;
# the small MaskDroppedWhenAllOnes above runs both).
@pytest.mark.parametrize("dtype", ["bf16"])
def test_bridgetower_all_ones_mask_is_detected_and_converted_on_values(dtype):
    config_cls, model_cls = _transformers("BridgeTowerConfig"), _transformers("BridgeTowerModel")
    torch.manual_seed(0)
    config = config_cls(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100, max_position_embeddings=64),
        vision_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16),
    )
    model = model_cls(config).eval()
    kwargs = dict(input_ids=torch.randint(0, 100, (2, 7)), pixel_values=torch.randn(2, 3, 32, 32))
    with pytest.warns(graphamp.PolicyDriftWarning, match=r"attentions.*comes back torch.float32"):
        graphamp.convert(model, (), kwargs, dtype=DTYPES[dtype], self_check="warn")
    amp = graphamp.convert(model, (), kwargs, dtype=DTYPES[dtype])
    assert amp.graphamp_info.capture == "values"
    assert_exact(model, amp, (), kwargs, DTYPES[dtype])


def test_paligemma_skipped_causal_mask_is_detected_and_converted_on_values():
    config_cls = _transformers("PaliGemmaConfig")
    model_cls = _transformers("PaliGemmaForConditionalGeneration")
    torch.manual_seed(0)
    config = config_cls(
        text_config=dict(model_type="gemma", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, vocab_size=120, head_dim=16, use_cache=False),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=16),
        image_token_index=100, vocab_size=120, projection_dim=32,
    )
    model = model_cls(config).eval()
    ids = torch.cat([torch.full((2, 4), 100), torch.randint(0, 99, (2, 5))], 1)
    kwargs = dict(input_ids=ids, pixel_values=torch.randn(2, 3, 32, 32), use_cache=False)
    with pytest.warns(graphamp.PolicyDriftWarning, match="differs"):
        graphamp.convert(model, (), kwargs, dtype=torch.bfloat16, self_check="warn")
    amp = graphamp.convert(model, (), kwargs, dtype=torch.bfloat16)
    assert amp.graphamp_info.capture == "values"
    assert_exact(model, amp, (), kwargs, torch.bfloat16)


# A fake kernel narrower than the CPU kernel: torch 2.13's meta for aten::_grouped_mm admits only bf16
# (CUDA's checks), while the CPU kernel runs fp32. While graphamp traces with torch.export, fake
# tensors take it as the CPU kernel does (graphamp/capture/kernels.py), so the eager program is
# captured rather than the one torch.export would see (is_compiling() True).


class GroupedMatmulUnlessCompiling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        if torch.compiler.is_compiling():
            return torch.cat([x[: x.shape[0] // 2] @ self.w[0], x[x.shape[0] // 2 :] @ self.w[1]])
        return F.grouped_mm(x, self.w, offs=offs)


def test_fake_kernel_narrower_than_cpu_kernel():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        a, w = torch.randn(4, 16), torch.randn(2, 16, 8)
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            F.grouped_mm(a, w, offs=torch.tensor([2, 4], dtype=torch.int32))
    assert F.grouped_mm(torch.randn(4, 16), torch.randn(2, 16, 8), offs=torch.tensor([2, 4], dtype=torch.int32)).dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_eager_program_is_captured_past_a_narrow_fake_kernel(dtype):
    torch.manual_seed(0)
    model, x = GroupedMatmulUnlessCompiling(), torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.EagerPathWarning)
        amp = graphamp.convert(model, (x,), dtype=DTYPES[dtype])  # the self-check compares with eager
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        expected = model(x)
    assert torch.equal(amp(x), expected)


# A composite decomposed two ways: eager's C++ kernel of upsample_bicubic2d.vec calls the
# upsample_bicubic2d kernel, torch's Python decomposition (which OpOverload.decompose prefers) is
# index arithmetic that rounds otherwise in bf16 and fp16. graphamp decomposes as eager does (SAM2's
# position embeddings are interpolated so).


class InterpolatesAnActivation(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.lin, self.mode = nn.Linear(5, 5), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        corners = {} if self.mode == "nearest" else {"align_corners": False}
        return F.interpolate(self.lin(x), size=(8, 8), mode=self.mode, **corners)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "nearest"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_upsampling_a_low_precision_activation_follows_eagers_kernel(mode, dtype):
    torch.manual_seed(0)
    model, x = InterpolatesAnActivation(mode), torch.randn(2, 4, 5, 5)
    amp = graphamp.convert(model, (x,), dtype=DTYPES[dtype], self_check="off")
    assert_exact(model, amp, (x,), {}, DTYPES[dtype])
