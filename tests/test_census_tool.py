"""benchmarks/census.py's own bookkeeping: merging a re-run into the population's results; the CI sample's lists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import census  # noqa: E402


def _write(path: Path, head: dict, rows: list[dict]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in [{"header": True, **head}, *rows]) + "\n")


def test_a_rerun_replaces_the_checks_it_made_and_records_itself(tmp_path: Path) -> None:
    ok = {"status": "ok", "attempt": 0}
    out, rerun = tmp_path / "population.jsonl", tmp_path / "rerun.jsonl"
    _write(out, {"date": "d0", "graphamp_commit": "aaa"}, [
        {"model": "hf/a", "status": "done", "eager": ok, "requested": list(census.CHECKS),
         "checks": {"convert_bf16": {"status": "error", "reported": True}, "backend": {"status": "bitwise"}}},
        {"model": "hf/b", "status": "timeout", "timeout_in": "grads_bf16", "eager": ok, "requested": ["convert_bf16", "grads_bf16"],
         "note": "layers only", "params": 10**9, "checks": {"convert_bf16": {"status": "bitwise"}}},
        {"model": "hf/c", "status": "done", "eager": ok, "requested": ["convert_bf16"], "checks": {"convert_bf16": {"status": "bitwise"}}},
    ])
    _write(rerun, {"date": "d1", "graphamp_commit": "bbb"}, [
        {"model": "hf/a", "status": "done", "eager": ok, "requested": ["convert_bf16"], "checks": {"convert_bf16": {"status": "bitwise"}}},
        {"model": "hf/b", "status": "done", "eager": ok, "requested": ["grads_bf16"], "checks": {"grads_bf16": {"status": "bitwise"}},
         "note": "tiny, tied", "params": 10},
        {"model": "hf/c", "status": "timeout", "eager": ok, "requested": ["convert_bf16"], "checks": {}},
    ])
    assert census.merge_results(out, rerun) == 2
    head, rows = census.read_results(out)
    assert head["graphamp_commit"] == "aaa"
    a, b, c = rows["hf/a"], rows["hf/b"], rows["hf/c"]
    assert a["checks"] == {"convert_bf16": {"status": "bitwise"}, "backend": {"status": "bitwise"}}
    assert a["rerun"] == [{"date": "d1", "commit": "bbb", "checks": ["convert_bf16"]}]
    assert b["status"] == "done" and "timeout_in" not in b and b["checks"]["grads_bf16"]["status"] == "bitwise"
    assert (b["note"], b["params"]) == ("tiny, tied", 10)  # the build the re-run's checks ran on
    assert c["checks"] == {"convert_bf16": {"status": "bitwise"}} and "rerun" not in c  # an unfinished re-run changes nothing
    table = census.summarize(rows)["table"]
    assert table["convert_bf16"]["bitwise"] == 3 and table["grads_bf16"]["bitwise"] == 1


def test_every_known_cause_is_a_check_the_ci_sample_runs() -> None:
    import census_sample

    stale = [key for key in census_sample.KNOWN if key[1] not in census_sample.SAMPLE.get(key[0], ())]
    assert not stale, f"KNOWN lists checks the CI sample does not run: {stale}"
    assert len(census_sample.CONVERTING) >= 30, "the CI sample keeps at least 30 models beside one per cause"
