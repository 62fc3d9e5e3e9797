"""Time graphamp.convert on a BERT-base-size model (12 layers, hidden 768). Target: under 5 s.

Timed with the self-check off (the conversion itself, the target) and on (the default: the
example runs once more through eager autocast and the converted module, forward and backward).

    .venv/bin/python benchmarks/convert_time.py [--repeats 3] [--dtype bf16]

The first conversion in a process pays one-off costs (torch.export's imports and caches), so both
the first and the median of the repeats are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import graphamp
from graphamp.testing import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    case = zoo.build("bert_base")
    inputs, kwargs = case.inputs
    n_params = sum(p.numel() for p in case.model.parameters())
    times, checked, check_s = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        amp = graphamp.convert(case.model, inputs, kwargs, dtype=dtype, self_check="off")
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        amp = graphamp.convert(case.model, inputs, kwargs, dtype=dtype)
        checked.append(time.perf_counter() - start)
        check_s.append(amp.meta["graphamp"].self_check.seconds)
    nodes = sum(1 for n in amp.graph.nodes if n.op == "call_function")
    print(f"BERT-base ({n_params / 1e6:.1f}M params, {nodes} op nodes after conversion), cpu/{args.dtype}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"convert: first {times[0]:.2f} s, median of {len(times)} {statistics.median(times):.2f} s "
          f"(target < 5 s): {'met' if max(times) < 5 else 'NOT met'}")
    print(f"with the self-check (default): median {statistics.median(checked):.2f} s, of which the check "
          f"{statistics.median(check_s):.2f} s (forward and gradients on the example, both sides)")


if __name__ == "__main__":
    main()
