"""Small models built by ``module:factory`` strings, for ``graphamp verify --model factories:NAME``.

Random weights, nothing downloaded. Each factory returns ``(model, args, kwargs)``, the form
:func:`graphamp.testing.zoo.build` takes from a factory.
"""

from __future__ import annotations

import torch
from torch import nn


def llama(kv_heads: int = 2, *, hidden: int = 128, layers: int = 2, vocab: int = 128, seq: int = 16) -> tuple[nn.Module, tuple, dict]:
    """A two-layer ``LlamaForCausalLM`` (hidden 128, 4 heads), grouped-query attention when ``kv_heads < 4``."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    return model, (), {"input_ids": ids}


def llama_mha() -> tuple[nn.Module, tuple, dict]:
    """:func:`llama` with as many key/value heads as query heads (no grouped-query attention)."""
    return llama(kv_heads=4)
