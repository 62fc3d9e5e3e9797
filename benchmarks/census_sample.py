"""The census's CI sample (tests/test_census_sample.py): one model per known failure cause, plus
models graphamp converts today, each with the checks it runs in CI.

``KNOWN`` names the checks that are not bitwise today, with their cause (the census of 2026-11-24
and this session's); the test accepts such a check only when graphamp reports it (a typed error or
a graphamp warning): never a silent difference. A check not listed must be bitwise.
"""

from __future__ import annotations

CHEAP = ("convert_bf16", "grads_bf16")
ALL = ("convert_bf16", "convert_fp16", "grads_bf16", "batch", "backend")

# One model per cause in the 2026-11-24 census, with the check that shows it (the full census runs
# every check on them): a forward cause in convert_bf16, a gradient cause in grads_bf16, a model
# torch.export refused in convert_bf16 (the train-mode conversion takes the same capture).
FORWARD = ("convert_bf16",)
GRADS = ("grads_bf16",)
CAUSES: dict[str, tuple[str, ...]] = {
    # A cause whose smallest model already has its own regression test is tested there, not here
    # (the census's model of the same cause took 11-26 s of CI's sample each):
    # - PaliGemma's causal mask skipped by value, BridgeTower's all-ones mask (and its fp32
    #   attentions) and LayoutLMv3: tests/test_forward_regressions.py;
    # - DETR's is_causal as a SymBool: tests/test_capture_fallback.py::test_detr_converts_static_and_takes_other_shapes;
    # - torch.export refusing a data-dependent branch (ViLT, Longformer): FSMT in
    #   tests/test_capture_fallback.py::test_fsmt_converts_with_graph_breaks_and_is_exact;
    # - the BERT-derived embedding gradients (BigBird, RoFormer, ...): RoFormer in
    #   tests/test_grad_regressions.py; ConvBERT stays here for the cause;
    # - Swin's batch-1 branch (the "batch" cause): a smaller Swin in
    #   tests/test_capture_fallback.py::test_swin_takes_batch_one_after_batch_two (the census's
    #   Swin took 89-123 s: torch.export's sympy work on its symbolic window sizes). diffusers' UNet
    #   branches on batch 1 too (19 s in CI's sample, 10 of them building it): left to the full census.
    "hf/qwen3_next": FORWARD,
    "hf/convbert": GRADS,
    "hf/t5gemma": FORWARD,
    "hf/idefics3_vision": FORWARD,
    "hf/smolvlm_vision": FORWARD,
    "hf/qwen3": ("convert_bf16", "backend"),
    "hf/deberta-v2": ("convert_bf16", "backend"),
    # Causes of the census of 2026-11-26: a keyword mask dropped by value (converted without it),
    # the backend outside autocast on code reading dtypes, and a backend program eager does not run.
    "hf/mpnet": CHEAP,
    "hf/glm4": ("backend",),
    "hf/aimv2": ("backend",),
    # 2026-11-27: maybe_autocast(enabled=False) leaves no region in dynamo's graph outside autocast.
    "hf/flint": ("backend",),
    # 2026-11-30: after a graph break the frame cannot run eagerly without autocast (a bf16 hidden
    # state into an fp32 linear), and its rotary q.to(orig_dtype) must still follow eager's bf16.
    "hf/cohere_compass_vision": ("backend", "backend_autocast"),
    # Eager autocast itself hands SDPA an fp32 query and a bf16 value after a graph break: outside
    # autocast a typed GraphBreakError (known below), inside autocast bitwise.
    "hf/glm5_next_vision": ("backend", "backend_autocast"),
    # A frame dynamo skips (a graph break in a loop) runs eagerly, in fp32 outside autocast: GLM-4V's
    # vision tower after its blocks loop (its nn.Conv2d), EnCodec's encoder (nn.LSTM on a bf16 input).
    "hf/glm4v_vision": ("backend",),
    "hf/encodec": ("backend",),
}

# Models graphamp converts today, across families; a few run every check. (T5's outputs and
# gradients are in tests/test_grad_zoo.py.)
CONVERTING: dict[str, tuple[str, ...]] = {
    "hf/bert": ALL,
    "hf/llama": ALL,
    "hf/gpt2": CHEAP,
    "hf/bart": CHEAP,
    "hf/vit": ("convert_bf16", "grads_bf16", "batch"),
    "hf/mistral": CHEAP,
    "timm/resnet18": ALL,
    # Train-mode outputs and every gradient only: the eval-mode conversion runs on the models above
    # (and the UNet's batch check), and these took 3-10 s more each for it in CI's sample.
    **dict.fromkeys(("hf/resnet", "hf/gemma", "hf/wav2vec2", "hf/whisper", "timm/vit_tiny_patch16_224", "timm/convnext_atto"), GRADS),
    "diffusers/dit": ("convert_bf16", "grads_bf16", "backend"),
    # More of the population, bitwise on every check in the census of 2026-11-26 and among its
    # fastest: train-mode outputs and every gradient here (the eval-mode convert runs on the models
    # above).
    **dict.fromkeys((
        "hf/albert", "hf/blenderbot", "hf/fnet", "hf/opt", "hf/distilbert", "hf/clipseg", "hf/llava", "hf/convnextv2",
        "hf/canine", "hf/olmo", "hf/ernie", "hf/electra", "hf/modernbert", "hf/gemma2", "timm/repvgg_a0", "timm/lcnet_050",
    ), GRADS),
}

SAMPLE: dict[str, tuple[str, ...]] = {**CAUSES, **CONVERTING}

# (model, check) -> the cause, for the checks that are not bitwise today: the test accepts them only
# when graphamp reports the difference (raises or warns), never a silent one. The causes of
# 2026-11-24 and 2026-11-26 are fixed (the capture on values, the dynamo fallback, the backend's
# eager regions and dropped masks); what is left is a refusal by design.
KNOWN: dict[tuple[str, str], str] = {
    ("hf/glm5_next_vision", "backend"): "GraphBreakError: after a graph break, SDPA meets the fp32 query and bf16 value eager autocast itself passes it",
    ("hf/glm4v_vision", "backend"): "EagerPathWarning naming the outputs: the frame dynamo skips runs its nn.Conv2d in fp32",
    ("hf/encodec", "backend"): "GraphBreakError: the frame dynamo skips hands nn.LSTM a bf16 input outside autocast",
}
