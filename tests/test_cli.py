"""The graphamp command line: convert-demo and bench, run in-process (no timing asserted)."""

import json

import pytest

from graphamp.cli.main import main


def test_convert_demo_checks_against_eager(capsys):
    assert main(["convert-demo", "--model", "transformer_encoder", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal to eager autocast: True" in out and "casts in the graph" in out


def test_bench_smoke(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--model", "mlp", "--variants", "autocast", "pure_low", "graphamp", "graphamp_inference",
                 "--rounds", "2", "--json", str(path), "--csv", str(tmp_path / "bench.csv")])
    assert code == 0
    table = capsys.readouterr().out
    assert "| mlp | infer | bf16 | graphamp |" in table
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["autocast"]["vs_autocast"] == 1.0
    for variant in ("graphamp", "graphamp_inference"):
        assert rows[variant]["status"] == "ok" and rows[variant]["max_err"] == 0.0  # exact: bitwise
        assert rows[variant]["median_ms"] > 0
    assert (tmp_path / "bench.csv").read_text().startswith("model,task,dtype,variant")


def test_bench_rejects_unknown_model():
    with pytest.raises(SystemExit):
        main(["bench", "--model", "nope"])
