"""``graphamp bench``: argparse front end of graphamp.bench."""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence

import torch

from graphamp import bench
from graphamp.bench import BENCH_MODELS, DEFAULT_MODELS, TASKS, VARIANTS
from graphamp.hardware import capability

# Environment variables that change how the process allocates memory, and with it the page faults a
# variant's calls take (docs/benchmark.md#page-faults): a run records the ones set.
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
# glibc malloc's thresholds the bench's own process runs with (docs/benchmark.md#page-faults):
# 4 GiB free kept before trimming, blocks up to 32 MiB from the heap. Both, since setting one turns
# off glibc's adjusting of the other.
STEADY_MALLOC = "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"
# Set in the re-run process, so that the header can say the bench set the thresholds itself.
_SET_BY_BENCH = "GRAPHAMP_BENCH_STEADY_MALLOC"


def steady_malloc_env(environ: Mapping[str, str], libc: str) -> dict[str, str] | None:
    """The environment to run the bench again in, with glibc malloc's thresholds set; None where
    that does not apply: another C library, or the allocator already chosen (any of ALLOCATOR_ENV
    set, by the user or by an earlier re-run).

    >>> steady_malloc_env({"PATH": "/bin"}, "glibc")["GLIBC_TUNABLES"] == STEADY_MALLOC
    True
    >>> steady_malloc_env({"LD_PRELOAD": "libjemalloc.so"}, "glibc") is None, steady_malloc_env({}, "") is None
    (True, True)
    """
    if libc != "glibc" or any(environ.get(name) for name in ALLOCATOR_ENV):
        return None
    return {**environ, "GLIBC_TUNABLES": STEADY_MALLOC, _SET_BY_BENCH: "1"}


def rerun_with_steady_malloc(argv: Sequence[str]) -> None:
    """Run ``graphamp bench`` again in this process's place with glibc malloc's thresholds set
    (``argv``: the command's arguments, ``bench`` first), where :func:`steady_malloc_env` applies:
    with glibc's defaults, whether a variant's calls fault their buffers in again depends on what
    the process allocated before, which can double a small model's time. The ``graphamp`` command
    calls it; ``graphamp.bench.run`` and ``main([...])`` never re-run anything."""
    env = steady_malloc_env(os.environ, platform.libc_ver()[0])
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # Python's own options (-W, -X, -O, -I, ...) as this interpreter got them, the way
    # multiprocessing passes them to the processes it starts.
    flags = subprocess._args_from_interpreter_flags()
    os.execve(sys.executable, [sys.executable, *flags, "-c", "import sys; from graphamp.cli import main; sys.exit(main())", *argv], env)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare graphamp with eager autocast and the alternatives")
    p.add_argument(
        "--model", nargs="+", default=list(DEFAULT_MODELS), metavar="MODEL",
        help=f"built-in models ({', '.join(sorted(BENCH_MODELS))}) or pkg.module:factory for your own "
        "(returning a zoo.Case or (model, args[, kwargs])) (default: %(default)s)",
    )
    p.add_argument("--task", choices=list(TASKS), default="infer",
                   help="infer: eval under no_grad; forward: eval with grad enabled, no backward; train: a training step")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument(
        "--variants", nargs="+", default=None, choices=VARIANTS,
        help="default: fp32, eager autocast, the compiled alternative expected fastest on this CPU, graphamp exact "
        "and graphamp's path for this CPU (graphamp.bench.default_variants)",
    )
    p.add_argument("--all", action="store_true", help="every variant that applies to the task: the full comparison (with --limits)")
    p.add_argument(
        "--limits", action="store_true",
        help="also where the time goes: the matmul-only bound on this CPU and the fastest variant's distance to it",
    )
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default: %(default)s)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="bar chart of the ratios to eager autocast (needs matplotlib)")
    p.add_argument(
        "--malloc-defaults", action="store_true",
        help="measure with glibc malloc's default thresholds (by default the graphamp command runs the bench with both "
        "set, unless GLIBC_TUNABLES or LD_PRELOAD is set: docs/benchmark.md#page-faults)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    for name in args.model:
        if name not in bench.BENCH_MODELS and ":" not in name:
            raise SystemExit(
                f"graphamp bench: unknown model {name!r}; built-in models: {', '.join(sorted(bench.BENCH_MODELS))}, "
                "or pkg.module:factory"
            )
    try:
        variants = bench.VARIANTS if args.all else args.variants
        rows = bench.run(args.model, task=args.task, dtype=args.dtype, variants=variants, rounds=args.rounds, limits=args.limits or args.all)
    except (ValueError, TypeError, ImportError) as e:  # a model that cannot be built: say why, no traceback
        raise SystemExit(f"graphamp bench: {e}") from e

    environment = {name: os.environ[name] for name in ALLOCATOR_ENV if os.environ.get(name)}
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    if environment:
        machine += ", " + " ".join(f"{k}={v}" for k, v in environment.items())
    print(f"graphamp bench: task={args.task} dtype={args.dtype} ({machine})")
    if os.environ.get(_SET_BY_BENCH) and environment.get("GLIBC_TUNABLES") == STEADY_MALLOC:
        print("malloc: glibc's thresholds set by graphamp bench, so that no variant's time depends on when malloc "
              "returns memory to the OS (--malloc-defaults measures without; docs/benchmark.md#page-faults)")
    print(f"capability: {capability('cpu').line()}")
    if torch.cuda.is_available():
        print(f"capability: {capability('cuda').line()}")
    print(bench.table(rows))
    print()
    print(bench.recommendation(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "capability": capability("cpu").line(), "environment": environment, "rows": bench.to_json(rows)}, f,
                indent=2,
            )
    if args.csv:
        data = bench.to_json(rows)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[k for k in data[0] if k != "samples"], extrasaction="ignore")
            writer.writeheader()
            writer.writerows(data)
    if args.plot:
        _plot(rows, args.plot)
    failed = [r for r in rows if r.status.startswith("error")]
    return 1 if failed else 0


def _plot(rows: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'graphamp[plot]'") from e
    ok = [r for r in rows if r.vs_autocast is not None]
    models = sorted({r.model for r in ok}, key=[r.model for r in ok].index)
    variants = sorted({r.variant for r in ok}, key=[r.variant for r in ok].index)
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models) * len(variants) / 3), 4))
    for i, v in enumerate(variants):
        xs = [models.index(r.model) + i * width for r in ok if r.variant == v]
        ys = [r.vs_autocast for r in ok if r.variant == v]
        ax.bar(xs, ys, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(models))], models)
    ax.set_ylabel("time / eager autocast (lower is better)")
    ax.set_title(f"graphamp bench: {ok[0].task}, {ok[0].dtype}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
