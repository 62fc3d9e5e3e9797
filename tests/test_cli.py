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


def test_bench_forward_task_runs_eval_with_grad(tmp_path, capsys):
    # The task that shows an exact module's grad-mode program (issue 18's encoder pathology was
    # measured without grad; eager's program differs between the two).
    path = tmp_path / "bench.json"
    # The zoo's own (smaller) encoder: the bench-sized one took 14 s of CI for the same check.
    assert main(["bench", "--model", "graphamp.testing.zoo:transformer_encoder", "--task", "forward", "--variants", "autocast",
                 "graphamp", "graphamp_inference", "--rounds", "1", "--json", str(path)]) == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"autocast", "graphamp"}  # an inference-only variant has no forward with grad
    assert rows["graphamp"]["max_err"] == 0.0 and rows["graphamp"]["task"] == "forward"


def test_bench_rejects_unknown_model():
    with pytest.raises(SystemExit):
        main(["bench", "--model", "nope"])


def test_bench_compiled_variants_and_vs_best(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "compile_autocast", "graphamp_compiled",
                 "graphamp_autotune_compiled", "--rounds", "2", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert all(r["status"] == "ok" for r in rows.values())
    # vs best: over the fastest alternative without graphamp, compile_autocast included, named
    best = min(("fp32", "autocast", "compile_autocast"), key=lambda v: rows[v]["median_ms"])
    for r in rows.values():
        assert r["best"] == best and r["vs_best"] == pytest.approx(r["median_ms"] / rows[best]["median_ms"])
    assert rows[best]["vs_best"] == 1.0 and f"mlp: {best}" in out
    compiled = rows["graphamp_compiled"]
    assert 0 <= compiled["max_err"] < 0.1 and "drift on the example" in compiled["note"]  # not bitwise; near
    tuned = rows["graphamp_autotune_compiled"]
    assert tuned["note"].startswith("autotune (") and "drift on the example" in tuned["note"]


def test_bench_trainstep_compiled(tmp_path):
    path = tmp_path / "bench.json"
    code = main(["bench", "--model", "mlp", "--task", "train", "--variants", "autocast", "trainstep", "trainstep_compiled",
                 "trainstep_autotune", "trainstep_autotune_compiled", "--rounds", "1", "--json", str(path)])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    for v in ("trainstep_compiled", "trainstep_autotune", "trainstep_autotune_compiled"):
        assert rows[v]["status"] == "ok" and rows[v]["median_ms"] > 0, rows[v]
    assert rows["trainstep_autotune"]["note"].startswith("autotune (")


def test_bench_takes_a_models_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_bench_model.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
        "    return model, (torch.randn(4, 8),)\n"
    )
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "--model", "my_bench_model:make", "--variants", "autocast", "graphamp", "--rounds", "1"])
    assert code == 0
    assert "| my_bench_model:make | infer | bf16 | graphamp |" in capsys.readouterr().out


def test_bench_names_a_factory_that_cannot_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no module 'no_such_module'"):
        main(["bench", "--model", "no_such_module:make"])
