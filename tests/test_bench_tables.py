"""benchmarks/bench_tables.py: which variants its ratios divide, from `graphamp bench --json` rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_tables  # noqa: E402


def _rows(task: str, times: dict[str, float]) -> list[dict]:
    return [
        {"model": "m", "task": task, "dtype": "bf16", "variant": v, "status": "ok", "median_ms": ms, "vs_autocast": ms / times["autocast"]}
        for v, ms in times.items()
    ]


def test_target_is_fastest_graphamp_over_fastest_alternative_without_pure_low() -> None:
    rows = _rows("infer", {"fp32": 10.0, "autocast": 8.0, "pure_low": 1.0, "compile_autocast_freezing": 4.0, "graphamp": 7.0, "graphamp_compiled": 5.0, "graphamp_autotune_compiled": 3.0})
    q = bench_tables.ratios(bench_tables._by_model(rows)["m"], "infer")
    assert (q["ours"], q["theirs"]) == ("graphamp_autotune_compiled", "compile_autocast_freezing")
    assert q["target"] == 3.0 / 4.0
    assert q["like"] == 5.0 / 4.0  # graphamp_compiled against compile_autocast_freezing
    assert q["exact"] == 7.0 / 8.0


def test_training_like_for_like_is_trainstep_compiled_over_compile_autocast_and_failed_rows_are_left_out() -> None:
    rows = _rows("train", {"autocast": 10.0, "compile_autocast": 8.0, "trainstep_compiled": 6.0, "graphamp": 9.0})
    rows.append({"model": "m", "task": "train", "dtype": "bf16", "variant": "graphamp_backend", "status": "error: X", "median_ms": None})
    q = bench_tables.ratios(bench_tables._by_model(rows)["m"], "train")
    assert q["like"] == 6.0 / 8.0 and q["ours"] == "trainstep_compiled"
    text = bench_tables.summary([{"rows": rows}, {"rows": rows}])
    assert "| train | bf16 | m | 2 | 0.75 (0.75, 0.75) | 0.75 (0.75, 0.75) | 0.90 (0.90, 0.90) |" in text


def test_compiled_pure_low_and_a_less_accurate_budget_variant_are_not_graphamps_fastest() -> None:
    rows = _rows("infer", {"fp32": 10.0, "autocast": 8.0, "compile_pure_low": 1.0, "compile_fp32": 4.0,
                           "graphamp_autotune_compiled": 3.5, "graphamp_budget_compiled": 2.0})
    budget = next(r for r in rows if r["variant"] == "graphamp_budget_compiled")
    budget.update(err_vs_fp32=0.02, autocast_err_vs_fp32=0.01)  # within its budget, less accurate than autocast
    q = bench_tables.ratios(bench_tables._by_model(rows)["m"], "infer")
    assert (q["ours"], q["theirs"]) == ("graphamp_autotune_compiled", "compile_fp32")
    budget.update(err_vs_fp32=0.005)
    assert bench_tables.ratios(bench_tables._by_model(rows)["m"], "infer")["ours"] == "graphamp_budget_compiled"
