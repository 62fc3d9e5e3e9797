"""A bench model with dropout, as models train: the bench's BERT-like size (4 layers, hidden 256,
batch 8 x 128 tokens) with hidden and attention dropout 0.1.

    PYTHONPATH=benchmarks graphamp bench --model dropout_models:bert --task train
"""

from __future__ import annotations

import torch
import transformers as tf


def bert() -> tuple:
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=3,
    )
    model = tf.BertForSequenceClassification(cfg)
    ids = torch.randint(0, 1000, (8, 128))
    return model, (), {"input_ids": ids, "attention_mask": torch.ones(8, 128, dtype=torch.long)}
