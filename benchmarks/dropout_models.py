"""The bench's BERT (`graphamp bench --model bert`: 4 layers, hidden 256, batch 8 x 128 tokens) with
hidden and attention dropout 0.1, as models train; the built-in bench models set dropout to 0.

    PYTHONPATH=benchmarks graphamp bench --model dropout_models:bert --task train
"""

from __future__ import annotations

from graphamp.bench.variants import sized as _sized
from graphamp.testing import zoo


def bert() -> zoo.Case:
    return _sized(zoo.bert(layers=4, hidden=256, heads=4, dropout=0.1), 8, 128)
