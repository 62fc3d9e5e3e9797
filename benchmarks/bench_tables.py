"""README tables from ``graphamp bench --json`` files: one markdown table per file, and a summary
over repeated runs of the same task and dtype.

    python benchmarks/bench_tables.py benchmarks/results/bench-2026-11-28c-*.json

Each cell of a table is the median ms (ratio to eager autocast). The last two columns:

- "fastest graphamp / fastest alternative": the issue's target ratio. The fastest of every graphamp
  variant run over the fastest alternative that ran (``graphamp.bench.ALTERNATIVES``: fp32, eager
  autocast, and torch.compile in fp32 or with autocast, each with and without freezing). Several graphamp variants often run the same program (``graphamp_compiled`` and
  ``graphamp_autotune_compiled`` when autotune raises nothing), so a minimum over more noisy
  measurements favours graphamp's side a little; hence the next column.
- "like for like": graphamp's compiled default against the matching torch.compile + autocast
  (inference: ``graphamp_compiled`` / ``compile_autocast_freezing``; forward:
  ``graphamp_compiled`` / ``compile_autocast``; training: ``trainstep_compiled`` /
  ``compile_autocast``).

With several files of one task and dtype, ``--summary`` prints per model the median over the runs
of both ratios and of exact ``graphamp`` over eager autocast.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from graphamp.bench import ALTERNATIVES, PURE_LOW
from graphamp.bench.variants import BUDGETED

NOT_GRAPHAMP = (*ALTERNATIVES, *PURE_LOW)  # pure low precision changes the numerics: not graphamp, not an alternative
LIKE_FOR_LIKE = {
    "infer": ("graphamp_compiled", "compile_autocast_freezing"),
    "forward": ("graphamp_compiled", "compile_autocast"),
    "train": ("trainstep_compiled", "compile_autocast"),
}


def _by_model(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("median_ms"):
            out.setdefault(r["model"], {})[r["variant"]] = r
    return out


def ratios(variants: dict[str, dict], task: str) -> dict[str, object]:
    """The target ratio (with the two variants it divides), like for like, and exact over autocast."""
    # graphamp's variants at autocast's accuracy or better: a budgeted one only where it measured so.
    ours = {
        v: r["median_ms"] for v, r in variants.items()
        if v not in NOT_GRAPHAMP and (v not in BUDGETED or _as_accurate_as_autocast(r))
    }
    theirs = {v: variants[v]["median_ms"] for v in ALTERNATIVES if v in variants}
    out: dict[str, object] = {}
    if ours and theirs:
        g, a = min(ours, key=ours.get), min(theirs, key=theirs.get)
        out["target"], out["ours"], out["theirs"] = ours[g] / theirs[a], g, a
    g, a = LIKE_FOR_LIKE[task]
    if g in variants and a in variants:
        out["like"] = variants[g]["median_ms"] / variants[a]["median_ms"]
    if "graphamp" in variants and "autocast" in variants:
        out["exact"] = variants["graphamp"]["median_ms"] / variants["autocast"]["median_ms"]
    return out


def _as_accurate_as_autocast(row: dict) -> bool:
    err, autocast_err = row.get("err_vs_fp32"), row.get("autocast_err_vs_fp32")
    return err is not None and autocast_err is not None and err <= autocast_err


def table(doc: dict) -> str:
    rows = doc["rows"]
    task = rows[0]["task"]
    models = _by_model(rows)
    names = list(dict.fromkeys(r["variant"] for r in rows))
    head = ["model", *names, "fastest graphamp / fastest alternative", "like for like"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for model, variants in models.items():
        cells = [model]
        for v in names:
            r = variants.get(v)
            cells.append(f"{r['median_ms']:.1f} ({r['vs_autocast']:.2f})" if r and r.get("vs_autocast") else "-")
        q = ratios(variants, task)
        cells.append(f"**{q['target']:.2f}** ({q['ours']} / {q['theirs']})" if "target" in q else "-")
        cells.append(f"{q['like']:.2f}" if "like" in q else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(docs: list[dict]) -> str:
    """Per (task, dtype, model): the median over runs of the target, like-for-like and exact ratios."""
    groups: dict[tuple[str, str, str], list[dict[str, object]]] = {}
    for doc in docs:
        for model, variants in _by_model(doc["rows"]).items():
            any_row = next(iter(variants.values()))
            groups.setdefault((any_row["task"], any_row["dtype"], model), []).append(ratios(variants, any_row["task"]))
    lines = ["| task | dtype | model | runs | fastest graphamp / fastest alternative | like for like | exact / autocast |", "|---|---|---|---:|---:|---:|---:|"]
    for (task, dtype, model), runs in groups.items():
        def med(key: str) -> str:
            vals = [float(r[key]) for r in runs if key in r]
            return f"{statistics.median(vals):.2f} ({', '.join(f'{v:.2f}' for v in vals)})" if vals else "-"
        lines.append(f"| {task} | {dtype} | {model} | {len(runs)} | {med('target')} | {med('like')} | {med('exact')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--summary", action="store_true", help="only the summary over the files")
    ns = parser.parse_args()
    docs = [json.loads(p.read_text()) for p in ns.files]
    if not ns.summary:
        for p, doc in zip(ns.files, docs):
            print(f"`{p}` ({doc.get('capability', '')}):\n\n{table(doc)}\n")
    print(summary(docs))


if __name__ == "__main__":
    main()
