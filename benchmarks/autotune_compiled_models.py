"""``convert(mode="autotune", compile=True)`` on census models: which compiled candidate it keeps.

For each model (train mode, so forward and backward are timed), the conversion measures its plan,
compiles the candidates (graphamp/autotune_compiled.py) and keeps one. The script reports the plan's
raises, the candidates' times and ratios (``AutotunePlan.compiled``), whether the module runs
compiled, its drift from eager autocast on the example, and the seconds the whole conversion took.

    GRAPHAMP_CENSUS_SITE=.venv/census-site .venv/bin/python benchmarks/autotune_compiled_models.py hf/llama timm/resnet18 ... [--dtype fp16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import census_models  # noqa: E402

import graphamp  # noqa: E402
from graphamp.spec import DTYPE_ALIASES  # noqa: E402


def run(name: str, dtype: torch.dtype) -> dict:
    built = census_models.build(name)
    model = built.model.train()
    args, kwargs = built.make_inputs(census_models.BATCH)
    row: dict = {"model": name, "dtype": str(dtype).removeprefix("torch.")}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cm = graphamp.convert(model, args, kwargs, dtype=dtype, mode="autotune", compile=True)
    except Exception as e:  # noqa: BLE001 (reported per model)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    row["convert_s"] = round(time.perf_counter() - start, 1)
    plan = graphamp.AutotunePlan.of(getattr(cm, "amp", cm))
    row["raised"] = f"{len(plan.raised)} of {len(plan.decisions)}"
    row["compiled"] = plan.compiled
    row["runs_compiled"] = getattr(cm, "runs_compiled", False)
    row["drift"] = cm.drift.line() if getattr(cm, "drift", None) else None
    row["warnings"] = sorted({w.category.__name__ for w in caught})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args(argv)
    torch.set_num_threads(2)
    census_models.enable_census_site()
    rows = []
    for name in ns.models:
        rows.append(run(name, DTYPE_ALIASES[ns.dtype]))
        print(json.dumps(rows[-1]), flush=True)
    if ns.json:
        ns.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
