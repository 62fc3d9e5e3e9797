"""Casts executed per forward: eager torch.autocast vs graphamp exact mode, on the real test models.

    .venv/bin/python benchmarks/cast_counts.py

Both sides are counted the same way: ``make_fx`` records the post-dispatch graph of one forward
(eager under autocast; graphamp's module with autocast off) and the ``aten._to_copy`` nodes are
counted. Prints a Markdown table for the README.
"""

from __future__ import annotations

import torch

import graphamp
from graphamp.testing import zoo
from graphamp.verify.reference import count_casts, eager_autocast_graph, lowered_graph

MODELS = [("bert", False), ("gpt2", False), ("vit", False), ("resnet", False),
          ("transformer_encoder", True), ("lstm", False), ("mha", True)]


def main() -> None:
    print("| model | dtype | eager autocast casts | graphamp casts | saved |")
    print("|---|---|---:|---:|---:|")
    for name, train in MODELS:
        for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            case = zoo.build(name)
            case.model.train(train)
            args, kwargs = case.inputs
            amp = graphamp.convert(case.model, args, kwargs, dtype=dtype)
            eager = count_casts(eager_autocast_graph(case.model, args, kwargs, device_type="cpu", dtype=dtype))
            ours = count_casts(lowered_graph(amp, args, kwargs))
            print(f"| {name} | {label} | {eager} | {ours} | {eager - ours} |")


if __name__ == "__main__":
    main()
