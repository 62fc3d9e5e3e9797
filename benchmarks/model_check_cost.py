"""What the per-call check that the model still holds its tensors costs, against a forward.

A converted module checks at every call that no parameter or buffer of its model was replaced
(:mod:`graphamp.model_state`). This times that check alone and the converted module's forward
(inference, bf16), side by side in one process with ``torch.utils.benchmark``, on:

- ``bert-base``: transformers' ``BertModel`` with bert-base's config (12 layers, hidden 768; random
  weights), batch 1, 128 tokens;
- ``1000-tensors``: 250 blocks of ``Linear(64, 64)`` + ``LayerNorm(64)`` (1,000 parameter tensors),
  batch 8: a model whose forward is cheap for its number of tensors.

    .venv/bin/python benchmarks/model_check_cost.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphamp  # noqa: E402
from graphamp import hardware  # noqa: E402


def _bert() -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()  # bert-base's sizes
    return model, (torch.randint(0, 30522, (1, 128)),)


def _many_tensors() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    blocks = [layer for _ in range(250) for layer in (nn.Linear(64, 64), nn.LayerNorm(64))]
    return nn.Sequential(*blocks).eval(), (torch.randn(8, 64),)


def measure(name: str, model: nn.Module, args: tuple) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = graphamp.convert(model, args, inference=True)
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    with torch.no_grad():
        amp(*args)
        forward = benchmark.Timer("amp(*args)", globals={"amp": amp, "args": args}, num_threads=torch.get_num_threads())
        check = benchmark.Timer("amp._check_parameters()", globals={"amp": amp}, num_threads=torch.get_num_threads())
        f = forward.blocked_autorange(min_run_time=3).median
        c = check.blocked_autorange(min_run_time=1).median
    return {"model": name, "tensors": tensors, "forward_ms": f * 1e3, "check_us": c * 1e6, "fraction": c / f}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    print(hardware.capability("cpu").line())
    rows = [measure("bert-base", *_bert()), measure("1000-tensors", *_many_tensors())]
    for row in rows:
        print(f"{row['model']:>14}: {row['tensors']} tensors, forward {row['forward_ms']:.2f} ms, "
              f"check {row['check_us']:.2f} us ({100 * row['fraction']:.4f}% of a forward)")
    result = {
        "what": "per-call model check against the converted forward (inference, bf16)",
        "cpu": hardware.capability("cpu").line(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
