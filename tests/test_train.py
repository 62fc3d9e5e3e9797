"""graphamp.TrainStep against PyTorch's canonical eager AMP loop, bit for bit."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import graphamp
from graphamp.testing import zoo
from conftest import build_case

STEPS = 30


def logits_cross_entropy(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, target)


@dataclass
class Task:
    model: nn.Module
    loss_fn: Any
    batches: list[tuple[tuple, dict, Any]]


def make_task(name: str, steps: int = STEPS, seed: int = 0) -> Task:
    """A zoo model in train mode with ``steps`` distinct batches and targets."""
    if name == "bert":
        pytest.importorskip("transformers")
        case = zoo.bert(classify=True)
    else:
        case = build_case(name)
    if name == "checkerboard":
        case.batch, case.seq = 4, 8
    model = case.model.train()
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        args, kwargs = case.inputs
        args = tuple(a + 0.1 * torch.randn(a.shape, generator=g) for a in args)
        if "input_ids" in kwargs:
            kwargs = {**kwargs, "input_ids": torch.randint(0, 1000, kwargs["input_ids"].shape, generator=g)}
        if name == "bert":
            target = torch.randint(0, 3, (case.batch,), generator=g)
        else:
            with torch.no_grad():
                shape = model(*args, **kwargs).shape
            target = torch.randn(shape, generator=g)
        batches.append((args, kwargs, target))
    loss_fn = logits_cross_entropy if name == "bert" else F.mse_loss
    return Task(model, loss_fn, batches)


def with_inf_targets(task: Task, at: tuple[int, ...]) -> Task:
    """The same task with an inf in the target at the given steps: inf loss, inf/nan gradients."""
    batches = []
    for i, (args, kwargs, target) in enumerate(task.batches):
        if i in at:
            target = target.clone()
            target.view(-1)[0] = float("inf")
        batches.append((args, kwargs, target))
    return Task(task.model, task.loss_fn, batches)


@dataclass
class Run:
    losses: list[torch.Tensor]
    scales: list[float]


def canonical_loop(
    model: nn.Module,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    batches: list,
    *,
    dtype: torch.dtype,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    accumulate: int = 1,
) -> Run:
    """PyTorch's AMP recipe (docs: "Automatic Mixed Precision examples"), with its accumulation loop."""
    losses, scales = [], []
    for i, (args, kwargs, target) in enumerate(batches):
        if i % accumulate == 0:
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            output = model(*args, **kwargs)
            loss = loss_fn(output, target)
            to_backward = loss / accumulate if accumulate > 1 else loss
        (scaler.scale(to_backward) if scaler is not None else to_backward).backward()
        losses.append(loss.detach())
        if (i + 1) % accumulate == 0:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                optimizer.step()
    return Run(losses, scales)


def run_step(step: graphamp.TrainStep, batches: list) -> tuple[Run, list[bool]]:
    losses, scales, skipped = [], [], []
    for args, kwargs, target in batches:
        losses.append(step(*args, target=target, **kwargs))
        if step.stepped:
            skipped.append(step.last_step_skipped)
            if step.scaler is not None:
                scales.append(step.scaler.get_scale())
    return Run(losses, scales), skipped


def assert_same_state(got: nn.Module, want: nn.Module, got_opt: torch.optim.Optimizer, want_opt: torch.optim.Optimizer) -> None:
    """Parameters, buffers (batch-norm statistics) and optimizer state are torch.equal."""
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert got_sd.keys() == want_sd.keys()
    for name in want_sd:
        assert torch.equal(got_sd[name], want_sd[name]), f"{name}: max |diff| {(got_sd[name].double() - want_sd[name].double()).abs().max()}"
    got_state, want_state = got_opt.state_dict()["state"], want_opt.state_dict()["state"]
    assert got_state.keys() == want_state.keys()
    for index in want_state:
        assert got_state[index].keys() == want_state[index].keys()
        for key, value in want_state[index].items():
            assert torch.equal(got_state[index][key], value), f"optimizer state {index}.{key}"


def assert_same_losses(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"step {i}: loss {a.item()} != eager {b.item()}"


def twins(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Two deep copies with identical init: one for eager, one for TrainStep."""
    return copy.deepcopy(model), copy.deepcopy(model)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bert", "checkerboard", "transformer_encoder"])
def test_matches_canonical_loop(name, dtype):
    dtype = DTYPES[dtype]
    task = make_task(name)
    eager, ours = twins(task.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    eager_scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    want = canonical_loop(eager, task.loss_fn, eager_opt, task.batches, dtype=dtype, scaler=eager_scaler, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=dtype, scaler=scaler, max_grad_norm=1.0)
    got, skipped = run_step(step, task.batches)
    assert_same_losses(got.losses, want.losses)
    assert got.scales == want.scales
    assert_same_state(ours, eager, our_opt, eager_opt)
    assert step.calls == step.steps == STEPS and len(skipped) == STEPS
    # The run trained: a test of an untouched model would pass trivially.
    assert not torch.equal(next(iter(ours.parameters())), next(iter(task.model.parameters())))


def test_auto_scaler_is_gradscaler_for_fp16_and_none_for_bf16():
    task = make_task("transformer_encoder", steps=0)
    fp16 = graphamp.TrainStep(task.model, task.loss_fn, adamw(task.model), dtype=torch.float16)
    bf16 = graphamp.TrainStep(task.model, task.loss_fn, adamw(task.model), dtype=torch.bfloat16)
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler._device == "cpu"
    assert bf16.scaler is None


@pytest.mark.parametrize("scaler", ["auto", "graph"])
def test_injected_overflow_skips_the_same_steps(scaler):
    task = with_inf_targets(make_task("transformer_encoder", steps=12), at=(3, 8))
    eager, ours = twins(task.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    want = canonical_loop(eager, task.loss_fn, eager_opt, task.batches, dtype=torch.float16,
                          scaler=torch.amp.GradScaler("cpu"), max_grad_norm=1.0)
    step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=torch.float16, scaler=scaler, max_grad_norm=1.0)
    got, skipped = run_step(step, task.batches)
    assert [i for i, s in enumerate(skipped) if s] == [3, 8]
    assert want.scales[2:4] == [65536.0, 32768.0] and want.scales[7:9] == [32768.0, 16384.0]
    assert got.scales == want.scales
    assert torch.isinf(got.losses[3]) and torch.isinf(got.losses[8])
    assert_same_losses(got.losses, want.losses)
    assert_same_state(ours, eager, our_opt, eager_opt)


@pytest.mark.parametrize("scaler", ["own", "graph"])
@pytest.mark.parametrize("optimizer", [adamw, sgd], ids=["adamw", "sgd"])
def test_gradient_overflow_and_graph_scaler_match_gradscaler(scaler, optimizer):
    # A huge initial scale overflows the fp16 gradients (the loss stays finite) for the first
    # steps, which GradScaler skips while halving the scale; the injected infs come later, once
    # graph mode selects with tensor ops instead of syncing.
    task = with_inf_targets(make_task("transformer_encoder", steps=18), at=(15, 16))
    eager, ours = twins(task.model)
    eager_opt, our_opt = optimizer(eager), optimizer(ours)
    init = 2.0 ** 30
    want = canonical_loop(eager, task.loss_fn, eager_opt, task.batches, dtype=torch.float16,
                          scaler=torch.amp.GradScaler("cpu", init_scale=init, growth_interval=4), max_grad_norm=1.0)
    if scaler == "own":
        step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=torch.float16, max_grad_norm=1.0,
                                  scaler=torch.amp.GradScaler("cpu", init_scale=init, growth_interval=4))
    else:
        step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=torch.float16, max_grad_norm=1.0, scaler="graph")
        step.scaler.load_state_dict({**step.scaler.state_dict(), "scale": init, "growth_interval": 4})
    got, skipped = run_step(step, task.batches)
    assert skipped[:3] == [True] * 3, "the huge scale should overflow the first steps"
    assert torch.isfinite(torch.stack(got.losses[:3])).all()
    assert skipped[15] and skipped[16]
    assert got.scales == want.scales
    assert_same_losses(got.losses, want.losses)
    assert_same_state(ours, eager, our_opt, eager_opt)


class CountSyncs(TorchDispatchMode):
    """Counts host reads of tensor values (``.item()``, ``bool(t)``): each is a device sync on GPUs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scaler, syncs", [("graph", 0), ("auto", 1)])
def test_graph_scaler_takes_no_host_sync(scaler, syncs):
    # SGD and clip_grad_norm_ read no values on the host, so the count is the scaler's alone.
    task = with_inf_targets(make_task("transformer_encoder", steps=6), at=(4,))
    step = graphamp.TrainStep(task.model, task.loss_fn, sgd(task.model), dtype=torch.float16, scaler=scaler, max_grad_norm=1.0)
    counts = []
    for args, kwargs, target in task.batches:
        with CountSyncs() as counter:
            step(*args, target=target, **kwargs)
        counts.append(counter.count)
    # The first step syncs in both modes: until the optimizer has state, graph mode takes
    # GradScaler's path, so that a skipped first step leaves no state behind.
    assert counts[0] >= 1
    assert counts[1:] == [syncs] * 5
    assert step.last_step_skipped is False
    assert [step.scaler.get_scale()] == [32768.0]


def test_graph_scaler_matches_on_a_skipped_first_step():
    # The first step overflows: graph mode must leave the optimizer state empty, as GradScaler does.
    task = with_inf_targets(make_task("transformer_encoder", steps=4), at=(0,))
    eager, ours = twins(task.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    canonical_loop(eager, task.loss_fn, eager_opt, task.batches[:1], dtype=torch.float16,
                   scaler=torch.amp.GradScaler("cpu"), max_grad_norm=None)
    step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=torch.float16, scaler="graph")
    run_step(step, task.batches[:1])
    assert step.last_step_skipped and not our_opt.state
    assert_same_state(ours, eager, our_opt, eager_opt)


@pytest.mark.parametrize("scaler", ["auto", "graph"])
def test_accumulation_matches_the_canonical_accumulation_loop(scaler):
    task = with_inf_targets(make_task("checkerboard", steps=12), at=(7,))
    eager, ours = twins(task.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    want = canonical_loop(eager, task.loss_fn, eager_opt, task.batches, dtype=torch.float16,
                          scaler=torch.amp.GradScaler("cpu"), max_grad_norm=1.0, accumulate=3)
    step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=torch.float16, scaler=scaler,
                              max_grad_norm=1.0, accumulate=3)
    stepped = []
    losses = []
    skipped = []
    for args, kwargs, target in task.batches:
        losses.append(step(*args, target=target, **kwargs))
        stepped.append(step.stepped)
        if step.stepped:
            skipped.append(step.last_step_skipped)
    assert stepped == [False, False, True] * 4
    assert skipped == [False, False, True, False]  # the inf at call 7 spoils the third window
    assert (step.calls, step.steps) == (12, 4)
    assert_same_losses(losses, want.losses)  # returned undivided, as loss_fn computed it
    assert_same_state(ours, eager, our_opt, eager_opt)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_accumulation_casts_each_weight_once_per_window_and_stays_bitwise(dtype, monkeypatch):
    # BERT's weights are cast once per accumulation window (runtime.grad_casts_kept), where eager
    # recasts them every micro-batch: same values, and gradients through the cast's own backward.
    # Every weight of this small BERT is kept (by default only large ones are: keeping costs more).
    monkeypatch.setattr(graphamp.runtime, "KEEP_CAST_MIN_NUMEL", 0)
    task = make_task("bert", steps=4)
    eager, ours = twins(task.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    want = canonical_loop(eager, task.loss_fn, eager_opt, task.batches, dtype=dtype, scaler=scaler, max_grad_norm=1.0, accumulate=2)
    step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=dtype, max_grad_norm=1.0, accumulate=2)
    losses, kept = [], []
    for i, (args, kwargs, target) in enumerate(task.batches):
        if i == 2:  # a weight changed inside a window (its version moves): cast again, as eager would
            with torch.no_grad():
                ours.classifier.weight.mul_(1.0)
                eager.classifier.weight.mul_(1.0)
        losses.append(step(*args, target=target, **kwargs))
        kept.append(len(step._window_casts))
    linears = sum(isinstance(m, nn.Linear) for m in ours.modules())
    assert kept[0] >= linears and kept == [kept[0], 0, kept[0], 0], kept  # kept within a window, dropped at its step
    assert_same_losses(losses, want.losses)
    assert_same_state(ours, eager, our_opt, eager_opt)


@pytest.mark.parametrize("min_numel", [0, 1 << 30], ids=["kept", "too-small-to-keep"])
def test_accumulation_reuses_the_kept_cast_within_a_window(min_numel, monkeypatch):
    monkeypatch.setattr(graphamp.runtime, "KEEP_CAST_MIN_NUMEL", min_numel)
    task = make_task("bert", steps=4)
    step = graphamp.TrainStep(task.model, task.loss_fn, adamw(task.model), dtype=torch.bfloat16, accumulate=2)
    weight = task.model.classifier.weight
    casts = []

    class CountWeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == weight.data_ptr():
                casts.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    for args, kwargs, target in task.batches[:2]:  # the first window converts and self-checks
        step(*args, target=target, **kwargs)
    with CountWeightCasts():
        for args, kwargs, target in task.batches[2:]:
            step(*args, target=target, **kwargs)
    assert step.steps == 2
    expected = 1 if min_numel == 0 else 2  # a weight below the threshold is cast per micro-batch, as eager does
    assert len(casts) == expected, f"the classifier weight was cast {len(casts)} times in one window of 2 micro-batches"


@pytest.mark.parametrize("scaler", ["own", "graph"])
def test_resume_from_state_dict_continues_the_same_trajectory(scaler, tmp_path):
    task = with_inf_targets(make_task("checkerboard", steps=16), at=(5, 11))
    start = copy.deepcopy(task.model)

    def new_step(model: nn.Module) -> graphamp.TrainStep:
        own = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
        step = graphamp.TrainStep(model, task.loss_fn, adamw(model), dtype=torch.float16,
                                  scaler=own if scaler == "own" else "graph", max_grad_norm=1.0)
        if scaler == "graph":
            step.scaler.load_state_dict(own.state_dict())
        return step

    # One uninterrupted run, checkpointed (to disk) after 10 of its 16 steps ...
    straight_model = copy.deepcopy(start)
    straight = new_step(straight_model)
    want_a, _ = run_step(straight, task.batches[:10])
    assert straight.scaler._growth_tracker.item() > 0, "checkpoint where the growth tracker matters"
    torch.save({"model": straight_model.state_dict(), "optimizer": straight.optimizer.state_dict(),
                "step": straight.state_dict()}, tmp_path / "ckpt.pt")
    want_b, _ = run_step(straight, task.batches[10:])
    # ... and a run resumed from the checkpoint with fresh objects, as in a new process.
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed_model = copy.deepcopy(start)
    resumed_model.load_state_dict(ckpt["model"])
    resumed = new_step(resumed_model)
    resumed.optimizer.load_state_dict(ckpt["optimizer"])
    resumed.load_state_dict(ckpt["step"])
    assert (resumed.calls, resumed.steps) == (10, 10)
    got_b, _ = run_step(resumed, task.batches[10:])

    assert_same_losses(got_b.losses, want_b.losses)
    assert got_b.scales == want_b.scales
    scales = want_a.scales + want_b.scales
    moves = {(b > a) - (b < a) for a, b in zip(scales, scales[1:])}
    assert moves >= {1, -1}, "the scale should both grow and back off during the run"
    assert_same_state(resumed_model, straight_model, resumed.optimizer, straight.optimizer)
    assert resumed.state_dict() == straight.state_dict()


class RecordAutocast(TorchFunctionMode):
    """Records whether CPU autocast is on at every torch call made through Python."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.states.append(torch.is_autocast_enabled("cpu"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ambient", [False, True], ids=["plain", "inside-user-autocast"])
def test_step_runs_without_runtime_autocast(ambient):
    task = make_task("transformer_encoder", steps=2)
    step = graphamp.TrainStep(task.model, task.loss_fn, adamw(task.model), dtype=torch.float16)
    in_backward: list[bool] = []
    for p in task.model.parameters():
        p.register_hook(lambda g: in_backward.append(torch.is_autocast_enabled("cpu")) or g)
    args, kwargs, target = task.batches[0]
    step(*args, target=target, **kwargs)  # converts; the recorded call below runs the graph
    args, kwargs, target = task.batches[1]
    with RecordAutocast() as record, torch.autocast("cpu", dtype=torch.bfloat16, enabled=ambient):
        step(*args, target=target, **kwargs)
    assert len(record.states) > 50 and not any(record.states)
    assert in_backward and not any(in_backward)
    code = step.module.code
    assert "autocast" not in code and "_to_copy" in code and "mse_loss" in code
    # The recorder sees eager autocast where it is on, so the check above can fail.
    with RecordAutocast() as control, torch.autocast("cpu", dtype=torch.float16):
        task.loss_fn(task.model(*args, **kwargs), target)
    assert any(control.states)


def test_loss_is_detached_and_unscaled():
    task = make_task("transformer_encoder", steps=1)
    eager, ours = twins(task.model)
    args, kwargs, target = task.batches[0]
    with torch.autocast("cpu", dtype=torch.float16):
        want = task.loss_fn(eager(*args, **kwargs), target)
    step = graphamp.TrainStep(ours, task.loss_fn, adamw(ours), dtype=torch.float16)
    loss = step(*args, target=target, **kwargs)
    assert not loss.requires_grad and loss.grad_fn is None
    assert torch.equal(loss, want.detach())  # not multiplied by the scale


# Bad arguments: typed errors that name the problem and the way out.

def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"model": lambda x: x}, TypeError, ["nn.Module"]),
        ({"loss_fn": 3}, TypeError, ["loss_fn", "callable"]),
        ({"optimizer": "adam"}, TypeError, ["torch.optim.Optimizer"]),
        ({"scaler": "dynamic"}, ValueError, ["'dynamic'", "'auto'", "'graph'"]),
        ({"scaler": 2.0 ** 16}, TypeError, ["GradScaler"]),
        ({"max_grad_norm": 0.0}, ValueError, ["max_grad_norm", "None"]),
        ({"max_grad_norm": "1"}, TypeError, ["max_grad_norm"]),
        ({"accumulate": 0}, ValueError, ["accumulate"]),
        ({"accumulate": 2.0}, TypeError, ["accumulate"]),
        ({"dtype": torch.float32}, ValueError, ["torch.float32"]),
        ({"config": {"softmax.int": "fp32"}}, TypeError, ["graphamp.Config"]),
    ],
    ids=["model", "loss", "optimizer", "scaler-str", "scaler-type", "norm-zero", "norm-str", "accumulate-zero",
         "accumulate-float", "dtype", "config"],
)
def test_bad_arguments_name_the_problem(change, error, words):
    model, opt = _tiny()
    kwargs = {"model": model, "loss_fn": F.mse_loss, "optimizer": opt, **change}
    with pytest.raises(error) as info:
        graphamp.TrainStep(kwargs.pop("model"), kwargs.pop("loss_fn"), kwargs.pop("optimizer"), **kwargs)
    for word in words:
        assert word in str(info.value)


def test_optimizer_over_a_copy_of_the_model_is_refused():
    model, _ = _tiny()
    other = copy.deepcopy(model)
    with pytest.raises(ValueError, match="none of the model's parameters"):
        graphamp.TrainStep(model, F.mse_loss, torch.optim.SGD(other.parameters(), lr=0.1))


def test_converted_model_is_refused():
    model, opt = _tiny()
    amp = graphamp.convert(model, (torch.randn(3, 4),))
    with pytest.raises(ValueError, match="original model"):
        graphamp.TrainStep(amp, F.mse_loss, opt)


def test_scaler_for_another_device_is_refused():
    model, opt = _tiny()
    with pytest.raises(ValueError, match=r"GradScaler\('cuda'\)"):
        graphamp.TrainStep(model, F.mse_loss, opt, dtype=torch.float16, device_type="cuda",
                           scaler=torch.amp.GradScaler("cpu"))


def test_gradscaler_with_bf16_warns_and_still_matches_eager():
    task = make_task("transformer_encoder", steps=3)
    eager, ours = twins(task.model)
    eager_opt, our_opt = adamw(eager), adamw(ours)
    want = canonical_loop(eager, task.loss_fn, eager_opt, task.batches, dtype=torch.bfloat16,
                          scaler=torch.amp.GradScaler("cpu"), max_grad_norm=None)
    with pytest.warns(UserWarning, match="pointless"):
        step = graphamp.TrainStep(ours, task.loss_fn, our_opt, dtype=torch.bfloat16, scaler=torch.amp.GradScaler("cpu"))
    got, _ = run_step(step, task.batches)
    assert_same_losses(got.losses, want.losses)
    assert_same_state(ours, eager, our_opt, eager_opt)


def test_disabled_scaler_means_no_scaling():
    model, opt = _tiny()
    step = graphamp.TrainStep(model, F.mse_loss, opt, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert step.scaler is None
    step(torch.randn(3, 4), target=torch.randn(3, 2))
    assert step.last_step_skipped is False


def test_non_scalar_loss_is_a_type_error():
    model, opt = _tiny()
    step = graphamp.TrainStep(model, lambda out, t: (out - t) ** 2, opt)
    with pytest.raises(TypeError, match="scalar"):
        step(torch.randn(3, 4), target=torch.randn(3, 2))


def test_switching_mode_after_conversion_is_refused():
    model, opt = _tiny()
    step = graphamp.TrainStep(model, F.mse_loss, opt)
    step(torch.randn(3, 4), target=torch.randn(3, 2))
    model.eval()
    with pytest.raises(RuntimeError, match="model.train()"):
        step(torch.randn(3, 4), target=torch.randn(3, 2))
    model.train()
    step(torch.randn(3, 4), target=torch.randn(3, 2))
    assert step.steps == 2


def test_state_dict_errors_and_mid_window_warning():
    model, opt = _tiny()
    step = graphamp.TrainStep(model, F.mse_loss, opt, dtype=torch.float16, accumulate=2)
    step(torch.randn(3, 4), target=torch.randn(3, 2))
    with pytest.warns(UserWarning, match="accumulation window"):
        state = step.state_dict()
    with pytest.raises(ValueError, match="expected keys"):
        step.load_state_dict({"calls": 1})
    bf16 = graphamp.TrainStep(model, F.mse_loss, opt, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scaler"):
        bf16.load_state_dict(state)


def test_inputs_must_keep_the_first_calls_structure():
    # The graph fixed the keyword names and the non-tensor values; an extra keyword would
    # otherwise be dropped silently.
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, bias=None, scale=1.0):
            y = self.lin(x) * scale
            return y if bias is None else y + bias

    model = Biased()
    step = graphamp.TrainStep(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    step(torch.randn(3, 4), target=torch.randn(3, 2), scale=2.0)
    step(torch.randn(5, 4), target=torch.randn(5, 2), scale=2.0)  # other sizes are fine
    for call in [
        lambda: step(torch.randn(3, 4), target=torch.randn(3, 2), scale=2.0, bias=torch.randn(2)),
        lambda: step(torch.randn(3, 4), target=torch.randn(3, 2), scale=3.0),
        lambda: step(torch.randn(3, 4), scale=2.0),
    ]:
        with pytest.raises(graphamp.InputMismatchError, match="build a new TrainStep"):
            call()
    assert step.calls == 2
