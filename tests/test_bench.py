"""graphamp.bench's choices: the default variants per CPU class, the alternatives it compares with,
the recommendation line and the time-left estimate (no timing asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from graphamp import bench
from graphamp.bench import progress as bench_progress, variants as bench_variants
from graphamp.autotune import compiled as autotune_compiled
from graphamp.bench import Row
from graphamp.cli import main
from graphamp.hardware import assume_cpu_flags


def test_the_default_variants_follow_the_measured_matmul_rates(monkeypatch):
    rates = {torch.float32: 100.0, torch.bfloat16: 500.0, torch.float16: 105.0}  # as on a Xeon with AMX-bf16 and avx512_fp16
    monkeypatch.setattr(bench.bench_limits, "gemm_rate", lambda dtype, n: rates[dtype])
    with assume_cpu_flags(["amx_bf16", "avx512_bf16", "avx512_fp16"]):
        assert bench.default_variants("infer", "bf16") == ("fp32", "autocast", "compile_autocast_freezing", "graphamp_inference", "graphamp_compiled")
        # fp16 is native there but no faster than fp32: compiled fp32 is the alternative to beat
        assert bench.default_variants("train", "fp16") == ("fp32", "autocast", "compile_fp32", "graphamp", "graphamp_autotune")
        assert bench.default_variants("infer", "fp16")[2] == "compile_fp32_freezing"

    def unmeasured(dtype, n):
        raise AssertionError("an emulated dtype is not timed")

    monkeypatch.setattr(bench.bench_limits, "gemm_rate", unmeasured)
    with assume_cpu_flags([]):
        assert bench.default_variants("infer", "bf16")[2] == "compile_fp32_freezing"
        assert not bench.low_matmul_faster(torch.bfloat16)


def _row(variant: str, ms: float) -> Row:
    return Row("bert", "infer", "bf16", variant, median_ms=ms)


def test_the_recommendation_names_the_fastest_at_autocasts_accuracy():
    rows = [_row("fp32", 80.0), _row("autocast", 500.0), _row("compile_fp32_freezing", 60.0), _row("graphamp", 450.0),
            _row("graphamp_autotune", 75.0), _row("compile_pure_low", 20.0)]
    line = bench.recommendation(rows)
    # pure low precision is faster but changes the numerics: not recommended
    assert line.startswith("bert (infer, bf16): use compile_fp32_freezing (60 ms)")
    assert "graphamp's fastest, graphamp_autotune, takes 1.25x its time" in line
    rows.append(_row("graphamp_compiled", 50.0))
    line = bench.recommendation(rows)
    assert line.startswith("bert (infer, bf16): use graphamp_compiled (50 ms): 1.20x faster than the fastest alternative, compile_fp32_freezing")


def test_the_recommendation_says_when_the_order_is_within_noise():
    rows = [_row("autocast", 23.4), _row("graphamp_compiled", 23.1)]
    (rows[0].p10_ms, rows[0].p90_ms), (rows[1].p10_ms, rows[1].p90_ms) = (21.9, 25.2), (22.6, 23.6)
    line = bench.recommendation(rows)
    assert line == ("bert (infer, bf16): use graphamp_compiled (23.1 ms): 1.01x faster than the fastest alternative, autocast "
                    "(23.4 ms), at autocast's accuracy or better (within this run's noise: their p10-p90 ranges overlap).")
    rows[0].p10_ms = 23.7  # apart: the order stands
    assert bench.recommendation(rows).endswith("at autocast's accuracy or better.")


def test_a_budgeted_variant_is_recommended_only_at_autocasts_accuracy():
    rows = [_row("fp32", 80.0), _row("autocast", 500.0), _row("compile_fp32", 60.0), _row("graphamp_budget_compiled", 40.0)]
    rows[-1].err_vs_fp32, rows[-1].autocast_err_vs_fp32 = 0.002, 0.001  # within its budget, less accurate than autocast
    line = bench.recommendation(rows)
    assert line.startswith("bert (infer, bf16): use compile_fp32 (60 ms)")
    assert "within its error budget, graphamp_budget_compiled takes 40 ms (0.67x compile_fp32), at an error vs fp32 of 0.002 against eager autocast's 0.001" in line
    rows[-1].err_vs_fp32 = 0.0005  # as accurate as autocast, or more: it counts
    assert bench.recommendation(rows).startswith("bert (infer, bf16): use graphamp_budget_compiled (40 ms)")


def test_the_estimate_uses_this_runs_measurements():
    eta = bench_progress.Estimate([("m", "fp32", ("eager", 1.0)), ("m", "graphamp_compiled", ("compile", 1.0)),
                           ("m", "compile_fp32", ("compile", 2.0))], rounds=3)
    prior = 5.0 + 40.0 + 2 * 40.0 + 3 * 3 * 1.0
    assert eta.left_s() == pytest.approx(prior)
    eta.prepared("m", "graphamp_compiled", 10.0)  # compiles here take 10 s, not the prior's 40
    eta.prepared("m", "fp32", 1.0)
    assert eta.left_s() == pytest.approx(2 * 10.0 + 3 * 3 * 1.0)
    eta.prepared("m", "compile_fp32", 20.0)
    for v, s in (("fp32", 0.5), ("graphamp_compiled", 0.25), ("compile_fp32", 0.25)):
        eta.per_round("m", v, s)
    eta.timed("m", "fp32")
    assert eta.left_s() == pytest.approx(2 * 0.5 + 3 * 0.25 + 3 * 0.25)
    assert "s elapsed, about" in eta.line()


def test_the_estimate_scales_to_the_model_being_prepared():
    # A small model's compiles said little of a large one's: once the large one has compiled once,
    # its own setups count, and a variant's rounds are known from its warm-up calls.
    work = [(m, v, bench_progress.setup_kind(v, False)) for m in ("small", "large") for v in ("fp32", "graphamp_compiled", "graphamp_autotune_compiled")]
    eta = bench_progress.Estimate(work, rounds=2)
    for v, s in (("fp32", 0.1), ("graphamp_compiled", 2.0), ("graphamp_autotune_compiled", 6.0)):
        eta.prepared("small", v, s)
        eta.per_round("small", v, 0.1)
    for v in ("fp32", "graphamp_compiled", "graphamp_autotune_compiled"):
        for _ in range(2):
            eta.timed("small", v)
    eta.prepared("large", "fp32", 1.0)
    eta.per_round("large", "fp32", 5.0)  # from its warm-up: large rounds
    eta.prepared("large", "graphamp_compiled", 30.0)
    eta.per_round("large", "graphamp_compiled", 5.0)
    # The autotune variant's three compiles at the large model's 30 s; rounds at its variants' 5 s.
    assert eta.left_s() == pytest.approx(3 * 30.0 + 3 * 2 * 5.0)


@pytest.mark.parametrize("faster", [True, False])
def test_a_compiled_alternative_gets_the_cpp_wrapper_where_it_wins(monkeypatch, faster):
    built = []

    def compiled_call(options):
        built.append(options)
        return lambda: options

    fake = {"plan": [2.0] * 3, "C++ wrapper": [1.0 if faster else 2.0] * 3}
    monkeypatch.setattr(autotune_compiled, "time_programs", lambda steps: fake)
    call, note = bench_variants.faster_with_cpp_wrapper(compiled_call({}), compiled_call, lambda call, params: call)
    assert built == [{}, {"cpp_wrapper": True}]
    assert (call() == {"cpp_wrapper": True}) is faster
    assert note.startswith("inductor's C++ wrapper kept" if faster else "inductor's C++ wrapper tried, not kept")


def test_compiled_fp32_and_pure_low_are_alternatives(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "pure_low", "compile_fp32", "compile_fp32_freezing",
                 "compile_pure_low", "graphamp", "--rounds", "1", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    best = min(("fp32", "autocast", "compile_fp32", "compile_fp32_freezing"), key=lambda v: rows[v]["median_ms"])
    low = min(("pure_low", "compile_pure_low"), key=lambda v: rows[v]["median_ms"])
    for r in rows.values():
        assert r["best"] == best and r["vs_best"] == pytest.approx(r["median_ms"] / rows[best]["median_ms"])
        assert r["vs_pure_low"] == pytest.approx(r["median_ms"] / rows[low]["median_ms"])
    assert rows["compile_fp32_freezing"]["err_vs_fp32"] < rows["compile_pure_low"]["err_vs_fp32"]
    assert "mlp (infer, bf16): use " in out


def test_limits_say_where_the_time_goes(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "graphamp", "--rounds", "1", "--limits", "--json", str(path)])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    fastest = min(rows.values(), key=lambda r: r["median_ms"])
    assert fastest["limits"].startswith("matmul-only bound") and f"the fastest variant, {fastest['variant']}," in fastest["limits"]
    assert [r for r in rows.values() if r["limits"]] == [fastest]
    assert "where the time goes: matmul-only bound" in capsys.readouterr().out


def test_a_variant_compiled_after_many_others_is_really_compiled(monkeypatch):
    # Every compiled variant compiles the same forward; past dynamo's recompile limit (8) a further
    # torch.compile would run the model eagerly in fp32 without a word, under the variant's name.
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval()
    x = torch.randn(4, 8)
    with bench._every_variant_compiled(), torch.no_grad():
        for _ in range(10):  # a new backend each time: dynamo compiles again (BACKEND_MATCH)
            torch.compile(model, backend=lambda gm, example: gm.forward)(x)
        out = torch.compile(model, backend="graphamp", options={"dtype": torch.bfloat16})(x)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want = model(x)
    assert out.dtype == want.dtype == torch.bfloat16  # mixed precision, not fp32 eager
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)


def test_page_faults_per_call_are_counted_and_said(tmp_path, capsys, monkeypatch):
    # A stand-in for the process's fault counter: the graphamp row's calls fault 500 pages each (as
    # a compiled conv net did where glibc gave its buffers back to the OS between calls), others none.
    faults = [0]
    real_prepare = bench.prepare

    def prepare(v, *args, **kwargs):
        variant = real_prepare(v, *args, **kwargs)
        if v == "graphamp":
            step = variant.step

            def faulting():
                faults[0] += 500
                return step()

            variant.step = faulting
        return variant

    monkeypatch.setattr(bench, "prepare", prepare)
    monkeypatch.setattr(bench.hardware, "minor_page_faults", lambda: faults[0])
    path = tmp_path / "bench.json"
    assert main(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "graphamp", "--rounds", "2", "--json", str(path)]) == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["graphamp"]["faults_per_call"] == 500 and rows["fp32"]["faults_per_call"] == 0 == rows["autocast"]["faults_per_call"]
    out = capsys.readouterr().out
    assert "| faults/call |" in out and "page faults per call: mlp graphamp (500)." in out and "docs/benchmark.md#page-faults" in out


def test_no_fault_note_where_no_variant_faulted():
    rows = [Row("m", "infer", "bf16", "fp32", median_ms=1.0, faults_per_call=0.0), Row("m", "infer", "bf16", "graphamp", median_ms=1.0, faults_per_call=3.0)]
    assert "page faults" not in bench.table(rows) and "| 0 |" in bench.table(rows)


def test_a_run_records_the_allocator_settings_it_ran_with(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    path = tmp_path / "bench.json"
    assert main(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "--rounds", "1", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["environment"] == {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"}
    assert "GLIBC_TUNABLES=glibc.malloc.trim_threshold=4294967296" in doc["machine"] in capsys.readouterr().out


def test_the_recommendation_does_not_compare_the_fastest_alternative_with_itself():
    rows = [Row("m", "infer", "bf16", v, median_ms=ms) for v, ms in [("fp32", 5.0), ("compile_autocast_freezing", 1.5)]]
    assert bench.recommendation(rows) == "m (infer, bf16): use compile_autocast_freezing (1.5 ms), the fastest of the variants run."


def _command(args: list[str], env: dict[str, str]):
    import subprocess
    import sys

    code = "import sys; from graphamp.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc thresholds: this C library is not glibc")
def test_the_graphamp_command_benches_with_glibcs_thresholds_set(tmp_path):
    import os

    from graphamp.cli.bench import ALLOCATOR_ENV, STEADY_MALLOC

    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    steady, defaults = tmp_path / "steady.json", tmp_path / "defaults.json"
    run = _command(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "--rounds", "1", "--json", str(steady)], env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(steady.read_text())["environment"] == {"GLIBC_TUNABLES": STEADY_MALLOC}
    assert "malloc: glibc's thresholds set by graphamp bench" in run.stdout
    run = _command(["bench", "--model", "mlp", "--variants", "fp32", "--rounds", "1", "--malloc-defaults", "--json", str(defaults)], env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(defaults.read_text())["environment"] == {} and "malloc:" not in run.stdout
    # A choice of the user's own is kept as it is.
    own = "glibc.malloc.arena_max=2"
    run = _command(["bench", "--model", "mlp", "--variants", "fp32", "--rounds", "1", "--json", str(defaults)], {**env, "GLIBC_TUNABLES": own})
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(defaults.read_text())["environment"] == {"GLIBC_TUNABLES": own} and "malloc:" not in run.stdout


def test_the_round_order_alternates(monkeypatch):
    # A variant's first calls after another one ran are the slower (its weights were evicted), so no
    # variant may always follow the same one: the order reverses every other round.
    names = {}
    real_prepare = bench.prepare

    def prepare(v, *args, **kwargs):
        variant = real_prepare(v, *args, **kwargs)
        names[variant.step] = v
        return variant

    timed = []

    def seconds_per_call(step, number):
        if number > 1:  # a round's window (the first call, number=1, sizes it)
            timed.append(names[step])
        return 1e-3

    monkeypatch.setattr(bench, "prepare", prepare)
    monkeypatch.setattr(bench, "_seconds_per_call", seconds_per_call)
    bench.run(["mlp"], task="infer", dtype="bf16", variants=["fp32", "autocast", "graphamp"], rounds=3, limits=False)
    assert timed == ["fp32", "autocast", "graphamp", "graphamp", "autocast", "fp32", "fp32", "autocast", "graphamp"]


def test_the_rerun_keeps_pythons_own_options(monkeypatch):
    # python -W error -X dev -m graphamp bench ...: the re-run with glibc's thresholds set runs under
    # the same warning filters and -X options.
    from graphamp.cli import bench as bench_cli

    ran = []
    monkeypatch.setattr(bench_cli.os, "execve", lambda path, argv, env: ran.append(argv))
    monkeypatch.setattr(bench_cli.platform, "libc_ver", lambda: ("glibc", "2.36"))
    for name in bench_cli.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bench_cli.sys, "warnoptions", ["error::DeprecationWarning"])
    monkeypatch.setattr(bench_cli.sys, "_xoptions", {"faulthandler": True})
    bench_cli.rerun_with_steady_malloc(["bench", "--model", "mlp"])
    (argv,) = ran
    flags = argv[1:argv.index("-c")]
    assert "-Werror::DeprecationWarning" in flags and ["-X", "faulthandler"] in [flags[i:i + 2] for i in range(len(flags))]
    assert argv[-3:] == ["bench", "--model", "mlp"]
