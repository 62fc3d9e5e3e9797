"""TorchScript models: convert, verify and TrainStep accept a torch.jit.ScriptModule.

The acceptance model is the AMP tutorial's checkerboard ``Net`` written as a ScriptModule with a
``script_method`` forward; ``torch.jit.script(module)`` is the other style.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from test_train import assert_same_losses, assert_same_state, canonical_loop, run_step


def _net_class() -> type:
    # A new class each time: TorchScript keeps one optimizing executor per class method, and a
    # class already run (and optimized) in this process cannot be traced with its gradients.
    class Net(torch.jit.ScriptModule):
        """Conv2d(2, 256, 1) -> BatchNorm2d -> ReLU three times, then Conv2d(256, 1, 1)."""

        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(2, 256, 1), nn.BatchNorm2d(256)
            self.c2, self.b2 = nn.Conv2d(256, 256, 1), nn.BatchNorm2d(256)
            self.c3, self.b3 = nn.Conv2d(256, 256, 1), nn.BatchNorm2d(256)
            self.c4 = nn.Conv2d(256, 1, 1)

        @torch.jit.script_method
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.b1(self.c1(x)))
            x = torch.relu(self.b2(self.c2(x)))
            x = torch.relu(self.b3(self.c3(x)))
            return self.c4(x)

    return Net


def checkerboard(n: int, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tutorial's task: 2 channels (a board and noise) in, the checkerboard's colour out."""
    g = torch.Generator().manual_seed(seed)
    i, j = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    board = ((i // 4 + j // 4) % 2).float().expand(n, 1, size, size)
    x = torch.cat([board + 0.1 * torch.randn(n, 1, size, size, generator=g), torch.randn(n, 1, size, size, generator=g)], 1)
    return x, board.clone()


def net(seed: int = 0) -> torch.jit.ScriptModule:
    torch.manual_seed(seed)
    return _net_class()()


def test_script_method_net_forward_is_bitwise_and_keeps_its_parameters():
    model = net().eval()
    x, _ = checkerboard(4)
    with torch.autocast("cpu", dtype=torch.float16):
        want = model(x)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    amp = graphamp.convert(model, (x,), dtype=torch.float16)
    got = amp(x)
    assert got.dtype == want.dtype == torch.float16 and torch.equal(got, want)
    assert amp.get_parameter("c1.weight") is model.c1.weight
    assert amp.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())  # the trace left the BN stats alone
    x3, _ = checkerboard(3, size=8, seed=1)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(amp(x3), model(x3))


def test_trainstep_30_fp16_steps_equal_the_canonical_eager_loop():
    """Acceptance: 30 TrainStep steps with fp16 GradScaler are torch.equal to the eager AMP loop."""
    batches = [((checkerboard(4, size=8, seed=s)[0],), {}, checkerboard(4, size=8, seed=s)[1]) for s in range(30)]
    eager, ours = net().train(), net().train()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    want = canonical_loop(eager, F.mse_loss, eager_opt, batches, dtype=torch.float16,
                          scaler=torch.amp.GradScaler("cpu"), max_grad_norm=1.0)
    step = graphamp.TrainStep(ours, F.mse_loss, our_opt, dtype=torch.float16, max_grad_norm=1.0)
    got, _ = run_step(step, batches)
    assert step.steps == 30
    assert_same_losses(got.losses, want.losses)
    assert_same_state(ours, eager, our_opt, eager_opt)
    for (name, a), b in zip(ours.named_buffers(), eager.buffers()):
        assert torch.equal(a, b), name  # BatchNorm running stats too


def test_script_method_net_gradients_are_bitwise():
    x, _ = checkerboard(4, size=8)
    report = graphamp.verify(net().train(), (x,), dtype=torch.float16, grads=True)
    assert report.ok and len(report.grads) == 15, str(report)  # 14 parameters and the input


def test_scripted_module_converts_and_verifies():
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    scripted = torch.jit.script(module)
    x = torch.randn(4, 8)
    report = graphamp.verify(scripted, (x,), dtype=torch.bfloat16, grads=True)
    assert report.ok, str(report)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = scripted(x)
    assert torch.equal(graphamp.export(scripted, (x,)).module()(x), want)


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if bool(y.sum() > 0):
            return y * 2
        return y


def test_script_control_flow_on_values_is_a_script_capture_error():
    scripted = torch.jit.script(_ValueBranch())
    with pytest.raises(graphamp.ScriptCaptureError, match="TorchScript control flow on values.*Way out"):
        graphamp.convert(scripted, (torch.randn(2, 4),))


def test_script_that_fails_on_the_example_names_torchscript():
    scripted = torch.jit.script(nn.Linear(4, 4))
    with pytest.raises(graphamp.ScriptCaptureError, match="TorchScript.*Way out") as e:
        graphamp.convert(scripted, (torch.randn(2, 3),))
    assert "missing a required argument" not in str(e.value)


def test_an_already_optimized_script_is_refused_with_the_way_out():
    cls = _net_class()
    warm, fresh = cls().train(), cls().train()
    x, y = checkerboard(4, size=8)
    for _ in range(4):  # TorchScript profiles, then optimizes the class's forward
        with torch.autocast("cpu", dtype=torch.float16):
            F.mse_loss(warm(x), y).backward()
    with pytest.raises(graphamp.ScriptCaptureError, match="already optimized the code of Net.*Way out: convert"):
        graphamp.convert(fresh, (x,), dtype=torch.float16)


def test_a_deep_copied_script_module_converts_with_eagers_gradient_path():
    # copy.deepcopy of a ScriptModule copies its parameters as clones: plain tensors that are not
    # leaves, whose gradient flows (in eager too) to the original's Parameters. The converted module
    # keeps them as the copy lists them, so values and that gradient path are eager's.
    torch.manual_seed(0)
    original = torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3)))
    copied = copy.deepcopy(original)
    x = torch.randn(2, 4)
    amp = graphamp.convert(copied, (x,), dtype=torch.bfloat16)
    assert [p is q for p, q in zip(amp.parameters(), copied.parameters())] == [True] * 4
    assert list(amp.state_dict()) == list(copied.state_dict())

    def run(call):
        original.zero_grad(set_to_none=True)
        out = call()
        out.float().pow(2).sum().backward()
        return out, [p.grad for p in original.parameters()]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = run(lambda: copied(x))
    got, got_grads = run(lambda: amp(x))
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got_grads, want_grads))
