"""How graphamp.convert scales with graph size: time and Python memory for ~1k, 5k and 20k nodes.

    .venv/bin/python benchmarks/scaling.py [--sizes 1000 5000 20000]

The model is generated: ``graphamp.testing.zoo.ManySmallOps`` with N blocks (a LayerNorm, a Linear and
elementwise ops, with a residual), so node count grows linearly with the number of blocks. The steps of ``convert`` are timed
one by one: capture (torch.export, not graphamp's code), graphamp's passes, and emit; memory is
tracemalloc's peak per phase (the Python objects of the graphs; tensor storage is not traced).
Near-linear growth means the per-node columns stay flat.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import torch

from graphamp.capture import capture
from graphamp.config import Config
from graphamp.emit import emit
from graphamp.passes import run_pipeline
from graphamp.policy import get_policy
from graphamp.testing.zoo import ManySmallOps

NODES_PER_BLOCK = 10  # measured below; used only to pick a block count for a target size


def measure(blocks: int) -> dict:
    """The steps of graphamp.convert, timed one by one (capture, passes, emit)."""
    model, x = ManySmallOps(d=16, blocks=blocks), torch.randn(4, 16)
    policy, config = get_policy("cpu", torch.bfloat16), Config()
    tracemalloc.start()
    t0 = time.perf_counter()
    gm = capture(model, (x,), {}, device_type="cpu", dtype=torch.bfloat16)
    t1 = time.perf_counter()
    _, capture_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    captured_nodes = len(gm.graph.nodes)
    run_pipeline(gm, policy, config, check=True)
    t2 = time.perf_counter()
    amp = emit(gm, model, policy, "exact", config)
    t3 = time.perf_counter()
    _, passes_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"blocks": blocks, "captured_nodes": captured_nodes, "nodes": len(amp.graph.nodes),
            "capture_s": t1 - t0, "passes_s": t2 - t1, "emit_s": t3 - t2,
            "capture_mib": capture_peak / 2**20, "passes_mib": passes_peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000], help="target node counts")
    args = parser.parse_args()
    measure(10)  # warm up export's one-off costs
    print("| nodes (captured -> converted) | capture (torch.export) s | passes s | emit s | passes us/node | "
          "capture peak MiB | passes+emit peak MiB | passes KiB/node |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        r = measure(max(1, size // NODES_PER_BLOCK))
        print(f"| {r['captured_nodes']} -> {r['nodes']} | {r['capture_s']:.1f} | {r['passes_s']:.2f} | "
              f"{r['emit_s']:.2f} | {1e6 * r['passes_s'] / r['captured_nodes']:.0f} | {r['capture_mib']:.0f} | "
              f"{r['passes_mib']:.0f} | {1024 * r['passes_mib'] / r['captured_nodes']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
