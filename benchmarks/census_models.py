"""The census population: every transformers architecture built from a tiny config, plus timm and
diffusers models, each with a way to make example inputs at any batch size.

Random weights, nothing downloaded. A model is named ``family/key``: ``hf/bert``, ``timm/resnet18``,
``diffusers/unet2d_condition``. :func:`build` turns a name into a :class:`Built`.

timm and diffusers live outside graphamp's venv (``scripts/census`` installs them into
``.venv/census-site``), because torchvision's PyPI wheel cannot load its C++ ops against the CPU
build of torch: installed into the venv, it breaks ``from transformers import ViTModel`` in every
process. :func:`enable_census_site` puts that directory on ``sys.path`` for the census process only.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import census_inputs

__all__ = ["DIFFUSERS_MODELS", "TIMM_MODELS", "BuildError", "Built", "NotApplicable", "build", "builder_id", "census_site", "enable_census_site", "population"]

ROOT = Path(__file__).resolve().parent.parent
BATCH = 2
SEQ = 8
DECODER_SEQ = 5

# make_inputs(batch, seed=0, seq=None) -> (args, kwargs). seed=0 is the example; another seed
# redraws the float inputs and changes integer ids (within the vocabulary) at the same shapes; seq
# (only where Built.seq_input) sets the length of input_ids (and of what follows it: the mask, bbox).
MakeInputs = Callable[..., tuple[tuple, dict[str, Any]]]
# A seed's offset in the generators' seeds: seed 0 keeps every example as it was.
SEED_STRIDE = 7919


def builder_id() -> str:
    """Which builder made a census row's model: a hash of this module and census_inputs, the code
    that turns a name into a model and its inputs (a change to either may build a model otherwise)."""
    h = hashlib.sha256()
    for f in (Path(__file__), Path(census_inputs.__file__)):
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


class BuildError(Exception):
    """The model or its inputs cannot be made: counted as "eager cannot run", never as graphamp's."""


@dataclass
class Built:
    name: str
    model: nn.Module
    make_inputs: MakeInputs
    # Which class was built, and how far the config was shrunk ("tiny", "head-dim kept", ...).
    cls: str
    note: str = ""
    # make_inputs takes seq= (the model's main input is input_ids).
    seq_input: bool = False
    # The same model built with its own dropout probabilities (the census's build zeroes them in the
    # config) and those config values above 0 (name -> p), for the dropout check; None where the
    # model's dropout lives in its modules only (timm, diffusers: the census restores their own p).
    dropout_model: Callable[[], tuple[nn.Module, dict[str, float]]] | None = None


def census_site() -> Path:
    return Path(os.environ.get("GRAPHAMP_CENSUS_SITE", ROOT / ".venv" / "census-site"))


def enable_census_site() -> bool:
    """Put the census-only packages on sys.path; True if the directory exists."""
    site = census_site()
    if not site.is_dir():
        return False
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    # torchvision's PyPI wheel registers fake kernels for its C++ ops at import; against the CPU
    # torch those ops do not exist and `import torchvision` raises. timm's models and the
    # transformers models call none of these ops, so the census skips the registration module.
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    return True


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- transformers

# Preferred model class per model type, first match wins: a head model the way users run it.
_HF_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_CTC_MAPPING_NAMES",
    "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def _hf_mappings() -> list[dict[str, Any]]:
    from transformers.models.auto import modeling_auto

    names = list(_HF_MAPPINGS) + sorted(
        n for n in dir(modeling_auto) if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES") and n not in _HF_MAPPINGS
    )
    return [getattr(modeling_auto, n) for n in names]


def hf_model_types() -> list[str]:
    types_: set[str] = set()
    for mapping in _hf_mappings():
        types_.update(mapping)
    return sorted(types_)


def _hf_class_name(model_type: str) -> str:
    for mapping in _hf_mappings():
        if model_type in mapping:
            name = mapping[model_type]
            return name[0] if isinstance(name, (list, tuple)) else name
    raise BuildError(f"no model class for {model_type}")


_LAYERS = re.compile(r"^(num_hidden_layers|num_layers|n_layers?|encoder_layers|decoder_layers|num_encoder_layers|num_decoder_layers|depth|num_blocks|num_text_layers|num_vision_layers)$")
_HEADS = re.compile(r"^(num_attention_heads|n_heads?|num_heads|encoder_attention_heads|decoder_attention_heads|attention_heads|num_attention_heads_text|num_attention_heads_vision)$")
_KV_HEADS = re.compile(r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num|num_key_value_groups_count)$")
_HIDDEN = re.compile(r"^(hidden_size|d_model|n_embd|n_embed|embed_dim|hidden_dim|dim|word_embed_proj_dim|embedding_size|projection_dim|d_embed|text_embed_dim|vision_embed_dim|encoder_hidden_size|decoder_hidden_size)$")
_HEAD_DIM = re.compile(r"^(head_dim|attention_head_dim|kv_channels|qk_rope_head_dim|qk_nope_head_dim|v_head_dim|d_kv|d_head)$")
_FFN = re.compile(r"(intermediate_size|ffn_dim|^d_ff$|^n_inner$|^mlp_dim$|ffn_hidden_size|^d_inner$|^decoder_ffn_dim$)")
_EXPERTS = re.compile(r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts)$")
_TOPK = re.compile(r"^(num_experts_per_tok|moe_topk|top_k|num_experts_per_token|moe_k)$")
# Train-mode randomness off: dropout, stochastic depth, and SpecAugment's masking (wav2vec2 family).
_DROPOUT = re.compile(r"(dropout|drop_prob|_pdrop$|^pdrop|drop_path|layerdrop|drop_rate|attention_probs_dropout|^mask_time_prob$|^mask_feature_prob$)")
# SpecAugment draws its masks with numpy, which no torch seed reaches: zeroed even where the dropout
# check keeps the config's dropout.
_SPEC_AUGMENT = re.compile(r"^mask_(time|feature)_prob$")
_TOKEN_ID = re.compile(r"(_token_id|_token_index|_id)$")


# Per-stage widths, scaled down with images (the first to 16).
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "dims", "conv_dim", "neck_hidden_sizes", "widths", "channels")


@dataclass(frozen=True)
class Shrink:
    """How far a config is shrunk. The smallest first; the next keeps more of the original geometry."""

    label: str
    hidden_per_head: int | None  # None keeps the config's own head dimension
    heads: int | None  # None keeps the config's head counts and hidden sizes
    images: bool  # shrink image_size and per-stage lists
    # Also the sizes the patterns above miss (prefixed names, sizes one sub-config takes from a
    # sibling, Mamba-2 head geometry): see _tie. Only for models still big after the other shrinks.
    tied: bool = False
    # Also every width that was one of the shrunk hidden sizes before the shrink: see _fit. Last,
    # for models no other shrink builds.
    fitted: bool = False


# The "tiny, tied" shrink is tried only when the "layers only" build would have more parameters
# than this (counted on the meta device), so every model that builds small is built as before.
TIED_ABOVE = 100_000_000

# In order; census.py takes the first whose eager autocast runs. "tiny, tied" is tiny plus the
# repairs of _tie, before "layers only" (which keeps every width and can leave a model at 1-2.5 B
# parameters) but gated by TIED_ABOVE, so models that build small do not change.
SHRINKS = (
    Shrink("tiny", 32, 2, True),
    Shrink("head-dim kept", None, 2, False),
    Shrink("tiny, tied", 32, 2, True, tied=True),
    Shrink("layers only", None, None, False),
    Shrink("tiny, fitted", 32, 2, True, tied=True, fitted=True),
)
# Each shrink first with the main input alone, then with pixel_values too (BridgeTower needs both);
# each of those with the audio input in its first layout, then in its second (alt): input_features
# as (batch, bins, frames) (Whisper, ...), then as (batch, frames, bins) (UnivNet, ...); input_values
# as (batch, samples) (wav2vec2, ...), then as (batch, channels, samples) (EnCodec, DAC, ...). The
# second applies only to models that take input_features or input_values.
HF_ATTEMPTS = tuple((s, pixels, alt) for s in SHRINKS for pixels in (False, True) for alt in (False, True))


def _special_token_ids(d: dict[str, Any]) -> set[int]:
    ids: set[int] = set()
    for k, v in d.items():
        if isinstance(v, int) and not isinstance(v, bool) and _TOKEN_ID.search(k) and 0 <= v < 1_000_000 and "vocab" not in k:
            ids.add(v)
        elif isinstance(v, (list, tuple)) and _TOKEN_ID.search(k):
            ids.update(x for x in v if isinstance(x, int) and 0 <= x < 1_000_000)
        elif isinstance(v, dict):
            ids |= _special_token_ids(v)
    return ids


def _scaled_list(values: list[int], first: int) -> list[int]:
    scale = values[0] / first if values[0] > first else 1
    return [max(1, int(v / scale)) for v in values]


_SIZE_PATTERNS = (_HEADS, _KV_HEADS, _HEAD_DIM, _HIDDEN)


def _size_key(k: str, how: Shrink) -> str:
    """The name ``k`` is matched by: with ``how.tied``, a prefixed size (``swa_num_attention_heads``,
    ``mamba_n_heads``, ``projection_hidden_dim``) is matched as its unprefixed name."""
    if not how.tied or any(p.match(k) for p in _SIZE_PATTERNS):
        return k
    parts = k.split("_")
    for i in range(1, len(parts)):
        rest = "_".join(parts[i:])
        if any(p.match(rest) for p in _SIZE_PATTERNS):
            return rest
    return k


def _tie(out: dict[str, Any]) -> None:
    """The "tiny, tied" repairs on a shrunk config dict whose sub-configs are already shrunk.

    - A size one config takes from a sibling sub-config ``X_config`` is named ``X_hidden_size`` or
      ``hidden_size_X`` (``vision_config.text_hidden_size``, BLT's ``encoder_config.hidden_size_global``):
      it follows that sibling's new ``hidden_size``; configs validate the equality.
    - A hashed vocabulary (BLT's ``encoder_hash_byte_group_vocab``, half a million rows) is made 256.
    - Mamba-2 mixers (Mamba2, Bamba, GraniteMoeHybrid, NemotronH, ...): ``mamba_n_heads * mamba_d_head``
      (Mamba2: ``num_heads * head_dim``) must be ``mamba_expand * hidden_size``, and the groups must
      divide the heads.
    """
    for key, sub in out.items():
        if key.endswith("_config") and isinstance(sub, dict) and isinstance(sub.get("hidden_size"), int):
            sibling = key.removesuffix("_config")
            for node in (out, *(v for k, v in out.items() if k != key and isinstance(v, dict))):
                for name in (f"{sibling}_hidden_size", f"hidden_size_{sibling}"):
                    if isinstance(node.get(name), int) and not isinstance(node.get(name), bool):
                        node[name] = sub["hidden_size"]
    for key, v in out.items():
        # A hashed n-gram vocabulary (BLT's encoder_hash_byte_group_vocab): ids are taken modulo it.
        if key.endswith("_hash_byte_group_vocab") and isinstance(v, int) and v > 256:
            out[key] = 256
    hidden = out.get("hidden_size")
    mamba = [("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")]
    if any(isinstance(out.get(k), int) for k in ("state_size", "ssm_state_size")):  # a Mamba-2 config itself
        mamba.append(("num_heads", "head_dim"))
    n_key, d_key = next(((n, h) for n, h in mamba if isinstance(out.get(n), int) and isinstance(out.get(h), int) and out[h] > 0), (None, None))
    expand = next((out[k] for k in ("mamba_expand", "expand") if isinstance(out.get(k), int) and out[k] > 0), None)
    if isinstance(hidden, int) and n_key and d_key and expand and (expand * hidden) % out[d_key] == 0:
        out[n_key] = expand * hidden // out[d_key]
        for g in ("mamba_n_groups", "n_groups"):
            if isinstance(out.get(g), int) and out[g] > 0 and out[n_key] % out[g]:
                out[g] = 1


# 0-based lists of layer numbers in a backbone config (ViTDet's window_block_indices, RF-DETR's
# window_block_indexes): they follow the layers _restage keeps.
_LAYER_NUMBERS = re.compile(r"^(window_block_index(es)?|window_block_indices|residual_block_indices|global_attn_indexes)$")


def _restage(out: dict[str, Any], d: dict[str, Any], old_layers: int) -> None:
    """A backbone config (``stage_names``, ``out_indices``) whose output stages the layer shrink
    removed (``out_features=['stage12']`` of 2 layers fails validation) keeps the layers it outputs:
    as many layers as output stages (at least the shrink's), the old layers just before each
    output, and every per-layer value follows them. Configs whose outputs fit are left alone."""
    idx = d.get("out_indices")
    if not isinstance(d.get("stage_names"), list) or not isinstance(idx, list) or not all(isinstance(i, int) for i in idx):
        return
    # Stages that are layers (ViT backbones); Swin's stages are its depths, its num_layers no layer count.
    if d.get("num_hidden_layers") != old_layers or out["num_hidden_layers"] == old_layers or not idx or max(idx) <= out["num_hidden_layers"]:
        return
    new = out["num_hidden_layers"]
    kept = sorted({i - 1 for i in idx if i > 0})
    while len(kept) < new:
        kept.insert(0, next(j for j in range(old_layers) if j not in kept) if kept[0] == 0 else kept[0] - 1)
        kept.sort()
    n = len(kept)
    out["num_hidden_layers"] = n
    for k, v in d.items():
        if isinstance(v, list) and len(v) == old_layers and old_layers > 4:
            out[k] = [v[i] for i in kept]
        elif _LAYER_NUMBERS.match(k) and isinstance(v, list):
            out[k] = [kept.index(i) for i in v if i in kept]
    out["out_indices"] = [kept.index(i - 1) + 1 if i > 0 else 0 for i in idx]
    out["stage_names"] = ["stem", *(f"stage{j}" for j in range(1, n + 1))]
    if isinstance(d.get("out_features"), list):
        out["out_features"] = [out["stage_names"][j] for j in out["out_indices"]]


def _head_dim(d: dict[str, Any]) -> int | None:
    heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
    if isinstance(d.get("head_dim"), int):
        return d["head_dim"]
    return hidden // heads if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 else None


def _scale_mrope(out: dict[str, Any], d: dict[str, Any]) -> None:
    """M-RoPE's ``mrope_section`` (Qwen2-VL, GLM-4V) splits half the rotary dimension among the
    temporal, height and width positions: it sums to that half, so it shrinks with the head."""
    rope = out.get("rope_parameters")
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    old, new = _head_dim(d), _head_dim(out)
    if not isinstance(sections, list) or not old or not new or old == new or not all(isinstance(x, int) for x in sections):
        return
    total = sum(sections) * new // old
    scaled = [max(1, x * new // old) for x in sections]
    scaled[0] += total - sum(scaled)
    out["rope_parameters"] = {**rope, "mrope_section": scaled}


def _layer_index(key: Any) -> int | None:
    return int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else None


def _kept_layers(d: dict[str, Any], old_layers: int, n: int) -> list[int]:
    """The ``n`` layers a config with per-layer overrides (``per_layer_config``: Gemma 4's full
    attention layers, dots3's sparse ones, NeoMME's windows) keeps: greedily the layer showing the
    most values not yet kept of its per-layer lists and overrides, so a full-attention layer and its
    overrides survive the shrink (layer_types[:2] would keep two sliding layers and no override)."""
    overrides = {_layer_index(k): json.dumps(v, sort_keys=True) for k, v in d["per_layer_config"].items()}
    lists = [v for v in d.values() if isinstance(v, list) and len(v) == old_layers]
    kinds = [{(j, json.dumps(v[i], default=str)) for j, v in enumerate(lists)} | {("override", overrides.get(i))} for i in range(old_layers)]
    kept: list[int] = []
    seen: set = set()
    while len(kept) < min(n, old_layers):
        best = max((i for i in range(old_layers) if i not in kept), key=lambda i: (len(kinds[i] - seen), -i))
        kept.append(best)
        seen |= kinds[best]
    return sorted(kept)


def _kept_overrides(per_layer: dict[Any, Any], kept: list[int], how: Shrink, keep_dropout: bool) -> dict[Any, Any]:
    """``per_layer_config`` of the kept layers, renumbered, each override shrunk like a config."""
    out = {}
    for key, override in per_layer.items():
        i = _layer_index(key)
        if i in kept:
            new = kept.index(i)
            out[f"{new:0{len(key)}d}" if isinstance(key, str) else new] = shrink_config_dict(override, how, keep_dropout=keep_dropout) if isinstance(override, dict) else override
    return out


def _filled(d: dict[str, Any]) -> dict[str, Any]:
    """Sizes a default config leaves None that its model reads (Nemotron's num_key_value_heads,
    Ministral's head_dim, ESM's vocab_size, DeepSeek-V2's experts per token), given the value the
    config's documentation names for None, or a small one: a copy, unchanged where none is None."""
    none = {k for k, v in d.items() if v is None}
    if not none:
        return d
    out = dict(d)
    heads = d.get("num_attention_heads")
    hidden = next((d[k] for k in ("hidden_size", "d_model") if isinstance(d.get(k), int)), None)
    experts = next((k for k in d if _EXPERTS.match(k)), None)
    if "num_key_value_heads" in none and isinstance(heads, int):
        out["num_key_value_heads"] = heads  # None means multi-head attention
    if "head_dim" in none and isinstance(heads, int) and hidden:
        out["head_dim"] = hidden // heads
    if "vocab_size" in none:
        out["vocab_size"] = 256
    if "prediction_length" in none:
        out["prediction_length"] = 8  # a forecast of 8 steps (Informer's default names none)
    if "context_length" in none and "prediction_length" in d:
        out["context_length"] = 16  # None is the forecast's 8; Autoformer's label_length (10) must fit in it
    if experts in none and "num_experts_per_tok" in d:
        out[experts] = 4
    if "num_experts_per_tok" in none and experts and out[experts]:
        out["num_experts_per_tok"] = 2
    return out


def shrink_config_dict(d: dict[str, Any], how: Shrink, *, keep_dropout: bool = False) -> dict[str, Any]:
    """A copy of a config's to_dict() with sizes made small, recursing into sub-configs; dropout
    zeroed unless ``keep_dropout`` (SpecAugment's masking is zeroed always)."""
    d = _filled(d)
    out = dict(d)
    old_heads = next((v for k, v in d.items() if _HEADS.match(k) and isinstance(v, int)), None)
    head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else None
    hidden_old = next((v for k, v in d.items() if _HIDDEN.match(k) and isinstance(v, int) and v > 0), None)
    if head_dim is None and old_heads and hidden_old:
        head_dim = hidden_old // old_heads
    per_head = how.hidden_per_head or head_dim or 32
    # Per-stage head lists (Swin, PVT): one head per stage divides every stage width.
    stage_heads = any(isinstance(v, list) and _HEADS.match(k) for k, v in d.items())
    heads = how.heads if not stage_heads or how.images else None
    hidden = heads * per_head if heads else None
    old_layers = None
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            out[k] = shrink_config_dict(v, how, keep_dropout=keep_dropout)
            continue
        if isinstance(v, bool):
            continue
        if isinstance(v, float) and _DROPOUT.search(k):
            if not keep_dropout or _SPEC_AUGMENT.match(k):
                out[k] = 0.0
        elif not isinstance(v, int):
            if how.images and isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                if k in ("depths", "num_layers_per_stage", "stage_depths", "layer_depths", "depth"):
                    out[k] = [1] * len(v)
                elif k in _STAGE_WIDTHS:
                    out[k] = _scaled_list(v, 16)
                elif k in ("num_heads", "num_attention_heads", "heads"):
                    out[k] = [1] * len(v)
            continue
        elif _LAYERS.search(k) and v > 2 and "hidden" not in k.replace("num_hidden_layers", ""):
            old_layers = old_layers or v
            out[k] = 2
        elif _KV_HEADS.match(_size_key(k, how)) and v > 0 and heads:
            out[k] = heads if old_heads and v == old_heads else 1
        elif _HEADS.match(_size_key(k, how)) and heads and v > heads:
            out[k] = heads
        elif _HIDDEN.match(_size_key(k, how)) and hidden and v > hidden:
            out[k] = hidden if not stage_heads else 32
        elif _HEAD_DIM.match(_size_key(k, how)) and how.hidden_per_head and v > per_head:
            out[k] = per_head if _size_key(k, how) in ("head_dim", "attention_head_dim", "kv_channels", "d_kv", "d_head") else per_head // 2
        elif _FFN.search(k) and hidden and v > 2 * hidden:
            out[k] = 2 * hidden
        elif _EXPERTS.match(k) and v > 4:
            out[k] = 4
        elif _TOPK.match(k) and v > 2:
            out[k] = 2
        elif k in ("n_group", "topk_group") and v > 1:
            out[k] = 1
        elif k in ("kv_lora_rank", "q_lora_rank") and v > 32:
            out[k] = 32
        elif k in ("max_position_embeddings", "max_target_positions", "max_source_positions", "n_positions", "max_seq_len") and v > 128:
            out[k] = 128
        elif how.images and k in ("image_size", "img_size", "input_size") and v > 64:
            out[k] = 64
        elif how.images and k == "window_size" and v > 2 and "spatial_merge_size" not in d:
            # Swin-style windows must divide every stage's grid of a 64-pixel image. (Qwen2.5-VL's
            # window_size is in pixels, 112: a window of 2 pixels holds no patch of its packed image.)
            out[k] = 2
    if old_layers:
        # Per-layer lists (layer_types, attention_window, ...) follow the new layer count: the first
        # layers, or with per-layer overrides the layers of every kind (see _kept_layers).
        kept = _kept_layers(d, old_layers, 2) if isinstance(d.get("per_layer_config"), dict) else [0, 1]
        for k, v in out.items():
            if isinstance(v, list) and len(v) == old_layers and old_layers > 4:
                out[k] = [v[i] for i in kept]
        if isinstance(d.get("per_layer_config"), dict):
            out["per_layer_config"] = _kept_overrides(d["per_layer_config"], kept, how, keep_dropout)
        _restage(out, d, old_layers)
    if "vocab_size" in d and isinstance(d["vocab_size"], int) and d["vocab_size"] > 256:
        specials = _special_token_ids(d)
        out["vocab_size"] = max([256, *(i + 1 for i in specials if i < 300_000)])
    if how.tied:
        _tie(out)
    _scale_mrope(out, d)
    if "use_cache" in d:
        out["use_cache"] = False
    if d.get("pad_token_id", 0) is None and "pad_token_id" in d:
        out["pad_token_id"] = 0
    return out


# A width by its name: a size in features or channels (not a count of layers, heads or positions).
_WIDTH = re.compile(r"(size|dim|channels|hidden|features|width|d_model)s?(_|$)")
_NOT_WIDTH = re.compile(r"(layers|heads|position|vocab|patch|kernel|stride|image|window|groups|max_|num_(?!channels))")


def _widths(old: dict[str, Any], new: dict[str, Any], found: dict[str, dict[int, set[int]]]) -> None:
    """Old width -> new ones, over the whole config tree: of the widths the shrink changed
    (``found["size"]``), and of per-stage widths (a ResNet backbone's hidden_sizes) stage by stage
    (``found["stage"]``)."""
    for k, v in old.items():
        w = new.get(k)
        if isinstance(v, dict) and isinstance(w, dict):
            _widths(v, w, found)
        elif isinstance(v, int) and not isinstance(v, bool) and isinstance(k, str) and _WIDTH.search(k) and not _NOT_WIDTH.search(k) and w != v:
            found["size"].setdefault(v, set()).add(w)
        elif k in _STAGE_WIDTHS and isinstance(v, list) and isinstance(w, list) and len(v) == len(w) and v != w:
            for a, c in zip(v, w):
                found["stage"].setdefault(a, set()).add(c)


def _fit_widths(old: dict[str, Any], new: dict[str, Any], widths: dict[int, int]) -> None:
    for k, v in old.items():
        if isinstance(v, dict) and isinstance(new.get(k), dict):
            _fit_widths(v, new[k], widths)
        elif not isinstance(k, str) or not _WIDTH.search(k) or _NOT_WIDTH.search(k) or new.get(k) != v:
            continue
        elif isinstance(v, int) and not isinstance(v, bool) and v in widths:
            new[k] = widths[v]
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) and any(x in widths for x in v):
            new[k] = [widths.get(x, x) for x in v]


# The object queries a DETR-style detector picks (top-k) from its image's tokens: a 64-pixel image
# has 84 of them at strides 8, 16 and 32.
FITTED_QUERIES = 16


def _fit(old: dict[str, Any], new: dict[str, Any]) -> None:
    """The "tiny, fitted" repair: a width the shrink left alone that was one of the widths it shrank
    (Depth Anything's reassemble_hidden_size, X-CLIP's prompt widths, WavTokenizer's codebook_dim, a
    head's audio_hidden_size, RT-DETR's encoder_in_channels: its backbone's stage widths) is made
    small with it. Only where the old width maps to one new width (a width the shrink changed wins
    over a stage's), and widths of 32 and up (not small counts)."""
    found: dict[str, dict[int, set[int]]] = {"size": {}, "stage": {}}
    _widths(old, new, found)
    sizes = {o: min(n) for o, n in found["size"].items() if len(n) == 1 and o >= 32}
    stages = {o: min(n) for o, n in found["stage"].items() if len(n) == 1 and o >= 32 and o not in found["size"]}
    _fit_widths(old, new, {**stages, **sizes})
    if isinstance(new.get("num_queries"), int) and new["num_queries"] > FITTED_QUERIES:
        new["num_queries"] = FITTED_QUERIES


def _hf_config(model_type: str, how: Shrink, *, keep_dropout: bool = False):
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    fixed = census_inputs.fixed_config(model_type, base.to_dict())
    d = shrink_config_dict(fixed, how, keep_dropout=keep_dropout)
    if how.fitted:
        _fit(fixed, d)
    d.pop("transformers_version", None)
    config = type(base).from_dict(d)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def _for_class(config: Any, cls: type) -> Any:
    """The config ``cls`` is built from: the model type's own, or where ``cls`` takes one of its
    sub-configs (Qwen3.5's causal LM takes the text config of a vision-language config, MusicGen's
    its decoder config), that sub-config, as loading the class from such a checkpoint does.
    (Mllama's causal LM, built from its whole config before, takes its text config itself.)"""
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(config, want):
        return config
    return next((v for v in vars(config).values() if isinstance(v, want)), config)


def _as_int(v: Any, default: int) -> int:
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _find(config: Any, *names: str) -> Any:
    """The first of ``names`` on the config or its vision/audio/text sub-configs."""
    for c in (config, *(getattr(config, s, None) for s in ("vision_config", "audio_config", "encoder", "text_config", "backbone_config"))):
        if c is None:
            continue
        for n in names:
            v = getattr(c, n, None)
            if v is not None:
                return v
    return None


def _token_ids(config: Any, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    vocab = _as_int(_find(config, "vocab_size"), 100)
    specials = _special_token_ids(config.to_dict())
    # Low ids only, none of them special (image, audio, mask tokens change what the model does).
    allowed = [i for i in range(min(vocab, 100)) if i not in specials] or [0]
    idx = torch.randint(0, len(allowed), shape, generator=_gen(seed))
    return torch.tensor(allowed)[idx]


def _image(config: Any, b: int, seed: int) -> torch.Tensor:
    channels = _as_int(_find(config, "num_channels", "in_channels", "num_input_channels"), 3)
    size = _as_int(_find(config, "image_size", "img_size"), 64)
    return torch.randn(b, channels, size, size, generator=_gen(seed))


def _video(config: Any, b: int, seed: int) -> torch.Tensor:
    """(batch, frames, channels, size, size): the video models' (VideoMAE, ViViT, ...) pixel_values."""
    frames = _as_int(_find(config, "num_frames", "frames_per_clip"), 8)
    return _image(config, b * frames, seed).unflatten(0, (b, frames))


def _hf_input(name: str, config: Any, b: int, seed: int, main: str, seq: int = SEQ, alt: bool = False) -> torch.Tensor | None:
    if name == "input_ids":
        return _token_ids(config, (b, seq), seed)
    if name == "decoder_input_ids":
        return _token_ids(config, (b, DECODER_SEQ), seed + 1)
    if name == "attention_mask":
        return torch.ones(b, seq, dtype=torch.long) if main == "input_ids" else None
    if name == "pixel_values_videos" or (name == "pixel_values" and _find(config, "num_frames", "frames_per_clip") is not None):
        return _video(config, b, seed + 2)
    if name == "pixel_values":
        return _image(config, b, seed + 2)
    if name == "input_values":
        if alt:
            return torch.randn(b, _as_int(_find(config, "audio_channels"), 1), 3200, generator=_gen(seed + 3))
        return torch.randn(b, 3200, generator=_gen(seed + 3))
    if name == "input_features":
        names = ("num_mel_bins", "feature_size", "input_feat_per_channel")
        # An ASR model's encoder_config (Parakeet, Canary, LASR) names its bins where nothing else does.
        bins = _as_int(_find(config, *names) or _find(getattr(config, "encoder_config", None) or config, *names), 80)
        frames = 2 * _as_int(_find(config, "max_source_positions"), 32)
        features = torch.randn(b, bins, frames, generator=_gen(seed + 4))
        return features.transpose(1, 2).contiguous() if alt else features
    if name == "bbox":
        lo = torch.randint(0, 500, (b, seq, 2), generator=_gen(seed + 5))
        return torch.cat([lo, lo + torch.randint(0, 500, (b, seq, 2), generator=_gen(seed + 6))], -1)
    if name == "token_type_ids":
        return None
    if name.endswith("_input_ids"):  # InstructBLIP's qformer_input_ids: ids of the Q-Former's vocabulary
        return _token_ids(getattr(config, name.removesuffix("_input_ids") + "_config", config), (b, seq), seed + 8)
    return census_inputs.series_input(name, config, b, seed + 7) if hasattr(config, "context_length") else None


def _hf_make_inputs(model: nn.Module, config: Any, *, pixels: bool, alt: bool = False, model_type: str = "") -> tuple[MakeInputs, bool]:
    """make_inputs for ``model``, and whether it takes seq= (its main input is input_ids)."""
    sig = inspect.signature(model.forward)
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, (list, tuple)):  # OneFormer's: [pixel_values, task_inputs]
        main = main[0]
    required = [
        p.name for p in sig.parameters.values()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    packed = census_inputs.packed_arg(required)
    if packed and main not in sig.parameters:
        main = packed  # a vision tower whose main_input_name (input_ids) is inherited, not an argument
    wanted = list(dict.fromkeys([main, *required]))
    if "attention_mask" in sig.parameters and main == "input_ids":
        wanted.append("attention_mask")
    if "decoder_input_ids" in sig.parameters and getattr(config, "is_encoder_decoder", False):
        wanted.append("decoder_input_ids")
    if pixels:
        wanted.append("pixel_values")
    wanted += census_inputs.series_targets(sig.parameters)
    wanted += [a for a in census_inputs.EXTRA_ARGS.get(model_type, ()) if a not in wanted]
    grid = next((g for g in census_inputs.GRID_ARGS if g in required), None)
    table = census_inputs.TABLE.get(model_type)

    def make(b: int, seed: int = 0, seq: int | None = None) -> tuple[tuple, dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        at = 1000 * b + SEED_STRIDE * seed
        if packed:
            kwargs.update(census_inputs.packed_patches(model, config, packed, grid, b, at))
        if table:
            kwargs.update(table(model, config, b, at, seq or SEQ))
        for name in wanted:
            if name in kwargs:
                continue
            t = _hf_input(name, config, b, seed=at, main=main, seq=seq or SEQ, alt=alt)
            if t is None:
                if name in required:
                    raise BuildError(f"no generic input for the required argument {name!r}")
                continue
            kwargs[name] = t
        return (), kwargs

    return make, main == "input_ids"


def _seeded(fn: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return fn()


class NotApplicable(BuildError):
    """This attempt would build the same thing as an earlier one, or does not apply to this model."""


# A build with more parameters than this (counted on the meta device) is refused: at 1 B fp32
# parameters the model, eager autocast's casts and graphamp's module take several GB each, and two
# workers share the machine's memory (BLT's "layers only" build, 3.2 B, was OOM-killed at 23 GB).
MAX_BUILD_PARAMS = 1_000_000_000


def meta_parameters(cls: type, config: Any) -> int:
    """The parameter count of ``cls(config)``, built on the meta device (no memory); raises what
    the constructor raises."""
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())


def _tied_applies(model_type: str, cls: type, how: Shrink) -> None:
    """Raise NotApplicable unless the "tiny, tied" shrink changes the tiny config and the "layers
    only" build is still over TIED_ABOVE parameters (then every earlier attempt has failed)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type).to_dict()
    tiny = next(s for s in SHRINKS if s.label == "tiny")
    if shrink_config_dict(base, how) == shrink_config_dict(base, tiny):
        raise NotApplicable("the tied shrink is the tiny one")
    try:
        n = meta_parameters(cls, _for_class(_hf_config(model_type, next(s for s in SHRINKS if s.label == "layers only")), cls))
    except Exception as e:  # no count, no tied shrink: the model builds as it did before it
        raise NotApplicable(f"layers-only build not countable on meta: {type(e).__name__}") from e
    if n <= TIED_ABOVE:
        raise NotApplicable(f"layers only builds {n} parameters, at most {TIED_ABOVE}")


def build_hf(model_type: str, attempt: int) -> Built:
    import transformers

    transformers.logging.set_verbosity_error()
    how, pixels, alt = HF_ATTEMPTS[attempt]
    cls_name = _hf_class_name(model_type)
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise BuildError(f"transformers has no class {cls_name}")
    params = inspect.signature(cls.forward).parameters
    if pixels and ("pixel_values" not in params or getattr(cls, "main_input_name", "input_ids") == "pixel_values"):
        raise NotApplicable("no optional pixel_values")
    audio = "input_features" if "input_features" in params else "input_values" if "input_values" in params else None
    if alt and audio is None:
        raise NotApplicable("no input_features or input_values")
    if how.tied and not how.fitted:
        _tied_applies(model_type, cls, how)
    config = _for_class(_hf_config(model_type, how), cls)
    # The constructor's own error comes from the meta build, before a real one allocates (the
    # default cohere_compass config cannot build, after 8 GB of embeddings at "layers only").
    n = meta_parameters(cls, config)
    if n > MAX_BUILD_PARAMS:
        raise BuildError(f"{how.label}: {n / 1e9:.1f} B parameters, over the census's {MAX_BUILD_PARAMS / 1e9:.0f} B (this machine's memory)")
    model = _seeded(lambda: cls(config)).eval()
    layout = {"input_features": ", input_features frames first", "input_values": ", input_values with a channel axis"}
    note = how.label + (" + pixel_values" if pixels else "") + (layout[audio] if alt else "")

    def dropout_model() -> tuple[nn.Module, dict[str, float]]:
        kept = _for_class(_hf_config(model_type, how, keep_dropout=True), cls)
        return _seeded(lambda: cls(kept)).eval(), _dropout_values(kept.to_dict())

    make, seq_input = _hf_make_inputs(model, config, pixels=pixels, alt=alt, model_type=model_type)
    return Built(f"hf/{model_type}", model, make, cls_name, note, seq_input=seq_input, dropout_model=dropout_model)


def _dropout_values(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The config's dropout-like values above 0 (sub-configs as ``prefix.name``)."""
    found: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            found.update(_dropout_values(v, f"{prefix}{k}."))
        elif isinstance(v, float) and v > 0 and _DROPOUT.search(k) and not _SPEC_AUGMENT.match(k):
            found[prefix + k] = v
    return found


# ---------------------------------------------------------------- timm

# (timm name, input size): a representative set, small images where the model takes any size.
TIMM_MODELS: dict[str, int] = {
    "resnet18": 64, "resnet50": 64, "efficientnet_b0": 64, "mobilenetv2_050": 64, "mobilenetv3_small_050": 64,
    "regnetx_002": 64, "regnety_002": 64, "densenet121": 64, "dla34": 64, "ghostnet_100": 64,
    "convnext_atto": 64, "convnextv2_atto": 64, "lcnet_050": 64, "tinynet_e": 64, "repvgg_a0": 64,
    "rexnet_100": 64, "hrnet_w18_small": 64, "cspresnet50": 64, "res2net50_14w_8s": 64, "mixnet_s": 64,
    "vit_tiny_patch16_224": 64, "deit_tiny_patch16_224": 64, "swin_tiny_patch4_window7_224": 224,
    "levit_128s": 224, "poolformer_s12": 64, "resmlp_12_224": 224, "xcit_nano_12_p16_224": 64,
    "pit_ti_224": 224, "mobilevit_xxs": 64, "edgenext_xx_small": 64, "efficientformer_l1": 224,
    "coat_lite_tiny": 224, "fastvit_t8": 64, "eva02_tiny_patch14_224": 224, "cait_xxs24_224": 224,
}


def build_timm(name: str) -> Built:
    if not enable_census_site():
        raise BuildError(f"timm is not installed: run scripts/census once (it installs the census extra into {census_site()})")
    import timm

    size = TIMM_MODELS.get(name, 224)
    # Train mode must be deterministic: classifier dropout (F.dropout on drop_rate, no module to
    # reach afterwards) and stochastic depth off, where the model takes the argument.
    base: dict[str, Any] = {"pretrained": False, "num_classes": 10}
    choices = [{**base, "drop_rate": 0.0, "drop_path_rate": 0.0}, {**base, "drop_rate": 0.0}, base]
    if size != 224:
        choices = [{**c, "img_size": size} for c in choices] + choices
    model = None
    for kwargs in choices:
        try:
            model = _seeded(lambda kwargs=kwargs: timm.create_model(name, **kwargs))
        except TypeError:
            continue
        if "img_size" not in kwargs and size != 224 and _fixed_size(model):
            size = 224
        break
    if model is None:
        raise BuildError(f"timm.create_model({name!r}) takes none of the census's arguments")
    model.eval()
    for m in model.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0

    def make(b: int, seed: int = 0) -> tuple[tuple, dict]:
        return (torch.randn(b, 3, size, size, generator=_gen(b + SEED_STRIDE * seed)),), {}

    return Built(f"timm/{name}", model, make, type(model).__name__, f"{size}px")


def _fixed_size(model: nn.Module) -> bool:
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    return bool(cfg.get("fixed_input_size"))


# ---------------------------------------------------------------- diffusers


def _diffusers():
    if not enable_census_site():
        raise BuildError(f"diffusers is not installed: run scripts/census once (it installs the census extra into {census_site()})")
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    return diffusers


def _unet2d_condition() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    )
    return model, lambda b, seed=0: ((torch.randn(b, 4, 16, 16, generator=_gen(b + SEED_STRIDE * seed)), torch.tensor([10 + 37 * seed] * b)), {"encoder_hidden_states": torch.randn(b, 6, 32, generator=_gen(b + 1 + SEED_STRIDE * seed))})


def _unet2d() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
    )
    return model, lambda b, seed=0: ((torch.randn(b, 3, 16, 16, generator=_gen(b + SEED_STRIDE * seed)), torch.tensor([10 + 37 * seed] * b)), {})


def _autoencoder_kl() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32,
    )
    return model, lambda b, seed=0: ((torch.randn(b, 3, 32, 32, generator=_gen(b + SEED_STRIDE * seed)),), {})


def _dit() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
    )
    return model, lambda b, seed=0: ((torch.randn(b, 4, 8, 8, generator=_gen(b + SEED_STRIDE * seed)),), {"timestep": torch.tensor([10 + 37 * seed] * b), "class_labels": (torch.arange(b) + 3 * seed) % 10})


def _pixart() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8, patch_size=2,
        cross_attention_dim=32, caption_channels=24, use_additional_conditions=False,
    )
    return model, lambda b, seed=0: (
        (torch.randn(b, 4, 8, 8, generator=_gen(b + SEED_STRIDE * seed)),),
        {"encoder_hidden_states": torch.randn(b, 6, 24, generator=_gen(b + 1 + SEED_STRIDE * seed)), "timestep": torch.tensor([10 + 37 * seed] * b), "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}},
    )


def _sd3() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    )
    return model, lambda b, seed=0: (
        (torch.randn(b, 4, 8, 8, generator=_gen(b + SEED_STRIDE * seed)),),
        {"encoder_hidden_states": torch.randn(b, 6, 32, generator=_gen(b + 1 + SEED_STRIDE * seed)), "pooled_projections": torch.randn(b, 16, generator=_gen(b + 2 + SEED_STRIDE * seed)), "timestep": torch.tensor([10 + 37 * seed] * b)},
    )


def _transformer2d() -> tuple[nn.Module, MakeInputs]:
    _diffusers()
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=1, cross_attention_dim=24, norm_num_groups=8)
    return model, lambda b, seed=0: ((torch.randn(b, 32, 8, 8, generator=_gen(b + SEED_STRIDE * seed)),), {"encoder_hidden_states": torch.randn(b, 6, 24, generator=_gen(b + 1 + SEED_STRIDE * seed))})


def _flux() -> tuple[nn.Module, MakeInputs]:
    d = _diffusers()
    model = d.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
    )

    def make(b: int, seed: int = 0) -> tuple[tuple, dict]:
        return (), {
            "hidden_states": torch.randn(b, 16, 16, generator=_gen(b + SEED_STRIDE * seed)),
            "encoder_hidden_states": torch.randn(b, 6, 32, generator=_gen(b + 1 + SEED_STRIDE * seed)),
            "pooled_projections": torch.randn(b, 16, generator=_gen(b + 2 + SEED_STRIDE * seed)),
            "timestep": torch.tensor([0.5 + 0.125 * seed] * b),
            "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(6, 3),
        }

    return model, make


DIFFUSERS_MODELS: dict[str, Callable[[], tuple[nn.Module, MakeInputs]]] = {
    "unet2d_condition": _unet2d_condition,
    "unet2d": _unet2d,
    "autoencoder_kl": _autoencoder_kl,
    "dit": _dit,
    "pixart": _pixart,
    "sd3": _sd3,
    "transformer2d": _transformer2d,
    "flux": _flux,
}


def build_diffusers(key: str) -> Built:
    torch.manual_seed(0)
    model, make = DIFFUSERS_MODELS[key]()

    def tuple_output(b: int, seed: int = 0) -> tuple[tuple, dict]:
        # diffusers' output classes are pytree nodes without key paths, which torch.export refuses
        # (ValueError: Did not find a flatten_with_keys_fn); tuples keep the numerics checks running.
        args, kwargs = make(b, seed)
        return args, {**kwargs, "return_dict": False}

    return Built(f"diffusers/{key}", model.eval(), tuple_output, type(model).__name__, "return_dict=False")


# ---------------------------------------------------------------- the population


def population(families: tuple[str, ...] = ("hf", "timm", "diffusers")) -> list[str]:
    names: list[str] = []
    if "diffusers" in families:
        names += [f"diffusers/{k}" for k in DIFFUSERS_MODELS]
    if "timm" in families:
        names += [f"timm/{n}" for n in TIMM_MODELS]
    if "hf" in families:
        names += [f"hf/{t}" for t in hf_model_types()]
    return names


def build(name: str, attempt: int = 0) -> Built:
    """The model ``name`` (``family/key``); ``attempt`` picks a larger shrink for transformers."""
    family, _, key = name.partition("/")
    if family == "hf":
        return build_hf(key, attempt)
    if family == "timm":
        return build_timm(key)
    if family == "diffusers":
        return build_diffusers(key)
    raise BuildError(f"unknown model family {family!r} in {name!r}")


def attempts(name: str) -> int:
    return len(HF_ATTEMPTS) if name.startswith("hf/") else 1
