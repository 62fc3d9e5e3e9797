"""mode="autotune": decisions under a fake timer (no test reads the clock), plans, errors."""

from __future__ import annotations

import json

import pytest
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphamp
from graphamp.autotune import measure
from graphamp.autotune.measure import MeasurementCache, Trial, measuring
from graphamp.node_info import peek
from graphamp.testing import zoo

BF16 = torch.bfloat16


class FakeTimer:
    """Seconds per call from a rule on the trial; counts its calls, never runs ``fn``."""

    def __init__(self, rule):
        self.rule = rule
        self.trials: list[Trial] = []

    def __call__(self, fn, trial: Trial) -> float:
        self.trials.append(trial)
        return self.rule(trial)


def low_faster(trial: Trial) -> float:
    return 1.0 if trial.dtype is not torch.float32 else 2.0


def fp32_faster(trial: Trial) -> float:
    return 2.0 if trial.dtype is not torch.float32 else 1.0


def by_width(trial: Trial) -> float:
    # Low precision pays off on the wide first layer only (weight (16, 8)); fp32 wins on the narrow one.
    wide = any(s == (16, 8) for s in trial.shapes)
    if trial.dtype is torch.float32:
        return 2.0 if wide else 1.0
    return 1.0 if wide else 2.0


def autotuned(model, args, timer, *, cache=None, check_accuracy=False, **kw):
    # The decisions under test are the timings'; the end-to-end error check has its own tests.
    with measuring(timer=timer, cache=cache or MeasurementCache(), check_accuracy=check_accuracy):
        return graphamp.convert(model, args, mode="autotune", **kw)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), (torch.randn(4, 8),)


def node_dtypes(amp):
    return {n.name: peek(n).dtype for n in amp.graph.nodes if peek(n) is not None and peek(n).category}


def test_plan_picks_the_faster_dtype_per_op():
    model, (x,) = mlp()
    amp = autotuned(model, (x,), FakeTimer(by_width))
    plan = graphamp.AutotunePlan.of(amp)
    assert dict(plan.decisions) == {"linear": BF16, "linear_1": torch.float32}
    assert plan.times_ms["linear_1"] == (2000.0, 1000.0)
    note = peek(amp.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)[1]).notes["autotune"]
    assert note["chosen"] == "fp32" and note["source"] == "measured" and "cpu list" in note["autocast"]
    # The first linear runs as autocast runs it; the second takes its bf16 input, cast up exactly, in fp32.
    with torch.autocast("cpu", dtype=BF16):
        hidden = model[1](model[0](x))
    want = F.linear(hidden.float(), model[2].weight, model[2].bias)
    got = amp(x)
    assert got.dtype is torch.float32 and torch.equal(got, want)


def test_fp32_everywhere_converges_to_fp32_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8)).eval()
    x = torch.randn(4, 8)
    amp = autotuned(model, (x,), FakeTimer(fp32_faster), inference=True)
    assert amp.cast_summary()["casts"] == 0 and "bfloat16" not in amp.code
    assert torch.equal(amp(x), model(x))


def test_low_everywhere_is_exact_mode():
    model, (x,) = mlp()
    amp = autotuned(model, (x,), FakeTimer(low_faster))
    exact = graphamp.convert(model, (x,))
    assert amp.code == exact.code and graphamp.AutotunePlan.of(amp).raised == ()
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(amp(x), model(x))


def test_never_lowers_precision_against_autocast():
    # A model with an op autocast runs in fp32 (mse_loss) and a region autocast leaves alone.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, target):
            with torch.autocast("cpu", enabled=False):
                y = self.b(x)
            return F.mse_loss(self.a(x), target) + y.sum()

    torch.manual_seed(0)
    model, args = Net(), (torch.randn(4, 8), torch.randn(4, 8))
    exact = node_dtypes(graphamp.convert(model, args))
    timer = FakeTimer(low_faster)
    tuned = node_dtypes(autotuned(model, args, timer))
    # Only self.a is a candidate: one signature, timed low, fp32, low, fp32.
    assert {t.op for t in timer.trials} == {"linear"} and len(timer.trials) == 4
    for name, dtype in exact.items():
        assert tuned[name] == dtype
    raised = node_dtypes(autotuned(model, args, FakeTimer(fp32_faster)))
    for name, dtype in exact.items():
        assert raised[name] in (dtype, torch.float32)
        if dtype is torch.float32:
            assert raised[name] is torch.float32


def test_reproduces_from_a_saved_plan_without_measuring(tmp_path):
    model, (x,) = mlp()
    amp = autotuned(model, (x,), FakeTimer(by_width))
    path = tmp_path / "plan.json"
    graphamp.AutotunePlan.of(amp).save(path)
    loaded = graphamp.AutotunePlan.load(path)
    assert loaded == graphamp.AutotunePlan.of(amp)

    def no_timing(fn, trial):
        raise AssertionError("a replayed plan measured")

    replay = autotuned(model, (x,), no_timing, cache=MeasurementCache(), config=graphamp.Config(plan=loaded))
    assert replay.code == amp.code and torch.equal(replay(x), amp(x))
    assert graphamp.AutotunePlan.of(replay) is loaded
    assert {peek(n).notes["autotune"]["source"] for n in replay.graph.nodes if peek(n) and "autotune" in peek(n).notes} == {"plan"}
    # Config also takes the plan's JSON data.
    data = json.loads(path.read_text())
    assert graphamp.Config(plan=data).plan == loaded


def test_measurements_are_cached_per_signature():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    x = torch.randn(4, 8)
    cache, timer = MeasurementCache(), FakeTimer(fp32_faster)
    first = autotuned(model, (x,), timer, cache=cache, inference=True)
    # Three linears, three signatures: the first casts an fp32 input, the second takes the fp32
    # output of a raised op, and only the last does not feed another low-precision op (raised, the
    # others pay a cast of their output). Each is timed once (low, fp32, low, fp32).
    assert len(timer.trials) == 12
    plan = graphamp.AutotunePlan.of(first)
    assert (plan.measured, plan.cached, len(plan.raised)) == (3, 0, 3)
    again = autotuned(model, (x,), timer, cache=cache, inference=True)
    assert len(timer.trials) == 12 and graphamp.AutotunePlan.of(again).cached == 3
    assert again.code == first.code


def test_disk_cache_survives_a_new_cache_object(tmp_path):
    model, (x,) = mlp()
    path = tmp_path / "cache.json"
    timer = FakeTimer(by_width)
    autotuned(model, (x,), timer, cache=MeasurementCache(path))
    count = len(timer.trials)
    amp = autotuned(model, (x,), timer, cache=MeasurementCache(path))
    assert len(timer.trials) == count and graphamp.AutotunePlan.of(amp).raised == ("linear_1",)


def test_budget_spent_keeps_autocast_and_is_reported():
    model, (x,) = mlp()
    timer = FakeTimer(fp32_faster)
    with measuring(timer=timer, cache=MeasurementCache(), budget_s=0):
        amp = graphamp.convert(model, (x,), mode="autotune")
    plan = graphamp.AutotunePlan.of(amp)
    assert timer.trials == [] and plan.unmeasured == 2 and plan.raised == ()
    assert "2 left as autocast unmeasured: the budget was spent" in plan.summary()
    assert amp.code == graphamp.convert(model, (x,)).code


class CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


# Training timings run the backward too: each cast down has a cast back of its gradient.
@pytest.mark.parametrize("inference, low_casts", [(False, 6), (True, 1)])
def test_timings_include_the_casts_each_choice_implies(inference, low_casts):
    torch.manual_seed(0)
    model, x = nn.Linear(8, 8).eval(), torch.randn(4, 8)
    counted = {}

    def timer(fn, trial):
        with CountCasts() as mode:
            fn()
        counted[trial.dtype] = mode.casts
        return low_faster(trial)

    autotuned(model, (x,), timer, inference=inference)
    # Low: input, weight and bias cast down, unless inference froze the parameters at conversion.
    # (With several consumers, a cast is paid by the first op kept low: the graph shares it.)
    assert counted == {BF16: low_casts, torch.float32: 0}


def test_raising_inside_attention_keeps_the_graph_consistent():
    case = zoo.transformer_encoder(d_model=32, layers=2, heads=4)
    model = case.model.train()
    args, kwargs = case.inputs
    # Raise the projections, keep attention's matmuls low: every cast around them must be re-derived.
    timer = FakeTimer(lambda t: (2.0 if t.dtype is not torch.float32 else 1.0) if t.op == "linear" else low_faster(t))
    amp = autotuned(model, args, timer, kwargs=kwargs)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised and len(plan.raised) < len(plan.decisions)
    out = amp(*args, **kwargs)
    with torch.autocast("cpu", dtype=BF16):
        ref = model(*args, **kwargs)
    fp32 = model(*args, **kwargs)
    assert out.dtype is torch.float32 and torch.isfinite(out).all()
    assert (out - fp32).abs().max() <= (ref.float() - fp32).abs().max()
    out.float().sum().backward()  # training still works through the rewritten graph


def test_unknown_mode_is_a_value_error():
    model, (x,) = mlp()
    with pytest.raises(ValueError, match="mode='fast' is not supported.*'autotune'"):
        graphamp.convert(model, (x,), mode="fast")


def test_plan_from_another_model_is_refused():
    model, (x,) = mlp()
    plan = graphamp.AutotunePlan.of(autotuned(model, (x,), FakeTimer(by_width)))
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    with pytest.raises(graphamp.PlanMismatchError, match="another model: it decides 2 low-precision ops, this model has 3.*op #1: this model has linear_1 = linear \\?x16;16x16;16"):
        autotuned(other, (x,), FakeTimer(low_faster), config=graphamp.Config(plan=plan))
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(graphamp.PlanMismatchError, match="first difference is op #0"):
        autotuned(wider, (x,), FakeTimer(low_faster), config=graphamp.Config(plan=plan))


def test_plan_for_another_dtype_is_refused():
    model, (x,) = mlp()
    plan = graphamp.AutotunePlan.of(autotuned(model, (x,), FakeTimer(by_width)))
    with pytest.raises(graphamp.PlanMismatchError, match="made for cpu bfloat16, but this conversion is cpu float16"):
        autotuned(model, (x,), FakeTimer(low_faster), config=graphamp.Config(plan=plan), dtype=torch.float16)


def test_bad_plans_and_plan_without_autotune():
    model, (x,) = mlp()
    plan = graphamp.AutotunePlan.of(autotuned(model, (x,), FakeTimer(by_width)))
    with pytest.raises(ValueError, match="pass mode='autotune'"):
        graphamp.convert(model, (x,), config=graphamp.Config(plan=plan))
    with pytest.raises(TypeError, match="Config.plan must be a graphamp.AutotunePlan"):
        graphamp.Config(plan="plan.json")
    with pytest.raises(ValueError, match="can only keep an op in torch.bfloat16 or raise it to float32"):
        graphamp.AutotunePlan("cpu", BF16, plan.model, {"linear": torch.float16})
    with pytest.raises(ValueError, match="not a graphamp autotune plan"):
        graphamp.AutotunePlan.from_dict({"decisions": {}})
    with pytest.raises(ValueError, match="no autotune plan"):
        graphamp.AutotunePlan.of(graphamp.convert(model, (x,)))
    with pytest.raises(graphamp.OptionError, match="mode='autotune'"):
        from graphamp.backend.options import BackendOptions

        BackendOptions.parse({"config": graphamp.Config(plan=plan)})


def test_backend_option_mode_autotune():
    torch._dynamo.reset()
    model, (x,) = mlp()
    with measuring(timer=FakeTimer(fp32_faster), cache=MeasurementCache()):
        compiled = torch.compile(model, backend="graphamp", options={"mode": "autotune", "inner": "eager"})
        with torch.no_grad():
            out = compiled(x)
    assert out.dtype is torch.float32 and torch.equal(out, model(x))


def test_fused_encoder_layers_are_candidates_too():
    from graphamp.passes.fuse_encoder_layers import FUSED

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 32)
    timer = FakeTimer(fp32_faster)
    amp = autotuned(model, (x,), timer, inference=True)
    assert {t.op for t in timer.trials} == {"_transformer_encoder_layer_fwd"}
    assert len(graphamp.AutotunePlan.of(amp).raised) == 2
    assert [n.target for n in amp.graph.nodes if n.op == "call_function"].count(FUSED) == 2
    with torch.no_grad():
        want = model(x)  # eager fp32 takes the same fused kernel
    got = amp(x)
    assert got.dtype is torch.float32 and torch.equal(got, want)
    kept = autotuned(model, (x,), FakeTimer(low_faster), inference=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        assert torch.equal(kept(x), model(x))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_a_fused_layer_raised_after_one_kept_low_gets_its_input_in_fp32(dtype):
    """Autotune raises layers 0 and 2 and keeps layer 1 under autocast, whose fused kernel returns
    the low dtype (fake propagation says fp32: the kernel casts inside): layer 2's input is cast up.
    (It called layer 2's kernel on a low-precision input and fp32 weights: "expected m1 and m2 to
    have the same dtype", on nn.TransformerEncoder in fp16 on an Intel Xeon with avx512_fp16.)"""
    import dataclasses

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 32)
    plan = graphamp.AutotunePlan.of(autotuned(model, (x,), FakeTimer(fp32_faster), dtype=dtype, inference=True))
    first, second, third = plan.decisions
    mixed = dataclasses.replace(plan, decisions={first: torch.float32, second: dtype, third: torch.float32})
    amp = graphamp.convert(model, (x,), dtype=dtype, mode="autotune", inference=True, config=graphamp.Config(plan=mixed))
    for inp in (x, torch.randn(3, 5, 32)):
        with torch.no_grad():
            h = model.layers[0](inp)
            with torch.autocast("cpu", dtype=dtype):
                h = model.layers[1](h)
            assert h.dtype is dtype
            want = model.layers[2](h.float())
        got = amp(inp)
        assert got.dtype is torch.float32 and torch.equal(got, want)


def test_a_tie_keeps_autocasts_choice():
    model, (x,) = mlp()
    amp = autotuned(model, (x,), FakeTimer(lambda trial: 1.0))
    assert graphamp.AutotunePlan.of(amp).raised == () and amp.code == graphamp.convert(model, (x,)).code


def test_fp32_timing_pays_the_output_cast_a_low_consumer_needs():
    model, (x,) = mlp()
    counted = {}

    def timer(fn, trial):
        with CountCasts() as mode:
            fn()
        counted.setdefault(trial.shapes, {})[trial.dtype] = mode.casts
        return low_faster(trial)

    autotuned(model, (x,), timer, inference=True)
    # The first linear feeds the second (through relu): raised, its output is cast down for it.
    assert counted[((4, 8), (16, 8), (16,))] == {BF16: 1, torch.float32: 1}
    # The second takes the first's bf16 output and feeds nothing low: fp32 casts its input up, low
    # casts nothing (inference froze the weights).
    assert counted[((4, 16), (4, 16), (4,))] == {BF16: 0, torch.float32: 1}


def test_timing_includes_the_ops_whose_precision_the_choice_decides():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    ran: dict[tuple, list[str]] = {}

    class Ops(TorchDispatchMode):
        def __init__(self, names):
            super().__init__()
            self.names = names

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def timer(fn, trial):
        with Ops(ran.setdefault((trial.shapes, trial.dtype), [])):
            fn()
        return low_faster(trial)

    autotuned(model, (x,), timer, inference=True)
    first_fp32 = ran[(((4, 8), (16, 8), (16,)), torch.float32)]
    # The first linear's choice decides the dtype of the batch norm and relu after it: they are timed
    # with it, and raised, its output is cast down for the next linear.
    assert "addmm" in first_fp32 and "native_batch_norm" in first_fp32 and "relu" in first_fp32
    assert first_fp32[-1] == "_to_copy"


def test_bench_variant_and_columns(capsys, tmp_path):
    from graphamp.cli.main import main

    with measuring(timer=FakeTimer(fp32_faster), cache=MeasurementCache()):
        code = main(["bench", "--model", "mlp", "--variants", "fp32", "autocast", "graphamp_autotune", "--rounds", "2",
                     "--json", str(tmp_path / "bench.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("capability: ") and "bf16 matmul" in out
    assert "vs fp32" in out and "vs best" in out and "err vs fp32 (autocast's)" in out
    rows = {r["variant"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    tuned = rows["graphamp_autotune"]
    assert tuned["status"] == "ok" and "4 of 4 low-precision ops raised" in tuned["note"]
    assert tuned["err_vs_fp32"] == 0.0 and rows["autocast"]["err_vs_fp32"] > 0  # all fp32: fp32's output
    assert tuned["vs_best"] is not None and tuned["vs_fp32"] is not None


def test_an_op_that_cannot_be_timed_keeps_autocasts_dtype():
    model, (x,) = mlp()

    def broken(fn, trial):
        raise RuntimeError("no kernel for this layout")

    amp = autotuned(model, (x,), broken)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.unmeasured == 2 and plan.raised == () and amp.code == graphamp.convert(model, (x,)).code
    note = peek(amp.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)[0]).notes["autotune"]
    assert note["source"].startswith("not measured: RuntimeError: no kernel")


def test_a_burst_of_load_is_measured_again():
    model, (x,) = mlp()
    # The first low timing of the first op is hit by a burst (100x): later rounds are clean.
    calls = []

    def bursty(fn, trial):
        calls.append(trial)
        if len(calls) == 1:
            return 100.0
        return low_faster(trial)

    amp = autotuned(model, (x,), bursty)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised == () and plan.times_ms["linear"] == (1000.0, 2000.0)
    # Two rounds (low, fp32) for the clean op; three for the disturbed one, until two agreed.
    assert len(calls) == 6 + 4


def test_timings_that_never_settle_decide_now_but_are_not_cached(tmp_path):
    model, (x,) = mlp()
    # Every round of every timing differs 3x from the last: the rounds never agree.
    calls = []

    def unsettled(fn, trial):
        calls.append(trial)
        return fp32_faster(trial) * (3.0 ** len(calls))

    path = tmp_path / "cache.json"
    amp = autotuned(model, (x,), unsettled, cache=MeasurementCache(path))
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.measured == 2 and len(calls) == 2 * 2 * 4  # two ops, four rounds of (low, fp32) each
    assert not MeasurementCache(path)._load()  # nothing disturbed was written for later conversions
    again = autotuned(model, (x,), FakeTimer(low_faster), cache=MeasurementCache(path))
    assert graphamp.AutotunePlan.of(again).measured == 2


def test_a_steady_large_ratio_settles_in_three_rounds_and_is_cached(tmp_path):
    # A CPU that emulates the low dtype makes it 50x slower, every round: real, not a burst.
    model, (x,) = mlp()
    calls = []

    def emulated(fn, trial):
        calls.append(trial)
        return 50.0 if trial.dtype is not torch.float32 else 1.0

    path = tmp_path / "cache.json"
    amp = autotuned(model, (x,), emulated, cache=MeasurementCache(path))
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised == ("linear", "linear_1") and len(calls) == 2 * 2 * 3  # two ops, three rounds each
    assert graphamp.AutotunePlan.of(autotuned(model, (x,), emulated, cache=MeasurementCache(path))).cached == 2


def test_wall_timer_times_a_slow_call_once():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(measure._SLOW_CALL_S * 1.2)

    t = measure.wall_timer(slow, measure.Trial("mm", torch.float16, ((8, 8),), torch.device("cpu")))
    assert len(calls) == 1 and t >= measure._SLOW_CALL_S


class Cancels(nn.Module):
    """Autocast computes the same product twice, as ``linear`` and as ``matmul`` (one kernel, so the
    same bits), and subtracts: exactly 0, as fp32. Raising one of the two (not the other) leaves the
    low copy's rounding error in the output. Two ops, so that each is measured on its own."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return F.linear(x, self.w) - torch.matmul(x, self.w.t())


def linear_fp32_faster(linear=(2.0, 1.0), matmul=(1.0, 2.0)):
    """A FakeTimer rule: seconds (low, fp32) for the linear and for the matmul."""

    def rule(trial):
        low, fp32 = linear if "linear" in trial.op else matmul
        return fp32 if trial.dtype is torch.float32 else low

    return rule


def test_a_raised_program_less_accurate_than_autocast_on_the_example_is_undone():
    torch.manual_seed(0)
    model, x = Cancels().eval(), torch.randn(4, 8)
    unchecked = autotuned(model, (x,), FakeTimer(linear_fp32_faster()))
    assert graphamp.AutotunePlan.of(unchecked).raised == ("linear",)
    assert unchecked(x).abs().max() > 0  # the raised program: above autocast's error, which is 0
    amp = autotuned(model, (x,), FakeTimer(linear_fp32_faster()), check_accuracy=True)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised == () and plan.accuracy.startswith("raises undone: with 1 op(s) raised")
    assert plan.times_ms["linear"] == (2000.0, 1000.0)  # what was measured stays on record
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(amp(x), model(x))
    assert "raises undone" in plan.summary()


def test_a_tuned_program_that_raises_on_the_example_is_never_kept(monkeypatch):
    """The accuracy check runs the tuned program: where it raises (as a fused layer fed the wrong
    dtype did), its error is infinite and the raises are undone; it was kept, "error not checked"."""
    from graphamp.autotune import accuracy

    real = accuracy.outputs_and_grads_of

    def tuned_programs_raise(program, model, *rest):
        if program is not model:
            raise RuntimeError("expected m1 and m2 to have the same dtype")
        return real(program, model, *rest)

    monkeypatch.setattr(accuracy, "outputs_and_grads_of", tuned_programs_raise)
    torch.manual_seed(0)
    model, x = Cancels().eval(), torch.randn(4, 8)
    amp = autotuned(model, (x,), FakeTimer(linear_fp32_faster()), check_accuracy=True)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised == (), plan.accuracy
    assert plan.accuracy == ("raises undone: with 1 op(s) raised, the tuned program raised on the example "
                             "(RuntimeError: expected m1 and m2 to have the same dtype)"), plan.accuracy
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(amp(x), model(x))


def test_a_raised_op_reads_the_fp32_input_its_shared_cast_was_made_from():
    """Exact mode shares x's bf16 cast between the linear and the matmul (``autocast_cached``, as
    eager's cast cache would); raised, the matmul must read x itself, not that cast cast back up."""

    class TwoProducts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return F.linear(x, self.w1) + torch.matmul(x, self.w2)

    torch.manual_seed(0)
    model, x = TwoProducts().eval(), torch.randn(4, 8)
    assert "autocast_cached" in graphamp.convert(model, (x,)).code
    amp = autotuned(model, (x,), FakeTimer(fp32_faster))
    assert graphamp.AutotunePlan.of(amp).raised == ("linear", "matmul")
    assert "bfloat16" not in amp.code and torch.equal(amp(x), model(x))


def test_a_less_accurate_plan_becomes_every_op_raised_where_that_measures_faster():
    """The partial plan fails the check; raising the matmul too is fp32 (error 0, as autocast's
    here) and measures faster in sum (1.0 + 1.5 against 3.0 + 1.0), so that is the program."""
    torch.manual_seed(0)
    model, x = Cancels().eval(), torch.randn(4, 8)
    amp = autotuned(model, (x,), FakeTimer(linear_fp32_faster(linear=(3.0, 1.0), matmul=(1.0, 1.5))), check_accuracy=True)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised == ("linear", "matmul")
    assert plan.accuracy.startswith("every op raised instead: with 1 op(s) raised,") and plan.accuracy.endswith(" 0")
    assert "measured 2.5e+03 ms in fp32 against 4e+03 ms in bf16" in plan.accuracy, plan.accuracy
    assert torch.equal(amp(x), model(x))  # fp32's program: exactly 0


def test_the_accuracy_check_keeps_raises_that_are_no_less_accurate_and_touches_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    x = torch.randn(6, 8)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    amp = autotuned(model, (x,), FakeTimer(fp32_faster), check_accuracy=True)
    plan = graphamp.AutotunePlan.of(amp)
    assert plan.raised == ("linear", "linear_1") and plan.accuracy.startswith("relative RMS error vs fp32 on the example (outputs and gradients) 0,")
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())  # batch-norm stats restored
    assert torch.equal(torch.get_rng_state(), rng)
    again = graphamp.AutotunePlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_the_accuracy_check_compares_gradients_and_leaves_grad_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).train()
    x = torch.randn(6, 8)
    amp = autotuned(model, (x,), FakeTimer(fp32_faster), check_accuracy=True)
    assert "(outputs and gradients)" in graphamp.AutotunePlan.of(amp).accuracy
    assert all(p.grad is None for p in model.parameters())  # torch.autograd.grad, not backward
    inference = autotuned(model.eval(), (x,), FakeTimer(fp32_faster), check_accuracy=True, inference=True)
    assert "(outputs)" in graphamp.AutotunePlan.of(inference).accuracy


def test_the_accuracy_error_is_one_rms_ratio_per_group():
    from graphamp.autotune.accuracy import relative_error as _error

    ref = ([torch.tensor([3.0, 4.0])], [torch.tensor([1.0, 0.0]), torch.tensor([1e-9, -1e-9])])
    same = ([torch.tensor([3.0, 4.0])], [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])])
    # The nearly-zero gradient is off by 100%, but weighs by its size in its group.
    assert _error(same, ref) == pytest.approx(2**0.5 * 1e-9, rel=1e-3)  # sqrt(2e-18 / 1)
    off = ([torch.tensor([3.0, 4.5])], ref[1])
    assert _error(off, ref) == pytest.approx(0.5 / 5.0)  # rms ratio of the outputs: sqrt(0.25 / 25)
    assert _error(([torch.tensor([0.0, float("nan")])], ref[1]), ref) == float("inf")  # a new NaN
    zeros = ([torch.zeros(2)],)
    assert _error(([torch.tensor([0.0, 2.0])],), zeros) == pytest.approx(2.0 / 2**0.5)  # all-zero ref: the RMS itself
