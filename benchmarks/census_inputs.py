"""Inputs (and a few config values) for the census's transformers models beyond one tensor per
argument (census_models._hf_input): images packed as patch rows with their grid (Qwen2-VL's vision
towers), videos, time series, waveforms with a channel axis, and a small table of per-model inputs
and config fixes, each saying why. Every input is what a user passes: valid shapes, ids within the
vocabulary, masks of ones.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Images per example in packed form: a grid of GRID x GRID patches, one frame.
GRID = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _get(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` set on ``config`` or its vision/audio sub-configs."""
    for c in (config, *(getattr(config, s, None) for s in ("vision_config", "audio_config", "encoder_config", "backbone_config"))):
        for n in names:
            v = getattr(c, n, None) if c is not None else None
            if v is not None:
                return v
    return default


def _int(v: Any, default: int) -> int:
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


# ---------------------------------------------------------------- images packed as patch rows

# The grid argument of a packed-patch vision tower: (images, 3) rows of [frames, height, width] in patches.
GRID_ARGS = ("grid_thw", "image_grid_thw")


def packed_arg(required: list[str]) -> str | None:
    """The patch-rows argument of a vision tower that takes its image as rows of flattened patches
    with their grid (Qwen2-VL's ``hidden_states, grid_thw``, HunYuan-VL's ``pixel_values, grid_thw``)."""
    if not any(g in required for g in GRID_ARGS):
        return None
    return next((a for a in ("hidden_states", "pixel_values") if a in required), None)


def _patch_width(model: nn.Module) -> int:
    """The length of one patch row: what the model's first patch embedding (its first convolution
    or linear layer) takes: channels x frames x patch x patch."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            n = m.in_channels
            for k in m.kernel_size:
                n *= k
            return n
        if isinstance(m, nn.Linear):
            return m.in_features
    raise ValueError("no patch embedding")


def packed_patches(model: nn.Module, config: Any, arg: str, grid_arg: str, b: int, seed: int) -> dict[str, torch.Tensor]:
    """``b`` images of GRID x GRID patches (a multiple of every merge size: 2 x 2 patches make one
    token), one frame each, as the processors of these models pack them."""
    rows = b * GRID * GRID
    out = {arg: torch.randn(rows, _patch_width(model), generator=_gen(seed)), grid_arg: torch.tensor([[1, GRID, GRID]] * b)}
    return out


# ---------------------------------------------------------------- time series


def _series_length(config: Any) -> int:
    """The history a forecaster takes: its context, plus its largest lag (GluonTS-style models,
    Informer, Autoformer, read lags that far back), at most 64 steps of a long context (TimesFM's
    512), a whole number of patches."""
    context = _int(getattr(config, "context_length", None), 32)
    lags = getattr(config, "lags_sequence", None) or [0]
    patch = _int(getattr(config, "patch_length", None), 1)
    if context > 64:
        context = max(patch, 64 // patch * patch)
    return context + max(lags)


def series_input(name: str, config: Any, b: int, seed: int) -> torch.Tensor | None:
    """The time-series forecasters' inputs (PatchTST, TimesFM, Informer, ...): history values, its
    observed mask (all observed), time features, TimesFM's padding (none) and frequency class (0)."""
    length = _series_length(config)
    channels = _int(getattr(config, "num_input_channels", None), 0) or _int(getattr(config, "input_size", None), 1)
    if name == "past_values":
        shape = (b, length) if channels == 1 and not hasattr(config, "num_input_channels") else (b, length, channels)
        return torch.randn(*shape, generator=_gen(seed))
    if name in ("past_observed_mask", "observed_mask"):
        return torch.ones(series_input("past_values", config, b, seed).shape)
    if name == "past_time_features":
        features = _int(getattr(config, "num_time_features", None), 0) + _int(getattr(config, "num_dynamic_real_features", None), 0)
        return torch.randn(b, length, features, generator=_gen(seed + 1))
    if name == "future_values":
        shape = series_input("past_values", config, b, seed).shape
        return torch.randn(b, _int(getattr(config, "prediction_length", None), 8), *shape[2:], generator=_gen(seed + 2))
    if name == "future_time_features":
        features = series_input("past_time_features", config, b, seed).shape[-1]
        return torch.randn(b, _int(getattr(config, "prediction_length", None), 8), features, generator=_gen(seed + 3))
    if name == "past_values_padding":
        return torch.zeros(b, length)
    if name == "freq":
        return torch.zeros(b, 1, dtype=torch.long)
    return None


def series_targets(params: Any) -> list[str]:
    """A GluonTS-style forecaster (Informer, Autoformer, ...) trains on its history and the values to
    forecast, with their time features: the decoder runs on them (without, Autoformer runs its
    encoder only)."""
    return ["future_values", "future_time_features"] if "past_time_features" in params and "future_values" in params else []


# ---------------------------------------------------------------- the table

def _kimi_patches(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Kimi-K2.5's patch embedding is a Conv2d on (patches, channels, patch, patch), not on rows.
    p, c = _int(_get(config, "patch_size"), 14), _int(_get(config, "num_channels", "in_channels"), 3)
    return {"pixel_values": torch.randn(b * GRID * GRID, c, p, p, generator=_gen(seed))}


def _video_llama_3_merge(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # VideoLLaMA3's vision tower takes each image's merge size too: 1 for images (its processor's).
    return {"merge_sizes": torch.ones(b, dtype=torch.long)}


def _inkling2_patches(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Inkling2 counts its grid in language-model tokens (2 x 2 patches each) and takes one
    # (patch * merge, patch * merge, channels) square of pixels per token, in [-1, 1].
    p, m = _int(_get(config, "patch_size"), 20), _int(_get(config, "spatial_merge_size"), 2)
    c, g = _int(_get(config, "num_channels"), 3), GRID // m
    return {"pixel_values": torch.rand(b * g * g, p * m, p * m, c, generator=_gen(seed)) * 2 - 1, "image_grid_thw": torch.tensor([[1, g, g]] * b)}


def _ids(config: Any, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    import census_models  # the census's own token ids: low, none of them special

    return census_models._token_ids(config, shape, seed)


def _size(config: Any) -> tuple[int, int]:
    """The image (height, width) the config names: both of a [height, width] pair."""
    size = _get(config, "image_size", "img_size", default=64)
    return (size[0], size[1]) if isinstance(size, (list, tuple)) and len(size) == 2 else (_int(size, 64),) * 2


def _pixels(config: Any, b: int, seed: int, *lead: int) -> torch.Tensor:
    return torch.randn(b, *lead, _int(_get(config, "num_channels", "in_channels"), 3), *_size(config), generator=_gen(seed))


def _sized_image(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # ViTPose (256 x 192), MGP-STR (32 x 128): the model checks its input is the config's (height,
    # width); the census's square image (the first of the two) fails that check.
    return {"pixel_values": _pixels(config, b, seed)}


def _seggpt(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # SegGPT segments an image after a prompt image and its mask, each half of the config's
    # 896 x 448 (it stacks the prompt above the image).
    h, w = _size(config)
    c = _int(_get(config, "num_channels"), 3)
    return {k: torch.randn(b, c, h // 2, w, generator=_gen(seed + i)) for i, k in enumerate(("pixel_values", "prompt_pixel_values", "prompt_masks"))}


def _patch_rows(config: Any, b: int, n: int, seed: int) -> torch.Tensor:
    p, c = _int(_get(config, "patch_size"), 16), _int(_get(config, "num_channels", "in_channels"), 3)
    return torch.randn(b, n, c * p * p, generator=_gen(seed))


def _siglip2(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # SigLIP2 (NaFlex) takes an image as a padded sequence of flattened patches, with the patches'
    # mask (all real) and the grid they came from.
    return {"pixel_values": _patch_rows(config, b, GRID * GRID, seed), "pixel_attention_mask": torch.ones(b, GRID * GRID, dtype=torch.long),
            "spatial_shapes": torch.tensor([[GRID, GRID]] * b)}


def _gemma4_vision(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Gemma 4's vision tower takes flattened patches and their (x, y) positions, a grid that its
    # pooling kernel (3 x 3) divides.
    k = 2 * _int(_get(config, "pooling_kernel_size"), 3)
    xy = torch.stack(torch.meshgrid(torch.arange(k), torch.arange(k), indexing="xy"), -1).reshape(1, k * k, 2)
    return {"pixel_values": _patch_rows(config, b, k * k, seed), "pixel_position_ids": xy.expand(b, -1, -1).clone()}


def _boxes(b: int, n: int, seed: int) -> torch.Tensor:
    """(b, n, 4) boxes (x0, y0, x1, y1) in [0, 1], x0 <= x1 and y0 <= y1."""
    a, c = torch.rand(b, n, 2, generator=_gen(seed)), torch.rand(b, n, 2, generator=_gen(seed + 1))
    return torch.cat([torch.minimum(a, c), torch.maximum(a, c)], -1)


def _lxmert(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # LXMERT reads detected regions beside the text: each region's features and its box.
    n = 4
    return {"visual_feats": torch.randn(b, n, config.visual_feat_dim, generator=_gen(seed)), "visual_pos": _boxes(b, n, seed + 1)}


def _decision_transformer(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # A Decision Transformer reads a trajectory: states, actions, rewards, returns to go, time steps.
    t = 8
    g = _gen(seed)
    return {"states": torch.randn(b, t, config.state_dim, generator=g), "actions": torch.randn(b, t, config.act_dim, generator=g),
            "rewards": torch.randn(b, t, 1, generator=g), "returns_to_go": torch.randn(b, t, 1, generator=g),
            "timesteps": torch.arange(t).expand(b, t).clone(), "attention_mask": torch.ones(b, t, dtype=torch.long)}


def _perceiver_text(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Perceiver's text classifier names its token ids `inputs`.
    return {"inputs": _ids(config, (b, 8), seed), "attention_mask": torch.ones(b, 8, dtype=torch.long)}


def _image_pair(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Keypoint matchers (LoFTR, LightGlue, SuperGlue) take a pair of images per example.
    size = 64
    return {"pixel_values": torch.rand(b, 2, 3, size, size, generator=_gen(seed))}


def _pix2struct(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Pix2Struct takes its image as flattened patches, each row led by its (row, column), from 1.
    n, width = GRID * GRID, config.vision_config.patch_embed_hidden_size
    rows, cols = torch.meshgrid(torch.arange(1, GRID + 1), torch.arange(1, GRID + 1), indexing="ij")
    place = torch.stack([rows.flatten(), cols.flatten()], -1).float().expand(b, n, 2)
    return {"flattened_patches": torch.cat([place, torch.randn(b, n, width, generator=_gen(seed))], -1), "attention_mask": torch.ones(b, n, dtype=torch.long)}


def _kosmos2(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Kosmos-2's text holds one place per latent query of the image (64), after <s><image>: the
    # image embeds go where image_embeds_position_mask is 1.
    q, n = config.latent_query_num, 8
    mask = torch.zeros(b, q + 2 + n, dtype=torch.long)
    mask[:, 2 : 2 + q] = 1
    return {"pixel_values": _pixels(config.vision_config, b, seed), "input_ids": _ids(config.text_config, (b, q + 2 + n), seed + 1),
            "image_embeds_position_mask": mask, "attention_mask": torch.ones(b, q + 2 + n, dtype=torch.long)}


def _gemma3n_audio(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Gemma 3n's audio encoder takes log-mel frames and their padding mask (True = padding: none).
    t = 64
    return {"audio_mel": torch.randn(b, t, config.input_feat_size, generator=_gen(seed)), "audio_mel_mask": torch.zeros(b, t, dtype=torch.bool)}


def _ast(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # The Audio Spectrogram Transformer's input_values are a spectrogram: (frames, mel bins) of the config's.
    return {"input_values": torch.randn(b, config.max_length, config.num_mel_bins, generator=_gen(seed))}


def _features_mask(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Qwen3-ASR's and Fun-ASR's encoders take their features' frame mask (all frames real).
    import census_models

    features = census_models._hf_input("input_features", config, b, seed, main="input_features")
    return {"input_features": features, "input_features_mask": torch.ones(b, features.shape[-1], dtype=torch.long)}


def _qwen3_asr(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Qwen3-ASR's encoder takes mel frames in whole chunks of 2 x n_window (100), and their mask.
    t = 4 * config.n_window
    return {"input_features": torch.randn(b, config.num_mel_bins, t, generator=_gen(seed)), "input_features_mask": torch.ones(b, t, dtype=torch.long)}


def _fun_asr(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Fun-ASR's encoder takes low-frame-rate features: frames first, each 7 stacked mel frames.
    t = 32
    return {"input_features": torch.randn(b, t, config.num_mel_bins * config.num_stacked_frames, generator=_gen(seed)), "input_features_mask": torch.ones(b, t, dtype=torch.long)}


def _clap(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # CLAP's audio tower takes (batch, 1, frames, mel bins): 10 s of 48 kHz audio is 1001 frames.
    return {"input_features": torch.randn(b, 1, 1001, config.audio_config.num_mel_bins, generator=_gen(seed))}


def _clvp(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # CLVP's conditioning encoder takes (batch, mel bins, frames) of its decoder's 80 bins.
    return {"input_features": torch.randn(b, config.decoder_config.feature_size, 100, generator=_gen(seed))}


def _voxtral_realtime(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Voxtral Realtime streams audio beside its text: the mel frames of as many tokens as the text.
    import census_models

    features = census_models._hf_input("input_features", config, b, seed, main="input_ids")
    frames = features.shape[-1] * seq // census_models.SEQ
    return {"input_features": torch.randn(b, features.shape[1], frames, generator=_gen(seed))}


# The placeholder id of BLIP-2's image (InstructBLIP-Video's video) tokens: the default configs name
# none, and the model puts its query outputs where input_ids hold it. Within the tiny vocabulary,
# above the ids the census draws.
QUERY_TOKEN = 255


def _query_prompt(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # BLIP-2 and InstructBLIP: the prompt holds one placeholder per query token (32) of the image
    # (of each of InstructBLIP-Video's 4 frames) before its text; the mask covers both.
    frames = 4 if hasattr(config, "video_token_index") else 1
    q = config.num_query_tokens * frames
    ids = torch.cat([torch.full((b, q), QUERY_TOKEN), _ids(config, (b, seq), seed)], 1)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if frames > 1:
        out["pixel_values"] = _pixels(config.vision_config, b, seed + 1, frames)
    return out


def _stacked_features(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Granite Speech 5's encoder takes frames first, each several mel frames stacked (320 wide):
    # what its first (input) linear layer takes.
    return {"input_features": torch.randn(b, 32, _patch_width(model), generator=_gen(seed))}


def _gemma4_audio(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # Gemma 4's audio tower takes frames first of its feature extractor's 128 mel bins (the config
    # names no bins; its subsampling convolutions are sized for 128).
    return {"input_features": torch.randn(b, 64, 128, generator=_gen(seed))}


def _blip2_qformer(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # BLIP-2's Q-Former alone runs its learned query tokens (here given) over the image features.
    return {"query_embeds": torch.randn(b, 8, config.hidden_size, generator=_gen(seed)),
            "encoder_hidden_states": torch.randn(b, 16, config.encoder_hidden_size, generator=_gen(seed + 1))}


def _embeds(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # A model that takes embeddings, not ids, as its only input (Nemotron-3.5's word-timestamp head).
    return {"inputs_embeds": torch.randn(b, 8, config.hidden_size, generator=_gen(seed))}


def _musicgen(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # MusicGen's decoder takes one row of audio codes per codebook: (batch x codebooks, length).
    return {"input_ids": _ids(config, (b * config.num_codebooks, seq), seed)}


def _oneformer(model: nn.Module, config: Any, b: int, seed: int, seq: int) -> dict[str, Any]:
    # OneFormer takes the tokenized task ("the task is semantic") beside the image.
    return {"task_inputs": _ids(config, (b, config.task_seq_len), seed + 1)}


# model_type -> a function (model, config, batch, seed, seq) adding or replacing inputs; seq is the
# length of input_ids where the model takes them. Each entry says why.
Maker = Callable[[nn.Module, Any, int, int, int], dict[str, Any]]
TABLE: dict[str, Maker] = {
    "kimi_k25_vision": _kimi_patches,
    "video_llama_3_vision": _video_llama_3_merge,
    "inkling2_vision": _inkling2_patches,
    **dict.fromkeys(("vitpose", "vitpose_backbone", "mgp-str"), _sized_image),
    "seggpt": _seggpt,
    **dict.fromkeys(("siglip2", "siglip2_vision_model"), _siglip2),
    "gemma4_vision": _gemma4_vision,
    "lxmert": _lxmert,
    "decision_transformer": _decision_transformer,
    "perceiver": _perceiver_text,
    **dict.fromkeys(("efficientloftr", "lightglue", "superglue"), _image_pair),
    "pix2struct": _pix2struct,
    "kosmos-2": _kosmos2,
    "gemma3n_audio": _gemma3n_audio,
    "audio-spectrogram-transformer": _ast,
    "audioflamingo3_encoder": _features_mask,
    "qwen3_asr_encoder": _qwen3_asr,
    "fun_asr_nano_encoder": _fun_asr,
    "clap": _clap,
    **dict.fromkeys(("granite_speech5_encoder", "granite_speech5_ctc"), _stacked_features),
    "gemma4_audio": _gemma4_audio,
    "clvp": _clvp,
    "voxtral_realtime": _voxtral_realtime,
    "blip_2_qformer": _blip2_qformer,
    "nemotron3_5_transcribe_word_timestamp": _embeds,
    **dict.fromkeys(("musicgen", "musicgen_melody"), _musicgen),
    "oneformer": _oneformer,
    **dict.fromkeys(("blip-2", "instructblip", "instructblipvideo"), _query_prompt),
    "speech-encoder-decoder": lambda model, config, b, seed, seq: {"inputs": torch.randn(b, 3200, generator=_gen(seed))},  # its waveform is named `inputs`
}

# model_type -> optional arguments the model needs beside its main input, made by the census's
# generic rules (census_models._hf_input). Each entry says why.
EXTRA_ARGS: dict[str, tuple[str, ...]] = {
    "bros": ("bbox",),  # a layout model: every token's box on the page
    "udop": ("bbox", "pixel_values"),  # layout: the tokens' boxes and the page image
    "tvp": ("pixel_values",),  # TVP grounds its text in a video
    **dict.fromkeys(("sam3", "sam3_lite_text"), ("input_ids",)),  # SAM 3 segments what its text prompt names
    "sam3_lite_text_text_model": ("input_ids",),  # its main_input_name (pixel_values) is inherited
    "oneformer": ("pixel_values",),
}


def _text(d: dict[str, Any]) -> dict[str, Any]:
    """The text config's dict within ``d`` (itself for a text-only config), to change in place."""
    return d["text_config"] if isinstance(d.get("text_config"), dict) else d


def _glm4v_rope(d: dict[str, Any], head_dim: int | None = None) -> dict[str, Any]:
    # GLM-4V's text model splits its rotary frequencies [8, 12, 12] (its default when the config
    # names none) among time, height and width: half of a rotary dimension of 64, GLM-4.1V's partial
    # rotary factor 0.5 of its 128-wide heads (GLM-4.5V: 96 heads of 128 in a width of 4096). The
    # default configs leave the factor at 1.0 (and GLM-4.5V's heads 4096 / 96 wide), which their own
    # models cannot run; written into the config, the section shrinks with the head (_scale_mrope).
    text = _text(d)
    text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5}
    if head_dim:
        text["head_dim"] = head_dim
    return d


# model_type -> a function changing a copy of the default config's dict before the shrink. Each says why.
CONFIG_FIXES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    **dict.fromkeys(("glm4v", "glm4v_text", "glm46v", "glmga", "glm_image", "glm_image_text"), _glm4v_rope),
    **dict.fromkeys(("glm4v_moe", "glm4v_moe_text"), lambda d: _glm4v_rope(d, head_dim=128)),
    # DBRX's attention reads rope_theta and clip_qkv from its attention config, which the default
    # leaves out and None (its model clamps to None): DBRX's released values, 500000 and 8.
    "dbrx": lambda d: {**d, "attn_config": {**d["attn_config"], "rope_theta": 500000.0, "clip_qkv": 8.0}},
    # X-MOD needs a language to pick its adapters: the config's only one (en_XX).
    "xmod": lambda d: {**d, "default_language": d["languages"][0]},
    # Perceiver's latent array has sizes the shrink's name patterns miss (1280-wide, 256 of them,
    # 26 self-attention layers, 8 heads): a tiny Perceiver has them small too.
    "perceiver": lambda d: {**d, "d_latents": 64, "num_latents": 32, "num_self_attends_per_block": 2, "num_self_attention_heads": 2, "num_cross_attention_heads": 2},
    # TVP pads 48 video frames of 448 pixels with a learned prompt; the census's videos are 4 frames of 64.
    "tvp": lambda d: {**d, "max_img_size": 64, "visual_prompt_size": 8, "num_frames": 4},
    # BLIP-2, InstructBLIP(-Video): the image placeholder of their prompts (see QUERY_TOKEN).
    **dict.fromkeys(("blip-2", "instructblip"), lambda d: {**d, "image_token_index": QUERY_TOKEN}),
    # InstructBLIP-Video's 4 frames of 32 query placeholders and the text would exceed the shrunk
    # language model's 128 positions: a tiny model with 8 queries.
    "instructblipvideo": lambda d: {**d, "video_token_index": QUERY_TOKEN, "num_query_tokens": 8},
    # Reformer's LM head refuses a config that is not a decoder (its checkpoints set is_decoder).
    "reformer": lambda d: {**d, "is_decoder": True},
    # TimmBackbone wraps a timm model by name; the census has timm: its ResNet-18, no weights.
    "timm_backbone": lambda d: {**d, "backbone": "resnet18", "use_pretrained_backbone": False},
}


def fixed_config(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """The config dict ``d`` with CONFIG_FIXES[model_type] applied (a copy where one applies)."""
    fix = CONFIG_FIXES.get(model_type)
    return fix(copy.deepcopy(d)) if fix else d
