"""graphamp.TrainStep on a small Llama causal LM with grouped-query attention, against the
canonical eager AMP loop: losses, parameters and AdamW state torch.equal over 30 steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphamp
import decoder_zoo
from test_train import STEPS, adamw, assert_same_losses, assert_same_state, canonical_loop, run_step, twins


def shifted_cross_entropy(out, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits at position t predict token t + 1."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def batches(steps: int, batch: int = 2, seq: int = 16) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, decoder_zoo.VOCAB, (batch, seq), generator=g)
        out.append(((), {"input_ids": ids}, ids))
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_llama_gqa_matches_canonical_loop(dtype):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    case = decoder_zoo.llama()
    cfg = case.model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads and case.model.training
    data = batches(STEPS)
    eager, ours = twins(case.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    eager_scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    want = canonical_loop(eager, shifted_cross_entropy, eager_opt, data, dtype=dtype, scaler=eager_scaler, max_grad_norm=1.0)
    step = graphamp.TrainStep(ours, shifted_cross_entropy, our_opt, dtype=dtype, scaler="auto", max_grad_norm=1.0)
    assert (step.scaler is not None) == (dtype == torch.float16)
    got, skipped = run_step(step, data)
    assert_same_losses(got.losses, want.losses)
    assert got.scales == want.scales
    assert_same_state(ours, eager, our_opt, eager_opt)
    assert step.calls == step.steps == STEPS and len(skipped) == STEPS
    # The run trained: a test of an untouched model would pass trivially.
    assert not all(skipped)
    assert not torch.equal(ours.lm_head.weight, case.model.lm_head.weight)
