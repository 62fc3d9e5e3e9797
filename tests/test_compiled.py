"""``convert(..., compile=True)`` and ``TrainStep(..., compile=True)``: graphamp's graph through inductor.

Not bitwise (inductor fuses and reduces its own way): values are compared against eager autocast
within a tolerance, dtypes and structure exactly. No timing is asserted here (``graphamp bench``).
"""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp.compiled import (
    CompiledAmpModule,
    CompileError,
    CompileFallbackWarning,
    measure_drift,
)
from graphamp.backend.inductor import Inductor
from graphamp.testing import zoo

BF16 = torch.bfloat16
# bf16 keeps 8 significant bits: one rounding is a relative error up to 2^-8; a few layers of
# roundings in another order stay well inside this.
REL = 0.05


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))


def _autocast(model: nn.Module, *args):
    with torch.autocast("cpu", dtype=BF16):
        return model(*args)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.detach(), want.detach()
    return got.dtype == want.dtype and got.shape == want.shape and float((got.float() - want.float()).abs().max()) <= REL * float(want.float().abs().max())


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = _block()
    x = torch.randn(4, 16)
    return model, x, graphamp.convert(model, (x,), dtype=BF16, compile=True)


def test_compiled_module_shares_the_models_parameters_and_names(trained):
    model, _x, cm = trained
    assert isinstance(cm, CompiledAmpModule) and isinstance(cm.amp, graphamp.AmpModule) and cm.runs_compiled
    assert [n for n, _ in cm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(cm.parameters(), model.parameters()))
    assert list(cm.state_dict()) == list(model.state_dict())
    assert "_to_copy" in cm.code and cm.cast_summary()["casts"] == cm.amp.cast_summary()["casts"]


def test_compiled_outputs_and_gradients_near_eager_autocast(trained):
    model, _x, cm = trained
    drift = cm.drift
    assert drift.comparable and drift.dtypes_match
    assert drift.max_rel <= REL and drift.grads_max_rel <= REL and drift.grads_max_abs is not None
    assert "max abs" in drift.line()
    other = torch.randn(7, 16)  # another batch size: dynamo recompiles, no new conversion
    assert _close(cm(other), _autocast(model, other))
    again = measure_drift(cm, model, (other,))
    assert again.comparable and again.max_rel <= REL and again.grads_max_rel <= REL


def test_ambient_autocast_is_switched_off(trained):
    _model, x, cm = trained
    with torch.autocast("cpu", dtype=torch.float16):
        inside = cm(x)
    assert torch.equal(inside, cm(x))


def test_optimizer_on_model_parameters_trains_the_compiled_module():
    torch.manual_seed(1)
    model = _block()
    x, target = torch.randn(4, 16), torch.randn(4, 16)
    cm = graphamp.convert(model, (x,), dtype=BF16, compile=True, self_check="off")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = cm(x).detach()
    loss = nn.functional.mse_loss(cm(x).float(), target)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    after = cm(x).detach()
    assert not torch.equal(before, after)  # the compiled code reads the updated parameters
    assert _close(after, _autocast(model, x).detach())


def test_inference_freezes_and_refresh_recompiles():
    torch.manual_seed(2)
    model = _block().eval()
    x = torch.randn(4, 16)
    cm = graphamp.convert(model, (x,), dtype=BF16, inference=True, compile=True)
    assert cm.extra_repr().startswith("inductor (freezing)")
    y = cm(x)
    assert not y.requires_grad and _close(y, _autocast(model, x))
    assert cm.drift.grads_max_abs is None and cm.drift.max_rel <= REL
    with torch.no_grad():
        model[0].weight.mul_(-1)
        model[3].weight.mul_(2)  # layer_norm's weight, used in fp32
    # What inductor folded (the linear's weight, prepacked where oneDNN runs bf16) is compiled again,
    # at the next call: the compiled code returned the old weights' outputs without a word.
    stale = cm(x)
    assert _close(stale, _autocast(model, x)) and not torch.equal(stale, y)
    cm.refresh()
    assert _close(cm(x), _autocast(model, x))


def test_buffers_the_program_writes_do_not_compile_it_again():
    # Batch norm in training mode updates its running statistics on every call: those are the
    # program's own writes, not weights changed under it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).train()
    x = torch.randn(4, 8)
    cm = graphamp.convert(model, (x,), inference=True, compile=True)
    mean = model[1].running_mean.clone()
    for _ in range(3):
        cm(x)
    assert not torch.equal(model[1].running_mean, mean) and cm.__dict__.get("_compiled_again", 0) == 0
    with torch.no_grad():
        model[0].weight.mul_(2)
    cm(x)
    assert cm.__dict__["_compiled_again"] == 1


def test_dropout_in_training_is_not_compared_by_value():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    cm = graphamp.convert(model, (x,), compile=True)
    assert not cm.drift.comparable and "dropout" in cm.drift.note and "not measured" in cm.drift.line()
    assert cm.drift.dtypes_match  # dtypes and shapes still compared
    model[1].p = 0.0  # dropout(p=0) draws nothing: values compare
    assert measure_drift(graphamp.convert(model, (x,), compile=True), model, (x,)).comparable


class KeywordMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * scale + mask


def test_keyword_inputs_compile_into_one_region():
    # The input check's keyword handling stays traceable: a graph break there split every call into
    # seven compiled regions (measured 2-3% of BERT's compiled inference).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    kwargs = dict(mask=torch.randn(4, 8), scale=torch.randn(4, 8))  # not in sorted order
    counters.clear()
    cm = graphamp.convert(KeywordMasked(), (torch.randn(4, 8),), kwargs, dtype=torch.bfloat16, inference=True, compile=True)
    cm(torch.randn(4, 8), **kwargs)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compile_failure_raises_a_typed_error(monkeypatch):
    def broken(self, gm, example_inputs):
        raise RuntimeError("inductor says no")

    monkeypatch.setattr(Inductor, "__call__", broken)
    with pytest.raises(CompileError, match="compile=False") as info:
        graphamp.convert(_block(), (torch.randn(2, 16),), compile=True, self_check="off")
    assert isinstance(info.value, graphamp.GraphampError) and info.value.__cause__ is not None


def test_a_later_compile_failure_falls_back_with_a_warning(monkeypatch):
    model, x = _block(), torch.randn(4, 16)
    cm = graphamp.convert(model, (x,), compile=True, self_check="off")

    def broken(self, gm, example_inputs):
        raise RuntimeError("inductor says no")

    monkeypatch.setattr(Inductor, "__call__", broken)
    other = torch.randn(9, 16)  # a new size: dynamo compiles again, and fails
    with pytest.warns(CompileFallbackWarning, match="uncompiled"):
        y = cm(other)
    assert torch.equal(y, cm.amp(other))  # the uncompiled module: exact
    assert torch.equal(y, _autocast(model, other))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; these shapes now run uncompiled without a retrace
        assert torch.equal(cm(other), y)
    monkeypatch.undo()
    assert _close(cm(x), _autocast(model, x))  # the example's shapes stay compiled


def test_compile_argument_is_checked():
    with pytest.raises(TypeError, match="compile must be True or False"):
        graphamp.convert(_block(), (torch.randn(2, 16),), compile="yes")
    with pytest.raises(TypeError, match="compile must be True or False"):
        model = _block()
        graphamp.TrainStep(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=1), compile=1)


def test_pickle_drops_the_compiled_code_and_compiles_again(trained):
    model, x, cm = trained
    buf = io.BytesIO()
    torch.save(cm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, CompiledAmpModule) and loaded.__dict__["_compiled"] is None
    assert _close(loaded(x), _autocast(model, x))


def _train(compile: bool, dtype: torch.dtype, fused: bool = False, steps: int = 3):
    torch.manual_seed(3)
    model = _block()
    # SGD's update is proportional to the gradient, so parameters stay comparable within rounding
    # (Adam's normalised step turns a rounding difference of a near-zero gradient into up to lr).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = graphamp.TrainStep(model, lambda out, t: nn.functional.mse_loss(out.float(), t), opt, dtype=dtype, compile=compile)
    gen = torch.Generator().manual_seed(0)
    losses = [step(torch.randn(8, 16, generator=gen), target=torch.randn(8, 16, generator=gen)) for _ in range(steps)]
    return model, step, torch.stack(losses)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_trainstep_compiled_follows_the_eager_loop(dtype):
    model, step, losses = _train(True, dtype)
    ref_model, _, ref_losses = _train(False, dtype)
    assert isinstance(step._compiled, CompiledAmpModule) and step._compiled_step.enabled
    assert step.steps == 3 and (step.scaler is not None) == (dtype == torch.float16)
    assert torch.allclose(losses, ref_losses, rtol=REL, atol=1e-3)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, rtol=REL, atol=5e-3)
    assert "step" not in step.optimizer.__dict__  # the compiled step is bound only while stepping


def test_trainstep_compiled_keeps_a_fused_optimizers_own_step():
    _, step, losses = _train(True, torch.bfloat16, fused=True, steps=1)
    assert not step._compiled_step.enabled and torch.isfinite(losses).all()


def test_a_transformers_model_compiles_for_inference():
    pytest.importorskip("transformers")
    case = zoo.bert(layers=1, hidden=32, heads=2)
    model = case.model.eval()
    args, kwargs = case.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        cm = graphamp.convert(model, args, kwargs, inference=True, compile=True)
    got = cm(*args, **kwargs)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        want = model(*args, **kwargs)
    assert type(got) is type(want)
    assert _close(got.last_hidden_state, want.last_hidden_state)
    assert cm.drift.comparable and cm.drift.max_rel <= REL
    twin = copy.deepcopy(cm)
    assert isinstance(twin, CompiledAmpModule) and twin.amp is not cm.amp and twin.drift == cm.drift


def test_a_compiled_program_with_other_dtypes_is_never_returned():
    # An eval nn.TransformerEncoderLayer under inference=True runs eager's fused kernel under autocast
    # (graphamp.runtime.autocast_op); torch.compile has lost that autocast state (outputs in fp32).
    # Whatever torch does, the module's outputs have eager autocast's dtypes, and where it falls back
    # it says so and is exact.
    case = zoo.transformer_encoder(d_model=32, layers=1, heads=4)
    model = case.model.eval()
    args, kwargs = case.inputs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = graphamp.convert(model, args, kwargs, inference=True, compile=True)
    fell_back = any(issubclass(w.category, CompileFallbackWarning) for w in caught)
    got = cm(*args, **kwargs)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        want = model(*args, **kwargs)
    assert got.dtype == want.dtype and fell_back == (not cm.drift.dtypes_match) == (not cm.runs_compiled)
    if fell_back:
        assert torch.equal(got, want)


def test_autotune_raised_outputs_are_compiled_not_refused(monkeypatch):
    # mode="autotune" that raises the last linear returns fp32 where eager autocast returns bf16: the
    # converted program's dtypes, not inductor running another program, so it runs compiled and the
    # drift says why its dtypes differ from eager autocast's. The compiled choice is timed with fake
    # times too (the plan's program fastest): on a CPU that emulates bf16 real times may keep
    # autocast's dtypes, whose outputs are bf16.
    from graphamp.autotune import compiled as autotune_compiled
    from graphamp.autotune.measure import MeasurementCache, measuring

    model = _block().eval()
    x = torch.randn(4, 16)
    fp32_faster = lambda fn, trial: 2.0 if trial.dtype is BF16 else 1.0  # noqa: E731
    plan_fastest = lambda runs, **kw: {name: [1.0] if name == "plan" else [2.0] for name in runs}  # noqa: E731
    monkeypatch.setattr(autotune_compiled, "time_programs", plan_fastest)
    with measuring(timer=fp32_faster, cache=MeasurementCache(), check_accuracy=False), warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        cm = graphamp.convert(model, (x,), mode="autotune", inference=True, compile=True)
        uncompiled = graphamp.convert(model, (x,), mode="autotune", inference=True)
    assert cm.runs_compiled and not cm.drift.dtypes_match and "autotune" in cm.drift.line()
    with torch.no_grad():
        got, want = cm(x), uncompiled(x)
    assert got.dtype == want.dtype == torch.float32 and _close(got, want)


class BatchNotOne(nn.Module):
    """Branches on ``batch != 1``: batch 1 is another shape class, which the converted module converts for."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if x.shape[0] != 1:
            return h.softmax(-1) * 2
        return h


def test_another_shape_class_runs_uncompiled_and_exact():
    model = BatchNotOne()
    cm = graphamp.convert(model, (torch.randn(3, 4),), compile=True)
    one = torch.randn(1, 4)
    with pytest.warns(CompileFallbackWarning):
        y = cm(one)
    assert torch.equal(y, _autocast(model, one))
    five = torch.randn(5, 4)
    assert cm.runs_compiled and _close(cm(five), _autocast(model, five))  # the example's class: compiled


def test_a_size_condition_compiles_into_one_region_and_batch_one_still_falls_back():
    # The guard's size condition (batch != 1) was made by eval inside an lru_cache, which dynamo
    # cannot trace: every call of the compiled module ran the check eagerly at a graph break
    # (transformers' masking_utils gives every decoder this condition: GPT-2 ran 5 regions per call).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = BatchNotOne()
    cm = graphamp.convert(model, (torch.randn(3, 4),), compile=True, inference=True)
    assert cm.amp._graphamp_guard.conditions
    counters.clear()
    five = torch.randn(5, 4)
    assert _close(cm(five), _autocast(model, five))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    one = torch.randn(1, 4)
    with pytest.warns(CompileFallbackWarning):
        assert torch.equal(cm(one), _autocast(model, one))


def test_a_saved_guard_makes_its_condition_functions_again(tmp_path):
    # The guard keeps each condition as a function made by eval, which does not pickle: it is left
    # out of the saved state and made again on load (and on deepcopy).
    model = BatchNotOne()
    amp = graphamp.convert(model, (torch.randn(3, 4),))
    torch.save(amp, tmp_path / "amp.pt")
    for loaded in (torch.load(tmp_path / "amp.pt", weights_only=False), copy.deepcopy(amp)):
        assert loaded._graphamp_guard.conditions and all(loaded._graphamp_guard.__dict__["_condition_fns"])
        for batch in (1, 3):
            x = torch.randn(batch, 4)
            assert torch.equal(loaded(x), _autocast(model, x))


def test_the_weight_cache_stays_out_of_the_compiled_graph():
    # Without inference=True and called under no_grad, the converted code reads its weights through
    # the weight cache, whose version and pointer checks dynamo cannot trace (BERT: 33 graphs and
    # the recompile limit). Traced, the cache is a plain cast.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _block()
    x = torch.randn(4, 16)
    cm = graphamp.convert(model.eval(), (x,), compile=True)
    counters.clear()
    with torch.no_grad():
        for _ in range(3):
            y = cm(x)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 1
    assert _close(y, _autocast(model, x))


def test_verify_reports_the_compiled_drift_apart_from_ok():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
    x = torch.randn(4, 16)
    report = graphamp.verify(model, (x,), compile=True)
    assert report.ok and report.compiled_drift is not None  # ok is the exact conversion's
    assert "compiled (convert(..., compile=True), inductor, not bitwise)" in str(report)
    assert graphamp.verify(model, (x,)).compiled_drift is None


def test_gradient_drift_is_relative_to_the_largest_gradient():
    from graphamp.compiled import _tree_errors

    ref = [torch.tensor([1e-5, -1e-5]), torch.tensor([2.0, -4.0])]  # a bias before batch norm: noise around 0
    got = [torch.tensor([2e-4, 0.0]), torch.tensor([2.0, -4.004])]
    per_tensor = _tree_errors(got, ref)
    one_scale = _tree_errors(got, ref, one_scale=True)
    assert per_tensor[1] == pytest.approx(19.0) and one_scale[1] == pytest.approx(0.004 / 4.0, rel=1e-3)
    assert per_tensor[0] == one_scale[0] == pytest.approx(0.004, rel=1e-3)


def test_a_backward_inductor_cannot_compile_falls_back_in_the_forward(monkeypatch):
    # AOTAutograd compiles the backward with the forward, so the failure meets the module's fallback
    # instead of raising from backward() in the user's loop.
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx

    def compile_fx(gm, example_inputs, inner_compile=compile_fx_module.compile_fx_inner, **kw):
        def failing(g, inputs, **k):
            if k.get("is_backward"):
                raise RuntimeError("simulated: inductor cannot compile this backward")
            return inner_compile(g, inputs, **k)

        return real(gm, example_inputs, inner_compile=failing, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", compile_fx)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    cm = CompiledAmpModule(amp, freezing=False)
    # Compiled code cached by an earlier test would skip the compile this test makes fail.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        with pytest.warns(graphamp.CompileFallbackWarning, match="simulated: inductor cannot compile this backward"):
            y = cm(x)
    y.float().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    amp(x).float().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))  # the uncompiled, exact graph ran


def test_inductor_options_are_kept_by_copies_and_pickles():
    torch.manual_seed(0)
    model, x = _block(), torch.randn(2, 16)
    cm = CompiledAmpModule(graphamp.convert(model, (x,)), options={"cpp_wrapper": True})
    buf = io.BytesIO()
    torch.save(cm, buf)
    buf.seek(0)
    for other in (copy.deepcopy(cm), torch.load(buf, weights_only=False)):
        assert other.__dict__["_options"] == {"cpp_wrapper": True} and "cpp_wrapper=True" in repr(other)


@pytest.mark.parametrize("inference", [False, True])
def test_a_parameter_replaced_on_the_model_is_refused_as_uncompiled(inference):
    # The uncompiled module raises ModelChangedError; the compiled one computed on with the old
    # parameter (max difference 2.3 from eager autocast with the new one), without a word.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    model.eval() if inference else model.train()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphamp.convert(model, (x,), inference=inference, compile=True)
    cm(x)
    model[0].weight = nn.Parameter(torch.randn(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "compiling failed; it ran uncompiled (exact, slower)"
        with pytest.raises(graphamp.ModelChangedError, match="0.weight"):
            cm(x)


def test_the_compiled_program_is_the_flat_graph_over_the_modules_own_state():
    # Dynamo traces the graph alone (the module's forward, with its structure checks and pytree
    # flattening, runs in Python), reading the converted module's own parameters.
    from graphamp.compiled import flat_program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,))
    program = flat_program(amp)
    assert program.get_parameter("0.weight") is model[0].weight and program._modules is amp._modules
    assert "tree_flatten_spec" not in program.code and "tree_flatten_spec" in amp.code
    with torch.no_grad():
        assert torch.equal(program(x)[0], amp(x))
    cm = graphamp.CompiledAmpModule(amp)
    with pytest.raises(graphamp.InputStructureError):
        cm(x, x)


def test_the_flat_program_and_a_copy_are_made_without_a_warning():
    # Deep-copying the graph's pytree specs warned (FutureWarning: isinstance(treespec, LeafSpec)) on
    # every convert(compile=True), from copyreg, naming no graphamp line.
    from graphamp.compiled import flat_program

    class Pairs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=None):
            return {"y": self.lin(x) * (1.0 if scale is None else scale), "x": x}

    x = torch.randn(2, 8)
    amp = graphamp.convert(Pairs().eval(), (x,), {"scale": torch.tensor(2.0)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = flat_program(amp)
        twin = copy.deepcopy(amp)  # a user's copy of the module, too
    assert twin._in_spec == amp._in_spec and twin.lin.weight is not amp.lin.weight
    with torch.no_grad():
        assert torch.equal(program(x, torch.tensor(2.0))[0], amp(x, scale=torch.tensor(2.0))["y"])
