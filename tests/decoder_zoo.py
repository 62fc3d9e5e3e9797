"""Tiny Hugging Face decoders (and one encoder-decoder) for the gradient tests, random weights.

Every factory returns a :class:`graphamp.testing.zoo.Case` in train mode with every dropout probability
at 0, so eager runs are deterministic and comparable bit for bit. Families that support
grouped-query attention get fewer key/value heads than query heads. Inputs are token ids only
(no ``attention_mask``): the usual causal-LM training call.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from graphamp.testing.zoo import Case

VOCAB = 512
HIDDEN = 64
HEADS = 4
KV_HEADS = 2  # < HEADS: grouped-query attention
LAYERS = 2
BATCH, SEQ = 2, 16


def _transformers():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


def _ids(seed: int, key: str = "input_ids") -> Callable:
    def make(b: int, s: int) -> tuple[tuple, dict]:
        g = torch.Generator().manual_seed(seed + 1000 * b + s)
        return (), {key: torch.randint(0, VOCAB, (b, s), generator=g)}

    return make


def _decoder(name: str, config_cls: str, model_cls: str, seed: int = 0, **cfg) -> Case:
    tf = _transformers()
    torch.manual_seed(seed)
    config = getattr(tf, config_cls)(vocab_size=VOCAB, use_cache=False, **cfg)
    model = getattr(tf, model_cls)(config).train()
    return Case(name, model, _ids(seed), batch=BATCH, seq=SEQ)


_LLAMA_LIKE = dict(
    hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
    attention_dropout=0.0,
)


def llama(kv_heads: int = KV_HEADS, **extra) -> Case:
    return _decoder("llama", "LlamaConfig", "LlamaForCausalLM", **{**_LLAMA_LIKE, "num_key_value_heads": kv_heads, **extra})


def mistral() -> Case:
    return _decoder("mistral", "MistralConfig", "MistralForCausalLM", **_LLAMA_LIKE, sliding_window=None)


def qwen2() -> Case:
    return _decoder("qwen2", "Qwen2Config", "Qwen2ForCausalLM", **_LLAMA_LIKE)


def phi3() -> Case:
    return _decoder(
        "phi3", "Phi3Config", "Phi3ForCausalLM", **_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def gpt_neox() -> Case:
    # No grouped-query attention in GPT-NeoX: every head has its own keys and values.
    return _decoder(
        "gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=64,
        attention_dropout=0.0, hidden_dropout=0.0,
    )


def opt() -> Case:
    # No grouped-query attention in OPT.
    return _decoder(
        "opt", "OPTConfig", "OPTForCausalLM", hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, ffn_dim=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )


def falcon() -> Case:
    # The new decoder architecture is the one that takes num_kv_heads (grouped-query attention).
    return _decoder(
        "falcon", "FalconConfig", "FalconForCausalLM", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_kv_heads=KV_HEADS, new_decoder_architecture=True, alibi=False,
        ffn_hidden_size=2 * HIDDEN, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2,
    )


def t5(seed: int = 0) -> Case:
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0,
    )
    model = tf.T5ForConditionalGeneration(config).train()

    def make(b: int, s: int) -> tuple[tuple, dict]:
        g = torch.Generator().manual_seed(seed + 1000 * b + s)
        return (), {
            "input_ids": torch.randint(0, VOCAB, (b, s), generator=g),
            "decoder_input_ids": torch.randint(0, VOCAB, (b, max(s // 2, 1)), generator=g),
        }

    return Case("t5", model, make, batch=BATCH, seq=SEQ)


DECODERS: dict[str, Callable[[], Case]] = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "phi3": phi3,
    "gpt_neox": gpt_neox,
    "opt": opt,
    "falcon": falcon,
}
ENCODER_DECODERS: dict[str, Callable[[], Case]] = {"t5": t5}
