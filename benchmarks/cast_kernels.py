"""Where the casts go in compiled programs: inductor's kernels that hold a cast, and their share of
the time (issue 18, deliverable 3: "cast placement chosen for the fused kernels").

For each bench model it compiles graphamp's converted module (``convert(compile=True)``: the
casts are in its graph) and torch.compile + autocast (autocast's casts, traced by dynamo), runs each
under the profiler with inductor's per-kernel profiling and descriptive kernel names (the ATen ops
each kernel fuses), and reports, per program:

- ``kernels``: inductor's generated kernels (distinct names) and their share of the profiled time;
- ``with_cast``: the kernels that fuse a ``_to_copy`` (a dtype cast) with other ops;
- ``cast_only``: the kernels that do nothing but cast (and view), i.e. a cast inductor could not
  fuse into a producer or a consumer: the only place where moving a cast can save a pass over memory;
- ``extern``: the share of oneDNN/ATen calls (matmul, convolution, attention), which no cast
  placement changes (without changing their dtypes).

    .venv/bin/python benchmarks/cast_kernels.py [--models checkerboard gpt2 ...] [--tasks infer train] [--dtype bf16] [--json PATH]

The profile adds per-kernel overhead, so its shares are for comparison, not timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphamp  # noqa: E402
from graphamp.bench import BENCH_MODELS  # noqa: E402
from graphamp.backend.inductor import inductor_freezing  # noqa: E402
from graphamp.compiled import CompiledAmpModule  # noqa: E402
from graphamp.spec import DTYPE_ALIASES  # noqa: E402

KERNEL = re.compile(r"^(graph_\d+_)?cpp_fused_(?P<ops>.+?)(_\d+)?$")
VIEWS = {"view", "clone", "permute", "expand", "unsqueeze", "squeeze", "reshape", "transpose", "slice", "select", "t"}
EXTERN = ("mkldnn::", "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot", "aten::convolution",
          "aten::mkldnn_convolution", "aten::_convolution", "aten::linear", "aten::_weight_int", "aten::convolution_backward",
          "aten::mkldnn_rnn", "aten::_native_multi_head", "aten::_transformer_encoder")


def _classify(name: str) -> str | None:
    m = KERNEL.match(name)
    if m is None:
        return None
    ops = m.group("ops")
    if "_to_copy" not in ops and "convert_element_type" not in ops:
        return "other"
    rest = ops.replace("_to_copy", " ").replace("convert_element_type", " ").replace("_", " ").split()
    return "cast_only" if all(word in VIEWS for word in rest) else "with_cast"


def _floats(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _programs(name: str, task: str, dtype: torch.dtype) -> dict[str, Any]:
    case = BENCH_MODELS[name]()
    model, (args, kwargs) = case.model, case.inputs
    if task == "infer":
        model.eval()
        cm = graphamp.convert(model, args, kwargs, dtype=dtype, inference=True, compile=True)
        compiled = torch.compile(model, options={"freezing": True})

        def graphamp_run() -> None:
            with torch.no_grad():
                cm(*args, **kwargs)

        def alternative() -> None:
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype), inductor_freezing():
                compiled(*args, **kwargs)

        return {"graphamp_compiled": graphamp_run, "compile_autocast_freezing": alternative}
    model.train()
    cm = CompiledAmpModule(graphamp.convert(model, args, kwargs, dtype=dtype), freezing=False)
    compiled = torch.compile(model)

    def step(run: Any) -> None:
        model.zero_grad(set_to_none=True)
        sum(t.float().mean() for t in _floats(run())).backward()

    def graphamp_run() -> None:
        step(lambda: cm(*args, **kwargs))

    def alternative() -> None:
        with torch.autocast("cpu", dtype=dtype):
            out = compiled(*args, **kwargs)
        step(lambda: out)

    return {"graphamp_compiled": graphamp_run, "compile_autocast": alternative}


def _measure(run: Any, iters: int) -> dict[str, Any]:
    for _ in range(3):
        run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            run()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    shares: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    names: dict[str, list[str]] = {"cast_only": [], "with_cast": [], "other": []}
    for e in events:
        kind = _classify(e.key)
        if kind is not None:
            shares["kernels"] += e.self_cpu_time_total
            counts["kernels"] += 1
            names[kind].append(e.key)
            if kind != "other":
                shares[kind] += e.self_cpu_time_total
                counts[kind] += 1
        elif e.key.startswith(EXTERN):
            shares["extern"] += e.self_cpu_time_total
    return {
        "share": {k: round(v / total, 4) for k, v in shares.items()},
        "count": dict(counts),
        "kernel_names": {k: sorted(v) for k, v in names.items()},
        "ms_per_call": round(total / iters / 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["checkerboard", "transformer_encoder", "gpt2", "bert"])
    parser.add_argument("--tasks", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args(argv)
    torch.set_num_threads(2)
    import torch._inductor.config as inductor_config

    rows = []
    with inductor_config.patch({"cpp.enable_kernel_profile": True, "cpp.descriptive_names": "original_aten"}):
        for name in ns.models:
            for task in ns.tasks:
                for program, run in _programs(name, task, DTYPE_ALIASES[ns.dtype]).items():
                    with contextlib.redirect_stdout(sys.stderr):
                        row = {"model": name, "task": task, "dtype": ns.dtype, "program": program, **_measure(run, ns.iters)}
                    rows.append(row)
                    s, c = row["share"], row["count"]
                    print(
                        f"{name:20s} {task:5s} {program:26s} kernels {c.get('kernels', 0):3d} ({s.get('kernels', 0):6.1%}) "
                        f"with a cast {c.get('with_cast', 0):3d} ({s.get('with_cast', 0):6.1%}) "
                        f"cast only {c.get('cast_only', 0):3d} ({s.get('cast_only', 0):6.1%}) extern {s.get('extern', 0):6.1%}",
                        flush=True,
                    )
                torch._dynamo.reset()
    for line in same_kernels(rows):
        print(line)
    if ns.json:
        ns.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


def same_kernels(rows: list[dict[str, Any]]) -> list[str]:
    """Per model and task: whether both programs generated the same kernels (by descriptive name,
    the graph's number dropped), else the names only one of them has."""
    kernels: dict[tuple[str, str], list[set[str]]] = {}
    for row in rows:
        names = {re.sub(r"^graph_\d+_", "", n) for group in row["kernel_names"].values() for n in group}
        kernels.setdefault((row["model"], row["task"]), []).append(names)
    return [
        f"{model} {task}: " + ("the same kernels" if len(sets) == 2 and sets[0] == sets[1] else f"differ in {sorted(set.union(*sets) - set.intersection(*sets))}")
        for (model, task), sets in kernels.items()
    ]


if __name__ == "__main__":
    raise SystemExit(main())
