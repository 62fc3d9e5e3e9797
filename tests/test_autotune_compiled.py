"""convert(mode="autotune", compile=True): candidate plans, the choice rule, and the chosen program,
under fake times (no test reads the clock)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphamp
from graphamp import hardware
from graphamp.autotune import compiled as autotune_compiled
from graphamp.autotune.measure import MeasurementCache, Trial, measuring

BF16 = torch.bfloat16


def _plan(decisions: dict[str, torch.dtype]) -> graphamp.AutotunePlan:
    return graphamp.AutotunePlan("cpu", BF16, "0" * 16, decisions)


def test_candidates_are_autocasts_dtypes_and_every_op_raised():
    some = autotune_compiled.candidate_plans(_plan({"a": torch.float32, "b": BF16}), BF16)
    assert {name: dict(p.decisions) for name, p in some.items()} == {
        "autocast's dtypes": {"a": BF16, "b": BF16},
        "every op raised": {"a": torch.float32, "b": torch.float32},
    }
    assert list(autotune_compiled.candidate_plans(_plan({"a": torch.float32}), BF16)) == ["autocast's dtypes"]
    assert list(autotune_compiled.candidate_plans(_plan({"a": BF16}), BF16)) == ["every op raised"]


def test_pick_keeps_the_plan_unless_another_is_clearly_faster():
    pick = autotune_compiled.pick
    assert pick({"plan": [10.0, 10.0, 10.0], "every op raised": [9.8, 9.8, 9.8]}) == "plan"  # within the margin
    assert pick({"plan": [10.0] * 3, "every op raised": [9.0] * 3, "autocast's dtypes": [9.5] * 3}) == "every op raised"
    assert pick({"plan": [10.0] * 3, "autocast's dtypes": [11.0] * 3}) == "plan"


def test_pick_compares_within_rounds():
    # A slow spell in the first rounds: the plan's round medians are higher, but within each round
    # the candidate is slower.
    samples = {"plan": [20.0, 20.0, 10.0, 10.0, 10.0], "every op raised": [21.0, 21.0, 11.0, 11.0, 11.0]}
    assert autotune_compiled.pick(samples) == "plan"
    samples = {"plan": [20.0, 20.0, 20.0, 10.0, 10.0], "every op raised": [12.0, 12.0, 12.0, 12.0, 12.0]}
    assert autotune_compiled.pick(samples) == "every op raised"  # 0.6x in three rounds of five


def test_compiled_autotune_returns_the_fastest_candidate(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # train mode: timed with backward
    x = torch.randn(4, 8)
    calls = []

    def fake_times(runs, **kw):
        for run in runs.values():  # each candidate runs (forward and parameter gradients) once
            run()
        calls.append(sorted(runs))
        return {name: [1.0] if name == "every op raised" else [2.0] for name in runs}

    def first_wide(trial: Trial) -> float:  # the first linear stays low, the second is raised
        wide = any(s == (16, 8) for s in trial.shapes)
        return (1.0 if wide else 2.0) if trial.dtype is not torch.float32 else (2.0 if wide else 1.0)

    monkeypatch.setattr(autotune_compiled, "time_programs", fake_times)
    with measuring(timer=lambda fn, trial: first_wide(trial), cache=MeasurementCache(), check_accuracy=False):
        cm = graphamp.convert(model, (x,), dtype=BF16, mode="autotune", compile=True)
    assert calls == [["autocast's dtypes", "every op raised", "plan"]]
    plan = graphamp.AutotunePlan.of(cm.amp)
    assert set(plan.decisions.values()) == {torch.float32} and len(plan.decisions) == 2
    assert plan.compiled.startswith("compiled: every op raised (plan 2 ms, autocast's dtypes 2 ms (1.00x), every op raised 1 ms (0.50x))")
    assert "every op raised: relative RMS error" in plan.accuracy and "compiled: every op raised" in plan.summary()
    assert isinstance(cm, graphamp.CompiledAmpModule) and cm.runs_compiled
    assert cm.drift.dtypes_by_plan and "output dtypes as the autotune plan makes them" in cm.drift.line()
    assert all(p.grad is None for p in model.parameters())  # timing computed gradients without touching .grad
    y = cm(x)
    assert y.dtype == torch.float32  # every op in fp32: the fp32 model, compiled
    torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-5)


def test_a_given_plan_is_compiled_as_it_is(monkeypatch):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 4)).eval(), torch.randn(2, 8)
    with measuring(timer=lambda fn, trial: 1.0 if trial.dtype is torch.float32 else 2.0, cache=MeasurementCache(), check_accuracy=False):
        plan = graphamp.AutotunePlan.of(graphamp.convert(model, (x,), mode="autotune", inference=True))
    monkeypatch.setattr(autotune_compiled, "time_programs", lambda runs, **kw: pytest.fail("a given plan is not re-timed"))
    cm = graphamp.convert(model, (x,), mode="autotune", inference=True, compile=True, config=graphamp.Config(plan=plan))
    assert graphamp.AutotunePlan.of(cm.amp).compiled == "" and dict(graphamp.AutotunePlan.of(cm.amp).decisions) == dict(plan.decisions)


def test_compiled_trainstep_autotune_trains_the_fastest_candidate(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    monkeypatch.setattr(
        autotune_compiled, "time_programs", lambda runs, **kw: {name: [1.0] if name == "autocast's dtypes" else [2.0] for name in runs}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with measuring(timer=lambda fn, trial: 1.0 if trial.dtype is torch.float32 else 2.0, cache=MeasurementCache(), check_accuracy=False):
        step = graphamp.TrainStep(model, nn.functional.mse_loss, opt, dtype=BF16, mode="autotune", compile=True)
        before = [p.detach().clone() for p in model.parameters()]
        losses = [float(step(x, target=y)) for _ in range(2)]
    plan = graphamp.AutotunePlan.of(step.module)
    assert set(plan.decisions.values()) == {BF16} and plan.compiled.startswith("compiled: autocast's dtypes")
    assert step._compiled.amp is step.module and step._compiled.runs_compiled
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters())) and losses[1] < losses[0]


def test_programs_are_timed_with_the_callers_threads(monkeypatch):
    monkeypatch.setattr(autotune_compiled, "MIN_ROUND_S", 0.0)
    seen = []
    samples = autotune_compiled.time_programs({"plan": lambda: seen.append(torch.get_num_threads())}, rounds=2)
    assert set(seen) == {torch.get_num_threads()} and len(seen) >= 3 and len(samples["plan"]) == 2


@pytest.mark.parametrize("unfrozen_wins", [False, True])
def test_inference_tries_without_freezing_then_the_cpp_wrapper_keeping_what_times_faster(monkeypatch, unfrozen_wins):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(4, 8)
    stages = []
    # Each stage's winner: the plan beats every op raised; then "without freezing" wins or not; then
    # the C++ wrapper beats whichever was kept.
    winners = ["plan", "without freezing" if unfrozen_wins else "plan", "C++ wrapper"]

    def fake_times(runs, **kw):
        stages.append(sorted(runs))
        for run in runs.values():
            run()
        return {name: [1.0] if name == winners[len(stages) - 1] else [2.0] for name in runs}

    monkeypatch.setattr(autotune_compiled, "time_programs", fake_times)
    with measuring(timer=lambda fn, trial: 1.0 if trial.dtype is not torch.float32 else 2.0, cache=MeasurementCache(), check_accuracy=False):
        cm = graphamp.convert(model, (x,), dtype=BF16, mode="autotune", inference=True, compile=True)
    assert stages == [["every op raised", "plan"], ["plan", "without freezing"], ["C++ wrapper", "plan"]]
    # The C++ wrapper's build keeps the freezing choice made before it.
    assert cm.options == {"cpp_wrapper": True} and cm.freezing is (not unfrozen_wins)
    assert cm.runs_compiled and "cpp_wrapper=True" in repr(cm) and ("(freezing)" in repr(cm)) is (not unfrozen_wins)
    plan = graphamp.AutotunePlan.of(cm.amp)
    said = "without freezing 1 ms against 2 ms (0.50x), kept" if unfrozen_wins else "without freezing 2 ms against 1 ms (2.00x), not kept"
    assert plan.compiled.startswith("compiled: the plan (") and said in plan.compiled
    assert "C++ wrapper 1 ms against 2 ms (0.50x), kept" in plan.compiled
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    y = cm(x)
    assert y.dtype == expected.dtype and float((y.float() - expected.float()).abs().max()) < 0.05


def test_timing_counts_each_programs_page_faults(monkeypatch):
    monkeypatch.setattr(autotune_compiled, "MIN_ROUND_S", 0.0)
    faults = [0]

    def faulting():
        faults[0] += 992

    monkeypatch.setattr(hardware, "minor_page_faults", lambda: faults[0])
    counted: dict[str, float] = {}
    samples = autotune_compiled.time_programs({"plan": faulting, "every op raised": lambda: None}, rounds=3, faults=counted)
    assert counted == {"plan": 992, "every op raised": 0} and all(len(s) == 3 for s in samples.values())
    said = autotune_compiled.faults_said(counted)
    assert said.startswith("page faults per call: plan 992, every op raised 0") and "#page-faults" in said
    assert autotune_compiled.faults_said({"plan": 1.0, "every op raised": 0.0}) == ""
