"""Where the time goes (issue 37, deliverable 4): for each bench model and task, the share of the
fastest compiled variants' time in matmul/conv/attention kernels against everything else, and the
matmul-only bound on this CPU (the step's matmul FLOPs at the rate of one large square matmul in
the low dtype and in fp32), so each row shows how far the variant is from that limit.

    .venv/bin/python benchmarks/time_split.py [--models bert gpt2 ...] [--tasks infer train] [--dtype bf16] \
        [--variants ...] [--rounds 3] [--calls 2] [--n 2048] [--threads N] [--json PATH]

Per (model, task): the matmul FLOPs of one step, counted on the eager fp32 step
(``graphamp.bench.limits.matmul_flops``); the bounds. Per variant: the median ms of one step
(``torch.utils.benchmark.Timer``, ``--rounds`` rounds, interleaved), and the split of a profiled step
(``graphamp.bench.limits.time_split``, ``--calls`` calls; its total includes the profiler's overhead,
so it is a little above the median) with the events that took the most time and their class.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphamp import bench, hardware  # noqa: E402
from graphamp.bench.limits import gemm_rate, limits_line, matmul_bound_ms, matmul_dtype, matmul_flops, time_split  # noqa: E402
from graphamp.spec import DTYPE_ALIASES  # noqa: E402

_GEMM = "gemm"  # the fp32 matmul timed alongside the variants
MODELS = ("bert", "gpt2", "checkerboard", "transformer_encoder")
# The fastest compiled variants: torch.compile in fp32 and with autocast (with freezing for
# inference), and graphamp's compiled conversion.
VARIANTS = {
    "infer": ("compile_fp32_freezing", "compile_autocast_freezing", "graphamp_compiled"),
    "train": ("compile_fp32", "compile_autocast", "graphamp_compiled"),
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _rates(low: torch.dtype, n: int) -> dict[str, Any]:
    """The GEMM rates behind the bounds (layout "nt", a @ b.T), and the other layouts for reference
    (ATen's emulated-bf16 "nn" takes about a minute at n=2048: skipped)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    rates: dict[str, Any] = {}
    for dtype, layouts in ((torch.float32, ("nt", "nn", "tn")), (low, ("nt", "tn"))):
        for layout in layouts:
            start = time.perf_counter()
            rate = gemm_rate(dtype, n=n, layout=layout)
            rates[f"{names[dtype]} {layout}"] = rate / 1e9
            _log(f"gemm {names[dtype]} {layout} n={n}: {rate / 1e9:.3g} GFLOP/s ({time.perf_counter() - start:.0f} s)")
    return rates


def _median_ms(steps: dict[str, Any], rounds: int, target_s: float) -> dict[str, float]:
    """Median ms of one step per variant, in interleaved rounds (as graphamp.bench times them)."""
    timers = {v: benchmark.Timer("step()", globals={"step": s}, num_threads=torch.get_num_threads()) for v, s in steps.items()}
    numbers = {v: max(1, int(target_s / max(t.timeit(1).median, 1e-6))) for v, t in timers.items()}
    samples: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(rounds):
        for v, t in timers.items():
            samples[v].append(t.timeit(numbers[v]).median * 1e3)
    return {v: statistics.median(s) for v, s in samples.items()}


def run(models: list[str], tasks: list[str], dtype: str, variants: list[str] | None, *, rounds: int, calls: int, n: int,
        top: int = 8) -> dict[str, Any]:
    low = DTYPE_ALIASES[dtype]
    out: dict[str, Any] = {
        "cpu": hardware.capability("cpu").line(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "dtype": dtype,
        "gemm_n": n,
        "gemm_gflops": _rates(low, n),
        "rows": [],
        "limits": [],
    }
    for task in tasks:
        for model in models:
            case = bench.build_case(model)
            start = time.perf_counter()
            flops = matmul_flops(bench.variants.prepare("fp32", case, task, low).step)
            _log(f"[{model} {task}] {flops / 1e9:.3g} GFLOP of matmuls per step ({time.perf_counter() - start:.0f} s)")
            steps: dict[str, Any] = {}
            rows: dict[str, dict[str, Any]] = {}
            for v in variants or VARIANTS[task]:
                start = time.perf_counter()
                row: dict[str, Any] = {"model": model, "task": task, "dtype": dtype, "variant": v}
                try:
                    prepared = bench.variants.prepare(v, case, task, low)
                    for _ in range(2):
                        prepared.step()  # compiles, warms up
                    steps[v] = prepared.step
                    row["note"] = prepared.note
                except Exception as e:  # a variant that cannot run is reported, not fatal
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                row["setup_s"] = time.perf_counter() - start
                rows[v] = row
                _log(f"[{model} {task}] {v} prepared in {row['setup_s']:.0f} s")
            # One fp32 n x n matmul timed in the same interleaved rounds: the GEMM rate under the
            # same load as the variants (a shared machine's other work slows both alike).
            a, b = torch.randn(n, n), torch.randn(n, n)
            load = os.getloadavg()
            medians = _median_ms({**steps, _GEMM: lambda: torch.mm(a, b.t())}, rounds, target_s=0.2)
            rate_alongside = 2 * n**3 / (medians.pop(_GEMM) / 1e3)
            bound_alongside = flops / rate_alongside * 1e3
            bound_low, bound_fp32 = matmul_bound_ms(flops, low, n=n), matmul_bound_ms(flops, torch.float32, n=n)
            splits = {}
            for v, step in steps.items():
                split = splits[v] = time_split(step, calls=calls)
                runs_in = matmul_dtype(v, low)
                bound = bound_fp32 if runs_in == torch.float32 else bound_low if runs_in is not None else min(bound_low, bound_fp32)
                rows[v].update(
                    status="ok", median_ms=medians[v], profiled_ms=split.total_ms, matmul_ms=split.matmul_ms, other_ms=split.other_ms,
                    matmul_fraction=split.fraction, x_bound=medians[v] / bound,
                    x_low_bound=None if runs_in == torch.float32 else medians[v] / bound_low,
                    x_fp32_bound=medians[v] / bound_fp32, x_fp32_bound_alongside=medians[v] / bound_alongside,
                    top_events=[{"name": name, "class": kind, "ms": round(ms, 3)} for name, kind, ms in split.events[:top]],
                )
                _log(f"[{model} {task}] {v}: {medians[v]:.1f} ms, {split.fraction:.0%} in matmul/conv kernels")
            out["rows"].extend(rows.values())
            if medians:
                fastest = min(medians, key=medians.get)
                line = limits_line(flops, low, fastest=fastest, fastest_ms=medians[fastest], split=splits[fastest], n=n)
            else:
                fastest, line = None, limits_line(flops, low, n=n)
            out["limits"].append({"model": model, "task": task, "flops": flops, "bound_low_ms": bound_low, "bound_fp32_ms": bound_fp32,
                                  "gemm_fp32_gflops_alongside": rate_alongside / 1e9, "bound_fp32_alongside_ms": bound_alongside,
                                  "load_average": load, "fastest": fastest, "line": line})
    return out


def table(result: dict[str, Any]) -> str:
    low = result["dtype"]
    rates = result["gemm_gflops"]
    lines = [
        f"CPU: {result['cpu']}; torch {result['torch']}, {result['threads']} threads; "
        f"load average at start {', '.join(f'{x:.1f}' for x in result['load_average_at_start'])}",
        f"GEMM rate, one {result['gemm_n']}x{result['gemm_n']} matmul (GFLOP/s; nt = a @ b.T, the bound's): "
        + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()),
        "",
        f"| model | task | variant | median ms | profiled ms | matmul ms | other ms | matmul share | x fp32 bound "
        f"| x fp32 bound (GEMM timed alongside) | x {low} bound |",
        "|" + "---|" * 11,
    ]
    for r in result["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['task']} | {r['variant']} | {r.get('status')} |" + " |" * 7)
            continue
        lines.append(
            f"| {r['model']} | {r['task']} | {r['variant']} | {r['median_ms']:.1f} | {r['profiled_ms']:.1f} | {r['matmul_ms']:.1f} | "
            f"{r['other_ms']:.1f} | {r['matmul_fraction']:.0%} | {r['x_fp32_bound']:.2f} | {r['x_fp32_bound_alongside']:.2f} | "
            f"{'-' if r['x_low_bound'] is None else format(r['x_low_bound'], '.2f')} |"
        )
    lines += ["", "x fp32 bound: the median over the step's matmul FLOPs at the fp32 GEMM rate measured at the start; "
              "(GEMM timed alongside): at the rate of the same matmul timed in the variants' interleaved rounds; "
              f"x {low} bound: at the {low} rate (mixed-precision variants; the JSON's x_bound is over the smaller bound).", ""]
    lines += [f"- {x['model']} {x['task']}: {x['line']} (fp32 GEMM timed alongside: {x['gemm_fp32_gflops_alongside']:.3g} GFLOP/s, "
              f"load average {x['load_average'][0]:.1f})" for x in result["limits"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(bench.BENCH_MODELS))
    parser.add_argument("--tasks", nargs="+", default=["infer", "train"], choices=["infer", "forward", "train"])
    parser.add_argument("--dtype", default="bf16", choices=list(bench.DTYPES))
    parser.add_argument("--variants", nargs="+", default=None, help="default: the fastest compiled variants for the task")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per variant (median)")
    parser.add_argument("--calls", type=int, default=2, help="profiled calls per variant")
    parser.add_argument("--n", type=int, default=2048, help="size of the square matmul that measures the GEMM rate")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.variants is None and "forward" in args.tasks:
        parser.error("--tasks forward needs --variants")
    result = run(args.models, args.tasks, args.dtype, args.variants, rounds=args.rounds, calls=args.calls, n=args.n)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
