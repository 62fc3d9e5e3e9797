"""mode="budget": op types moved off autocast's dtype where the program is faster within an error budget."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import graphamp
from graphamp.autotune import budget as budget_module
from graphamp.autotune.accuracy import relative_error
from graphamp.backend.options import BackendOptions
from graphamp.errors import OptionError


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(d, 4 * d), nn.LayerNorm(4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).eval(), torch.randn(16, 32)


def _timed_as(faster: callable):
    """A stand-in for time_programs: each program's time says whether ``faster(before, after)``."""

    def time_programs(runs, *, rounds):
        return {"before": [1.0] * rounds, "after": [0.5 if faster() else 1.5] * rounds}

    return time_programs


def _errors(amp: nn.Module, model: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return relative_error(([amp(x).float()],), ([model(x)],))


def test_a_loose_budget_lowers_what_autocast_keeps_in_fp32(monkeypatch):
    model, x = _model()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget", config=graphamp.Config(error_budget=1.0))
    plan = graphamp.BudgetPlan.of(amp)
    # Every op type in the graph was tried once and, faster and within 1.0, kept.
    assert {s.op for s in plan.steps} >= {"linear", "layer_norm", "gelu", "add.Tensor"}
    assert set(plan.lowered) >= {"layer_norm", "add.Tensor"} and "linear" in plan.raised
    assert all(s.kept for s in plan.steps if s.tried == "lower_precision_fp")
    # The program does what the plan says: layer norm in bf16, and its nodes say why.
    norms = [n for n in amp.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    assert norms and all(n.meta["val"].dtype is torch.bfloat16 for n in norms)
    assert all("budget plan" in graphamp.node_info.peek(n).reason for n in norms)
    assert plan.error[0] <= 1.0 and plan.error[0] == pytest.approx(_errors(amp, model, x), rel=1e-6)


def test_the_default_budget_is_twice_autocasts_error_and_refuses_what_exceeds_it(monkeypatch):
    model, x = _model()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget")
    plan = graphamp.BudgetPlan.of(amp)
    assert plan.budget == pytest.approx(tuple(budget_module.BUDGET_FACTOR * e for e in plan.autocast_error))
    for step in plan.steps:
        within = step.error <= plan.budget[0] and step.error_held_back <= plan.budget[1]
        assert step.kept == within, step
        if not within:
            assert "over the budget" in step.why and step.time_ratio is None
    assert plan.error[0] <= plan.budget[0] and plan.error[1] <= plan.budget[1]


def test_nothing_slower_is_kept(monkeypatch):
    model, x = _model()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: False))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget", config=graphamp.Config(error_budget=1.0))
    plan = graphamp.BudgetPlan.of(amp)
    assert plan.overrides == {} and plan.steps and not any(s.kept for s in plan.steps)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with torch.no_grad():
        assert torch.equal(amp(x), expected)  # autocast's program, as it was


def test_a_plan_replays_without_measuring(monkeypatch, tmp_path):
    model, x = _model()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget", config=graphamp.Config(error_budget=1.0))
    plan = graphamp.BudgetPlan.of(amp)
    plan.save(tmp_path / "plan.json")
    loaded = graphamp.BudgetPlan.load(tmp_path / "plan.json")
    assert loaded == plan and json.loads((tmp_path / "plan.json").read_text())["kind"] == "budget"

    def no_timing(*a, **k):
        raise AssertionError("a replayed plan measures nothing")

    monkeypatch.setattr(budget_module, "time_programs", no_timing)
    again = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget", config=graphamp.Config(plan=loaded))
    y = torch.randn(5, 32)  # another batch size converts again from the plan too
    with torch.no_grad():
        assert torch.equal(again(x), amp(x)) and torch.equal(again(y), amp(y))
    with pytest.raises(graphamp.PlanMismatchError, match="float16"):
        graphamp.convert(model, (x,), dtype=torch.float16, mode="budget", config=graphamp.Config(plan=loaded))


def test_training_counts_gradients_and_keeps_the_models_parameters(monkeypatch):
    model, x = _model()
    model.train()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, mode="budget", config=graphamp.Config(error_budget=1.0))
    plan = graphamp.BudgetPlan.of(amp)
    assert plan.lowered
    amp(x).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in model.parameters())


def test_the_search_copies_its_capture_without_torchs_leafspec_warning(monkeypatch):
    # Each trial converts a copy of one capture. A training graph's output spec is a LeafSpec, and
    # deep-copying one made torch print a FutureWarning ("isinstance(treespec, LeafSpec) is
    # deprecated") to every user of mode="budget" in training.
    import warnings

    model, x = _model()
    model.train()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, mode="budget", config=graphamp.Config(error_budget=1.0))
    assert not [w for w in caught if "LeafSpec" in str(w.message)], [str(w.message) for w in caught]
    assert graphamp.BudgetPlan.of(amp).lowered
    torch.testing.assert_close(amp(x).float(), model(x), atol=0.5, rtol=0.5)  # the copy runs, pytree output included


def test_fp32_modules_stay_fp32_whatever_the_search_tries(monkeypatch):
    model, x = _model()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    config = graphamp.Config(error_budget=1.0, fp32_modules=("1",))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget", config=config)
    assert graphamp.BudgetPlan.of(amp).lowered
    norms = [n for n in amp.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    reasons = [graphamp.node_info.peek(n).reason for n in norms]
    assert len(norms) == 2 and "budget plan" in reasons[0] and "kept in fp32 by config" in reasons[1], reasons
    assert [n.meta["val"].dtype for n in norms] == [torch.bfloat16, torch.float32]


def test_explain_lists_every_step(monkeypatch, tmp_path):
    model, x = _model()
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    e = graphamp.explain(model, (x,), dtype=torch.bfloat16, mode="budget", config=graphamp.Config(error_budget=1.0), numerics=False)
    assert e.plan and e.plan[0].startswith("budget (bfloat16)") and any(line.startswith("layer_norm") for line in e.plan[1:])
    assert "budget (bfloat16)" in str(e) and "budget (bfloat16)" in e.to_html()
    assert any("budget plan" in n.reason for n in e.nodes if n.op.endswith("layer_norm.default"))


def test_held_back_batch_redraws_values_not_structure():
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    x = torch.randn(2, 3) * 5 + 2
    (a,), kw = budget_module.held_back((ids,), {"mask": mask, "x": x, "n": 3})
    assert a.shape == ids.shape and not torch.equal(a, ids) and int(a.min()) >= int(ids.min()) and int(a.max()) <= int(ids.max())
    assert torch.equal(kw["mask"], mask) and kw["n"] == 3 and kw["x"].shape == x.shape and not torch.equal(kw["x"], x)


def test_options_are_checked():
    with pytest.raises(ValueError, match="error_budget"):
        graphamp.Config(error_budget=-1.0)
    with pytest.raises(ValueError, match="error_budget"):
        graphamp.Config(error_budget=math.inf)
    model, x = _model()
    with pytest.raises(ValueError, match="mode='budget'"):
        graphamp.convert(model, (x,), config=graphamp.Config(error_budget=0.01))
    with pytest.raises(OptionError, match="budget"):
        BackendOptions.parse({"mode": "budget"})


def test_an_override_on_fp32_inputs_moves_the_ops_after_it():
    """Config(op_overrides={"linear": "fp32"}) on a linear whose inputs are already fp32: the ops it
    feeds see an fp32 value, so a low-precision op after it casts it down (the captured value said
    bf16, as eager autocast's linear gives)."""

    class LinearThenMatmul(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h @ h.t()

    torch.manual_seed(0)
    model, x = LinearThenMatmul(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, config=graphamp.Config(op_overrides={"linear": "fp32"}))
    h = model.fc(x)
    expected = h.bfloat16() @ h.bfloat16().t()
    out = amp(x)
    assert out.dtype is torch.bfloat16 and torch.equal(out, expected)


def test_a_transformers_bert_within_its_budget_on_both_batches(monkeypatch):
    """End to end on model code graphamp did not write: transformers' BERT (small config, random
    weights), the default budget, training (outputs and gradients count)."""
    pytest.importorskip("transformers")
    from graphamp.autotune.accuracy import outputs_and_grads_of, checked_params
    from graphamp.spec import AmpSpec
    from graphamp.testing import zoo

    case = zoo.bert()
    model = case.model.train()
    args, kwargs = case.inputs
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    amp = graphamp.convert(model, args, kwargs, dtype=torch.bfloat16, mode="budget")
    plan = graphamp.BudgetPlan.of(amp)
    assert plan.steps and plan.error[0] <= plan.budget[0] and plan.error[1] <= plan.budget[1]
    # The recorded error on the held-back batch is the converted module's, measured again here.
    spec = AmpSpec.resolve(model, (args, kwargs), dtype=torch.bfloat16, mode="budget")
    params = checked_params(model, spec)
    held_args, held_kwargs = budget_module.held_back(args, kwargs)
    ref = outputs_and_grads_of(model, model, held_args, held_kwargs, params)
    got = outputs_and_grads_of(amp, model, held_args, held_kwargs, params)
    assert relative_error(got, ref) == pytest.approx(plan.error[1], rel=1e-6)
    # Its parameters are the model's: a step trains the model.
    out = amp(*args, **kwargs)
    out.last_hidden_state.float().mean().backward()
    assert model.embeddings.word_embeddings.weight.grad is not None


def test_compile_times_the_compiled_programs():
    model, x = _model()
    cm = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget", compile=True,
                          config=graphamp.Config(error_budget=0.05))
    plan = graphamp.BudgetPlan.of(cm)
    assert isinstance(cm, graphamp.CompiledAmpModule) and plan.timed == "compiled" and plan.steps
    assert all(s.time_ratio is not None for s in plan.steps if "over the budget" not in s.why)
    with torch.no_grad():
        assert relative_error(([cm(x).float()],), ([model(x)],)) <= 0.05


def test_an_encoder_layers_fused_kernel_is_an_op_type_too(monkeypatch):
    """Under inference=True an eval nn.TransformerEncoderLayer runs eager's fused kernel under
    autocast; the search can raise it, to the fused kernel with autocast off (eager fp32's program)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 8, 32)
    monkeypatch.setattr(budget_module, "time_programs", _timed_as(lambda: True))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, inference=True, mode="budget")
    plan = graphamp.BudgetPlan.of(amp)
    assert plan.raised == ("_transformer_encoder_layer_fwd",), plan.summary()
    with torch.no_grad():
        assert torch.equal(amp(x), model(x))  # eager fp32 runs the same fused kernel


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


def test_a_model_that_writes_its_input_is_measured_from_the_same_values(monkeypatch):
    def time_programs(runs, *, rounds):  # runs each program as timing does, and says each is faster
        for run in runs.values():
            for _ in range(30):
                run()
        return {"before": [1.0] * rounds, "after": [0.5] * rounds}

    monkeypatch.setattr(budget_module, "time_programs", time_programs)
    torch.manual_seed(0)
    model, x = WritesItsInput().eval(), torch.randn(4, 8)
    before = x.clone()
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, mode="budget", config=graphamp.Config(error_budget=1.0))
    plan = graphamp.BudgetPlan.of(amp)
    # Timing wrote the example 2**30 times over; each error is still measured from the example's values.
    assert plan.steps and all(s.kept and s.error < 1.0 for s in plan.steps), plan.steps
    assert torch.equal(x, before)
