"""The census's CI sample (tests/test_census_sample.py): one model per known failure cause, plus
models graphamp converts today, each with the checks it runs in CI.

``XFAIL`` names the checks that fail today for a cause other engineers are fixing
(/work/shared/measured/census-2026-11-24.md); the test marks them ``xfail(strict=False)``. A failure
that is not listed here is a new one and fails the test.
"""

from __future__ import annotations

CHEAP = ("convert_bf16", "grads_bf16")
ALL = ("convert_bf16", "convert_fp16", "grads_bf16", "batch", "backend")

# One model per cause in the 2026-11-24 census, with the check that shows it.
CAUSES: dict[str, tuple[str, ...]] = {
    "hf/paligemma": CHEAP,
    "hf/layoutlmv3": CHEAP,
    "hf/qwen3_next": CHEAP,
    "hf/bridgetower": CHEAP,
    "hf/convbert": CHEAP,
    "hf/roformer": CHEAP,
    "hf/big_bird": CHEAP,
    "hf/longformer": CHEAP,
    "hf/vilt": CHEAP,
    "hf/detr": CHEAP,
    "hf/t5gemma": CHEAP,
    "hf/swin": ("convert_bf16", "batch"),
    "hf/idefics3_vision": CHEAP,
    "hf/smolvlm_vision": CHEAP,
    "hf/qwen3": ("convert_bf16", "backend"),
    "hf/deberta_v2": ("convert_bf16", "backend"),
}

# Models graphamp converts today, across families; a few run every check.
CONVERTING: dict[str, tuple[str, ...]] = {
    "hf/bert": ALL,
    "hf/llama": ALL,
    "hf/gpt2": CHEAP,
    "hf/t5": CHEAP,
    "hf/vit": ("convert_bf16", "grads_bf16", "batch"),
    "hf/resnet": CHEAP,
    "hf/distilbert": CHEAP,
    "hf/roberta": CHEAP,
    "hf/albert": CHEAP,
    "hf/electra": CHEAP,
    "hf/bart": CHEAP,
    "hf/mistral": ("convert_bf16", "convert_fp16", "grads_bf16"),
    "hf/qwen2": CHEAP,
    "hf/gemma": CHEAP,
    "hf/phi": CHEAP,
    "hf/gpt_neox": CHEAP,
    "hf/opt": CHEAP,
    "hf/bloom": CHEAP,
    "hf/falcon": CHEAP,
    "hf/mobilebert": CHEAP,
    "hf/deit": CHEAP,
    "hf/convnext": CHEAP,
    "hf/beit": CHEAP,
    "hf/wav2vec2": CHEAP,
    "hf/whisper": CHEAP,
    "hf/mobilevit": CHEAP,
    "timm/resnet18": ALL,
    "timm/vit_tiny_patch16_224": CHEAP,
    "timm/convnext_atto": CHEAP,
    "timm/mobilenetv3_small_050": CHEAP,
    "diffusers/unet2d_condition": CHEAP,
    "diffusers/autoencoder_kl": CHEAP,
    "diffusers/dit": ("convert_bf16", "grads_bf16", "backend"),
}

SAMPLE: dict[str, tuple[str, ...]] = {**CAUSES, **CONVERTING}

# (model, check) -> the cause, for the checks that fail today and are being fixed.
XFAIL: dict[tuple[str, str], str] = {}
