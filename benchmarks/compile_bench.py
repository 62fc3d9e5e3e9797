"""torch.compile(backend="graphamp") against torch.compile with autocast, on CPU.

Variants (all inductor):
  E   torch.compile(model), called inside torch.autocast
  G   E with inductor's freezing (inference only, under no_grad)
  A   torch.compile(model, backend="graphamp")
  AF  A compiled with inductor's freezing (inference only; extra, not a target)

Inference runs under no_grad in eval mode; training times forward + loss + backward in train mode.
Variants are interleaved in one process (round-robin, several rounds of torch.utils.benchmark's
blocked_autorange) and medians reported; "compile" is the wall time of the first call (dynamo,
graphamp's rewrite and inductor). Targets: A <= 1.0x E everywhere, <= 0.35x E on
nn.TransformerEncoder inference (where E runs the fused fast path in fp32).

    .venv/bin/python benchmarks/compile_bench.py [--models bert gpt2 transformer_encoder] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils import benchmark

from graphamp.testing import zoo
from graphamp.backend import graphamp_backend

DTYPE = torch.bfloat16


def build(name: str, hidden: int, layers: int, heads: int, batch: int, seq: int) -> zoo.Case:
    if name == "transformer_encoder":
        case = zoo.transformer_encoder(d_model=hidden, layers=layers, heads=heads)
    else:
        case = getattr(zoo, name)(layers=layers, hidden=hidden, heads=heads)
    case.batch, case.seq = batch, seq
    return case


def loss_of(out: Any) -> torch.Tensor:
    return sum(t.float().mean() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


def variants(model: torch.nn.Module, args: tuple, kwargs: dict, task: str) -> dict[str, Callable[[], Any]]:
    """name -> a call that runs one step; each variant owns a copy of the model."""
    made: dict[str, Callable[[], Any]] = {}
    train = task == "train"

    def step(fn: Callable[[], Any], params: Any) -> Callable[[], Any]:
        if not train:
            def infer() -> Any:
                with torch.no_grad():
                    return fn()
            return infer

        def train_step() -> Any:
            for p in params:
                p.grad = None
            loss = loss_of(fn())
            loss.backward()
            return loss
        return train_step

    def autocast(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.autocast("cpu", dtype=DTYPE):
                return fn()
        return run

    m = copy.deepcopy(model).train(train)
    e = torch.compile(m)
    made["E"] = step(autocast(lambda: e(*args, **kwargs)), list(m.parameters()))
    if not train:
        m = copy.deepcopy(model).train(train)
        g = torch.compile(m, options={"freezing": True})
        made["G"] = step(autocast(lambda: g(*args, **kwargs)), list(m.parameters()))
    m = copy.deepcopy(model).train(train)
    a = torch.compile(m, backend="graphamp", options={"dtype": DTYPE})
    made["A"] = step(lambda: a(*args, **kwargs), list(m.parameters()))
    if not train:
        m = copy.deepcopy(model).train(train)
        # A backend object of its own: dynamo would otherwise reuse A's compiled code, whose
        # guards do not cover inductor's config.
        af = torch.compile(m, backend=lambda gm, inputs: graphamp_backend(gm, inputs, options={"dtype": DTYPE}))

        def frozen() -> Any:
            # Freezing is read when inductor compiles, i.e. on the first call.
            with torch._inductor.config.patch(freezing=True):
                return af(*args, **kwargs)
        made["AF"] = step(frozen, list(m.parameters()))
    return made


def max_diff(a: Any, b: Any) -> float:
    pairs = zip(pytree.tree_leaves(a), pytree.tree_leaves(b))
    return max((x.float() - y.float()).abs().max().item() for x, y in pairs if isinstance(x, torch.Tensor) and x.is_floating_point())


def run(names: list[str], tasks: list[str], hidden: int, layers: int, heads: int, batch: int, seq: int, rounds: int, min_run_time: float) -> list[dict]:
    torch._dynamo.config.cache_size_limit = 64
    rows = []
    for name in names:
        case = build(name, hidden, layers, heads, batch, seq)
        args, kwargs = case.inputs
        for task in tasks:
            calls = variants(case.model, args, kwargs, task)
            compile_s = {}
            for v, call in calls.items():
                start = time.perf_counter()
                call()
                compile_s[v] = time.perf_counter() - start
                print(f"  {name} {task} {v}: first call {compile_s[v]:.1f} s", file=sys.stderr, flush=True)
            times: dict[str, list[float]] = {v: [] for v in calls}
            for _ in range(rounds):
                for v, call in calls.items():
                    timer = benchmark.Timer("call()", globals={"call": call})
                    times[v].append(timer.blocked_autorange(min_run_time=min_run_time).median)
            med = {v: statistics.median(ts) for v, ts in times.items()}
            error = None
            if task == "infer":
                # Eager autocast with grad enabled: the ordinary path, not the fused fast path.
                model = copy.deepcopy(case.model).eval()
                with torch.autocast("cpu", dtype=DTYPE):
                    ref = model(*args, **kwargs)
                error = max_diff(calls["A"](), pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, ref))
            rows.append({"model": name, "task": task, "ms": {v: 1e3 * t for v, t in med.items()},
                         "spread": {v: (1e3 * min(ts), 1e3 * max(ts)) for v, ts in times.items()},
                         "compile_s": compile_s, "max_err_vs_eager_autocast": error})
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| model | task | E ms | G ms | A ms | AF ms | A/E | compile E s | compile A s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms, cs = r["ms"], r["compile_s"]
        cell = lambda v: f"{ms[v]:.1f}" if v in ms else "-"  # noqa: E731
        lines.append(f"| {r['model']} | {r['task']} | {cell('E')} | {cell('G')} | {cell('A')} | {cell('AF')} | "
                     f"{ms['A'] / ms['E']:.2f} | {cs['E']:.1f} | {cs['A']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2", "transformer_encoder"])
    parser.add_argument("--tasks", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one round: a smoke run")
    a = parser.parse_args()
    if a.quick:
        a.hidden, a.layers, a.batch, a.seq, a.rounds, a.min_run_time = 64, 1, 2, 16, 1, 0.1
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(f"sizes: hidden {a.hidden}, layers {a.layers}, heads {a.heads}, batch {a.batch}, seq {a.seq}; "
          f"{a.rounds} interleaved rounds, medians", flush=True)
    rows = run(a.models, a.tasks, a.hidden, a.layers, a.heads, a.batch, a.seq, a.rounds, a.min_run_time)
    print(report(rows))
    for r in rows:
        spread = ", ".join(f"{v} {lo:.1f}-{hi:.1f}" for v, (lo, hi) in r["spread"].items())
        err = r["max_err_vs_eager_autocast"]
        print(f"{r['model']} {r['task']}: per-round range ms: {spread}" + (f"; A max|diff| vs eager autocast {err:.3g}" if err is not None else ""))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
