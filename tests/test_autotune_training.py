"""mode="autotune" for training: where the conversion keeps gradients, each op is timed forward and
backward (fake timers decide; no test reads the clock)."""

import pytest
import torch
from torch import nn

import graphamp
from graphamp.autotune.measure import MeasurementCache, Trial, measuring

BF16 = torch.bfloat16


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)


class Recorder:
    """Runs each timed call once under a grad-aware check, and says which trials ran a backward."""

    def __init__(self, rule):
        self.rule = rule
        self.trials: list[Trial] = []
        self.backward_ops: list[int] = []

    def __call__(self, fn, trial: Trial) -> float:
        ops = []

        class Count(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func)
                return func(*args, **(kwargs or {}))

        with Count():
            fn()
        self.trials.append(trial)
        # linear's backward computes the input's and the weight's gradient: two more matmuls
        self.backward_ops.append(sum(op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for op in ops))
        return self.rule(trial)


def _convert(model, x, timer, cache, **kw):
    with measuring(timer=timer, cache=cache, check_accuracy=False):
        return graphamp.convert(model, (x,), mode="autotune", **kw)


def test_training_conversions_time_forward_and_backward():
    model, x = _mlp()
    timer = Recorder(lambda t: 1.0 if t.dtype is not torch.float32 else 2.0)
    _convert(model, x, timer, MeasurementCache())
    assert timer.trials and all(t.backward for t in timer.trials)
    assert all(n >= 3 for n in timer.backward_ops)  # forward matmul plus the two of its backward


def test_inference_conversions_time_the_forward_only():
    model, x = _mlp()
    timer = Recorder(lambda t: 1.0 if t.dtype is not torch.float32 else 2.0)
    _convert(model.eval(), x, timer, MeasurementCache(), inference=True)
    assert timer.trials and not any(t.backward for t in timer.trials)
    assert all(n == 1 for n in timer.backward_ops)


def test_forward_and_backward_timings_are_cached_apart_and_decide():
    model, x = _mlp()
    cache = MeasurementCache()
    # fp32 faster forward only, low precision faster forward and backward: training keeps autocast's dtype.
    rule = lambda t: (1.0 if t.dtype is torch.float32 else 2.0) if not t.backward else (3.0 if t.dtype is torch.float32 else 2.0)
    trained = _convert(model, x, Recorder(rule), cache)
    assert not graphamp.AutotunePlan.of(trained).raised
    again = Recorder(rule)
    inferred = _convert(model.eval(), x, again, cache, inference=True)
    assert again.trials  # the training timings do not answer for inference
    assert graphamp.AutotunePlan.of(inferred).raised


def _one_step(mode, timer):
    model, x = _mlp()
    target = torch.randn(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = graphamp.TrainStep(model, nn.functional.mse_loss, opt, dtype=torch.float16, mode=mode)
    with measuring(timer=timer, cache=MeasurementCache()):
        loss = step(x, target=target)
    return step, model, loss


def test_trainstep_autotune_raises_what_fp32_wins_and_trains_in_fp32():
    step, model, loss = _one_step("autotune", lambda fn, trial: 1.0 if trial.dtype is torch.float32 else 2.0)
    assert graphamp.AutotunePlan.of(step.module).raised == ("linear", "linear_1")
    # Everything raised: the step is the fp32 step, bit for bit.
    ref, x = _mlp()
    target = torch.randn(4, 4)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_loss = nn.functional.mse_loss(ref(x), target)
    ref_loss.backward()
    opt.step()
    assert loss.dtype is torch.float32 and torch.equal(loss, ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_trainstep_autotune_keeps_autocast_where_low_wins():
    low_wins = lambda fn, trial: 2.0 if trial.dtype is torch.float32 else 1.0  # noqa: E731
    step, model, loss = _one_step("autotune", low_wins)
    assert graphamp.AutotunePlan.of(step.module).raised == ()
    exact_step, exact_model, exact_loss = _one_step("exact", low_wins)
    assert torch.equal(loss, exact_loss)
    for p, q in zip(model.parameters(), exact_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_trainstep_refuses_an_unknown_mode():
    model, _ = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mode='fast'"):
        graphamp.TrainStep(model, nn.functional.mse_loss, opt, mode="fast")
