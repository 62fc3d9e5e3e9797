"""mode="autotune" against fp32 and eager autocast, on the bench models (issue 12's table).

    python benchmarks/autotune.py                       # all models, bf16 inference, 7 rounds
    python benchmarks/autotune.py --model bert mlp --rounds 5 --markdown out.md
    python benchmarks/autotune.py --overhead            # per-op overhead on many_small_ops only
    python benchmarks/autotune.py --threads 1           # a shared machine under load

Each row: median time (interleaved rounds, one process, ``graphamp bench``'s machinery), its ratio to
min(fp32, eager autocast), its max error against fp32 beside eager autocast's own, and the autotune
plan (ops raised, measuring time). The header gives the date, the CPU model, its bf16/fp16 capability,
the thread count and the machine load. ``--overhead`` measures per-call CPU time of this thread
(``time.thread_time``, so other processes on a shared machine barely move it) on many_small_ops, and
reports microseconds per ATen op above eager autocast.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

import graphamp
from graphamp import bench
from graphamp.hardware import capability
from graphamp.autotune.measure import MeasurementCache, measuring

MODELS = ("mlp", "checkerboard", "many_small_ops", "transformer_encoder", "bert", "gpt2")
VARIANTS = ("fp32", "autocast", "pure_low", "graphamp", "graphamp_inference", "graphamp_autotune")


def header() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{datetime.date.today()} | {capability('cpu').line()} | {torch.get_num_threads()} threads | "
        f"torch {torch.__version__} | load average {load:.2f} at start"
    )


def table(rows: list[bench.Row]) -> str:
    lines = [
        "| model | variant | median ms | vs min(fp32, autocast) | vs autocast | max err vs fp32 (autocast's) | note |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.model} | {r.variant} | {r.status} | | | | |")
            continue
        err = "-" if r.err_vs_fp32 is None else f"{r.err_vs_fp32:.3g} ({r.autocast_err_vs_fp32:.3g})"
        note = r.note.split(";")[0].removeprefix("autotune (bfloat16): ").removeprefix("autotune (float16): ") if r.note else ""
        if "raises undone" in r.note:  # the accuracy check undid them (graphamp.convert)
            note += ", then undone: error above autocast's"
        lines.append(
            f"| {r.model} | {r.variant} | {r.median_ms:.3f} | {r.vs_best:.2f} | {r.vs_autocast:.2f} | {err} | {note} |"
        )
    return "\n".join(lines)


def overhead(rounds: int = 15, calls: int = 100) -> str:
    """Per-call CPU time on many_small_ops, one thread: graphamp exact (and inference) vs eager autocast."""
    from graphamp.testing import zoo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = zoo.many_small_ops()
        model = case.model.eval()
        args, kwargs = case.inputs
        amp = graphamp.convert(model, args, kwargs)
        amp_inf = graphamp.convert(model, args, kwargs, inference=True)
        ops = sum(1 for n in amp.graph.nodes if isinstance(n.target, torch._ops.OpOverload))

        def eager():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(*args, **kwargs)

        fns = {"eager autocast": eager, "graphamp exact": lambda: amp(*args, **kwargs),
               "graphamp exact inference=True": lambda: amp_inf(*args, **kwargs), "fp32": lambda: model(*args, **kwargs)}
        samples: dict[str, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for f in fns.values():
                for _ in range(20):
                    f()
            for _ in range(rounds):
                for name, f in fns.items():
                    start = time.thread_time()
                    for _ in range(calls):
                        f()
                    samples[name].append((time.thread_time() - start) / calls * 1e6)
    finally:
        torch.set_num_threads(threads)
    base = statistics.median(samples["eager autocast"])
    lines = [f"many_small_ops, 1 thread, {ops} ATen ops per call (CPU time of this thread, median of {rounds} rounds)",
             "| variant | us/call | vs eager autocast | us per op above eager autocast |", "|---|---:|---:|---:|"]
    for name, v in samples.items():
        m = statistics.median(v)
        lines.append(f"| {name} | {m:.0f} | {m / base:.2f} | {(m - base) / ops:+.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=list(MODELS), choices=sorted(bench.BENCH_MODELS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=bench.VARIANTS)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's); on a shared, loaded "
                   "machine 1 thread avoids OpenMP barriers waiting on descheduled threads")
    p.add_argument("--overhead", action="store_true", help="only the per-op overhead on many_small_ops")
    p.add_argument("--markdown", metavar="PATH", help="also write the header and tables here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = [header()]
    if args.overhead:
        out.append(overhead())
    else:
        # Each autotune row measures afresh: a cache from an earlier run (another load) decides nothing.
        with measuring(cache=MeasurementCache()):
            rows = bench.run(args.model, dtype=args.dtype, variants=args.variants, rounds=args.rounds)
        out.append(table(rows))
        out.append(f"load average {os.getloadavg()[0]:.2f} at the end")
    text = "\n\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
