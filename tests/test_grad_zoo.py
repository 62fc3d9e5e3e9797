"""The gradient zoo: modern decoders, an encoder-decoder and timm vision models, in train mode.

Outputs, output dtypes and every parameter's gradient must be torch.equal to eager
torch.autocast("cpu", dtype), in bf16 and fp16. One conversion per (family, dtype), shared by the
tests of that pair. Models are tiny (hidden 64, 2 layers, batch 2, sequence 16), random weights.
"""

from __future__ import annotations

import pytest
import torch

import graphamp
import decoder_zoo
from helpers import assert_same_outputs, run_converted, run_eager

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAMILIES = [*decoder_zoo.DECODERS, *decoder_zoo.ENCODER_DECODERS]
FACTORIES = {**decoder_zoo.DECODERS, **decoder_zoo.ENCODER_DECODERS}
# Families also checked at other (batch, seq) sizes than the conversion example's.
OTHER_SHAPES = {"llama": [(3, 5), (1, 11)], "gpt_neox": [(3, 5), (1, 11)], "t5": [(3, 6)]}


def assert_all_grads_equal(got: dict, want: dict) -> None:
    """Every gradient torch.equal; on failure, name all that differ with their max |diff|."""
    assert want, "the model produced no gradients; the check would be empty"
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    bad = {n: (got[n].double() - want[n].double()).abs().max().item() for n in want if not torch.equal(got[n], want[n])}
    assert not bad, (
        f"{len(bad)} of {len(want)} parameter grads differ from eager autocast (max |diff| "
        f"{max(bad.values()):.3g}): " + ", ".join(f"{n} {d:.3g}" for n, d in bad.items())
    )


def assert_exact_train(model, amp, args, kwargs, dtype) -> None:
    ref, ref_grads = run_eager(model, args, kwargs, dtype, grads=True)
    out, out_grads = run_converted(amp, model, args, kwargs, grads=True)
    assert_same_outputs(out, ref)
    assert_all_grads_equal(out_grads, ref_grads)


_converted: dict = {}


def converted(name: str, dtype: str):
    """(case, AmpModule) for one family and dtype, converted once per test session."""
    if (name, dtype) not in _converted:
        case = FACTORIES[name]()
        args, kwargs = case.inputs
        _converted[name, dtype] = case, graphamp.convert(case.model, args, kwargs, dtype=DTYPES[dtype])
    return _converted[name, dtype]


@pytest.fixture(scope="module", autouse=True)
def _drop_conversions():
    yield
    _converted.clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_outputs_and_every_grad(name, dtype):
    case, amp = converted(name, dtype)
    args, kwargs = case.inputs
    assert case.model.training
    assert_exact_train(case.model, amp, args, kwargs, DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OTHER_SHAPES))
def test_forward_at_other_shapes(name, dtype):
    case, amp = converted(name, dtype)
    for batch, seq in OTHER_SHAPES[name]:
        args, kwargs = case.make_inputs(batch, seq)
        ref, _ = run_eager(case.model, args, kwargs, DTYPES[dtype], grads=False)
        out, _ = run_converted(amp, case.model, args, kwargs, grads=False)
        assert_same_outputs(out, ref)


def test_config_uses_grouped_query_attention():
    # The families that support it run with fewer key/value heads than query heads.
    for name in ("llama", "mistral", "qwen2", "phi3"):
        cfg = converted(name, "bf16")[0].model.config
        assert cfg.num_key_value_heads < cfg.num_attention_heads, name
    cfg = converted("falcon", "bf16")[0].model.config
    assert cfg.new_decoder_architecture and cfg.num_kv_heads < cfg.num_attention_heads


def test_dropout_kept_with_the_same_rng_state():
    # With dropout on, eager and the graph draw the same masks from the same generator state.
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.GPTNeoXConfig(
        vocab_size=decoder_zoo.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.1, hidden_dropout=0.1,
        use_cache=False,
    )
    model = tf.GPTNeoXForCausalLM(cfg).train()
    kwargs = {"input_ids": torch.randint(0, decoder_zoo.VOCAB, (2, 16))}
    amp = graphamp.convert(model, (), kwargs, dtype=torch.bfloat16)
    torch.manual_seed(1)
    ref, ref_grads = run_eager(model, (), kwargs, torch.bfloat16, grads=True)
    torch.manual_seed(1)
    out, out_grads = run_converted(amp, model, (), kwargs, grads=True)
    assert_same_outputs(out, ref)
    assert_all_grads_equal(out_grads, ref_grads)
    torch.manual_seed(2)
    other, _ = run_eager(model, (), kwargs, torch.bfloat16, grads=False)
    assert not torch.equal(other.logits, ref.logits), "dropout had no effect; the check would be empty"


@pytest.mark.parametrize("example", ["padded", "all_ones"])
def test_llama_attention_mask_values(example):
    # Eager transformers reads the mask's values: an all-ones mask is dropped (SDPA runs is_causal,
    # with enable_gqa for grouped-query attention), a padded one is materialized (K/V heads
    # repeated). One graph holds the example's program and guards the read, so a mask of the other
    # kind gets a graph of its own: outputs and gradients match eager for both, and no warning is
    # needed (none about masks is given).
    import warnings

    case = decoder_zoo.llama()
    ids = case.inputs[1]["input_ids"]
    padded = torch.ones_like(ids)
    padded[0, -1] = 0
    masks = {"padded": padded, "all_ones": torch.ones_like(ids)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.EagerPathWarning)
        amp = graphamp.convert(case.model, (), {"input_ids": ids, "attention_mask": masks[example]}, dtype=torch.bfloat16)
    assert_exact_train(case.model, amp, (), {"input_ids": ids, "attention_mask": masks[example]}, torch.bfloat16)
    other = masks["all_ones" if example == "padded" else "padded"]
    assert_exact_train(case.model, amp, (), {"input_ids": ids, "attention_mask": other}, torch.bfloat16)


# timm: a CNN and a ViT, random weights.
TIMM_MODELS = {
    "cnn": dict(model_name="resnet10t", num_classes=10),
    "vit": dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10),
}


def _timm():
    try:
        import timm
    except Exception as e:  # ImportError, or torchvision's RuntimeError on import
        pytest.skip(
            f"timm cannot be imported here ({type(e).__name__}: {e}). timm needs torchvision, and the "
            "torchvision wheel on PyPI is built against CUDA torch: its C++ ops (libtorch_cuda.so) do not "
            "load against this CPU torch 2.13.0 ('operator torchvision::nms does not exist'), and a plain "
            "`pip install timm` would replace torch with a multi-GB CUDA build"
        )
    return timm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(TIMM_MODELS))
def test_timm(kind, dtype):
    timm = _timm()
    torch.manual_seed(0)
    model = timm.create_model(pretrained=False, **TIMM_MODELS[kind]).train()
    args = (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),)
    amp = graphamp.convert(model, args, dtype=DTYPES[dtype])
    assert_exact_train(model, amp, args, {}, DTYPES[dtype])
