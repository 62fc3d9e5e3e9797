"""Custom autograd.Functions keep their own backward through graphamp.convert, the backend and
TrainStep, bitwise equal to eager autocast; checkpointing; capture failures print nothing."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphamp
from graphamp.runtime import KeptFunction
from helpers import assert_exact

DTYPES = [torch.bfloat16, torch.float16]


class STE(torch.autograd.Function):
    """Straight-through estimator: round forward, identity backward (autograd's own derivative
    of round is zero everywhere)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledPair(torch.autograd.Function):
    """Saves tensors, takes non-tensor arguments, returns a tuple; backward differs from autograd's."""

    @staticmethod
    def forward(ctx, a, b, scale, mode):
        ctx.save_for_backward(a, b)
        ctx.scale, ctx.mode = scale, mode
        y = a @ b  # autocast runs it in the low dtype inside the Function, as in eager
        return y * scale, torch.relu(y)

    @staticmethod
    def backward(ctx, g_scaled, g_relu):
        a, b = ctx.saved_tensors
        g = (g_scaled * ctx.scale + (2.0 if ctx.mode == "double" else 1.0) * g_relu).float()
        return g @ b.float().t(), a.float().t() @ g, None, None


class Fp32MatMul(torch.autograd.Function):
    """The AMP docs' recipe: custom_fwd(cast_inputs=float32) and custom_bwd, own backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return 0.5 * grad.mm(b.t()), a.t().mm(grad)  # 0.5: not autograd's derivative


class SteNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant_in = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(STE.apply(self.quant_in(x) * 4))


class FunctionsNet(nn.Module):
    """Every kind of Function call: tuple outputs, custom_fwd/bwd, inside forward's own regions."""

    def __init__(self, no_grad_region: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.out = nn.Linear(8, 8)
        self.no_grad_region = no_grad_region

    def forward(self, x):
        h = STE.apply(self.inp(x) * 3)
        scaled, relu = ScaledPair.apply(h, self.w, 0.5, "double")
        z = Fp32MatMul.apply(scaled, self.out.weight) + relu
        with torch.autocast("cpu", enabled=False):
            z = STE.apply(z.float() * 2)
        if not self.no_grad_region:
            return self.out(z)
        with torch.no_grad():
            shift = STE.apply(z)
        return self.out(z) + shift


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)
        self.calls = None  # an int counts calls (torch.compile refuses the mutation inside checkpoint)

    def forward(self, x, scale):
        if self.calls is not None:
            self.calls += 1
        return self.down(torch.nn.functional.gelu(self.up(x))) * scale


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(16)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, 0.5, use_reentrant=self.use_reentrant)
        return self.norm(x)


class RoundThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(STE.apply(x * 4))


class Unchecked(Checkpointed):
    def forward(self, x):
        for block in self.blocks:
            x = x + block(x, 0.5)
        return self.norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ste_keeps_its_identity_backward(dtype):
    model = SteNet()
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=dtype)
    assert_exact(model, amp, (x,), {}, dtype)  # autograd's derivative of round would give zero grads
    assert_exact(model, amp, (torch.randn(7, 8),), {}, dtype)  # other batch sizes too
    node = next(n for n in amp.graph.nodes if n.name == "ste")
    assert "own backward" in node.meta["graphamp"].reason

    # The gradient STE passes back is the one reaching its output, unchanged (times the 4 before it).
    model = RoundThenLinear()
    x = torch.randn(4, 8, requires_grad=True)
    graphamp.convert(model, (x,), dtype=dtype)(x).sum().backward()
    rounded = torch.round(x.detach() * 4).requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        model.out(rounded).sum().backward()
    assert rounded.grad.abs().sum() > 0
    assert torch.equal(x.grad, rounded.grad * 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_functions_with_custom_fwd_tuples_constants_and_regions_match_eager(dtype):
    model = FunctionsNet()
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=dtype)
    assert_exact(model, amp, (x,), {}, dtype)
    assert_exact(model, amp, (torch.randn(6, 8),), {}, dtype)
    kept = [m for m in amp.modules() if isinstance(m, KeptFunction)]
    assert sorted(m.function.__name__ for m in kept) == ["Fp32MatMul", "STE", "STE", "STE", "ScaledPair"]
    # The region written in forward reaches the kept call: that STE runs with autocast off.
    disabled = [m for m in kept if not any(s.enabled for s in m.autocast)]
    assert [m.function for m in disabled] == [STE]


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_gradients_match_eager(dtype):
    for use_reentrant in (True, False):
        model = Checkpointed(use_reentrant)
        x = torch.randn(4, 16, requires_grad=True)
        amp = graphamp.convert(model, (x,), dtype=dtype)
        assert_exact(model, amp, (x,), {}, dtype)


def test_checkpoint_recompute_is_kept_only_when_reentrant():
    """What the README states: reentrant checkpoint is a custom Function, kept whole, so its
    backward recomputes the block; non-reentrant checkpoint is traced through (saved-tensor
    hooks are not graph ops), so activations are saved as without checkpointing."""
    calls = {}
    for use_reentrant in (True, False):
        model = Checkpointed(use_reentrant)
        x = torch.randn(4, 16, requires_grad=True)
        amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
        block = model.blocks[0]
        block.calls = 0
        out = amp(x)
        forward_calls = block.calls
        out.sum().backward()
        calls[use_reentrant] = (forward_calls, block.calls - forward_calls)
    assert calls == {True: (1, 1), False: (0, 0)}  # (block runs in forward, in backward)


def test_hf_gradient_checkpointing_matches_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, use_cache=False,
    )
    ids = torch.randint(0, 128, (2, 16))
    # transformers' default (use_reentrant=False) is traced through; reentrant is kept whole.
    for reentrant in (True, False):
        model = transformers.LlamaForCausalLM(config).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated for activation_checkpointing_enable
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True} if reentrant else None)
        amp = graphamp.convert(model, (ids,), dtype=torch.bfloat16)
        kept = [m for m in amp.modules() if isinstance(m, KeptFunction)]
        assert len(kept) == (2 if reentrant else 0)  # one CheckpointFunction per decoder layer
        assert_exact(model, amp, (ids,), {}, torch.bfloat16)


def test_save_load_and_deepcopy_keep_the_function(tmp_path):
    # No no_grad region: a reloaded AmpModule loses those (emit's re-trace drops argument-less calls).
    model = FunctionsNet(no_grad_region=False)
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    path = tmp_path / "amp.pt"
    torch.save(amp, path)
    loaded = torch.load(path, weights_only=False)
    copied = copy.deepcopy(amp)
    want = amp(x)
    want.sum().backward()
    want_grad = model.inp.weight.grad.clone()
    assert want_grad.abs().sum() > 0  # STE's identity backward reaches inp (round's derivative is 0)
    for other in (loaded, copied):
        got = other(x)
        assert torch.equal(got, want)
        got.sum().backward()
        assert torch.equal(other.get_parameter("inp.weight").grad, want_grad)  # STE's own backward


def test_saving_a_local_function_raises_a_clear_error():
    class LocalSTE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.round(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return LocalSTE.apply(self.lin(x))

    model, x = Model(), torch.randn(2, 4)
    amp = graphamp.convert(model, (x,))
    with pytest.raises(pickle.PicklingError, match="LocalSTE.*Way out: define the Function at module level"):
        torch.save(amp, io.BytesIO())
    assert torch.equal(copy.deepcopy(amp)(x), amp(x))  # copying needs no name lookup


class ItemFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * float(x.abs().max().item())  # a value: cannot run on fake tensors

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_function_that_cannot_run_on_fake_tensors_raises_a_typed_error():
    class Model(nn.Module):
        def forward(self, x):
            return ItemFunction.apply(x)

    with pytest.raises(graphamp.UnsupportedFunctionError, match="ItemFunction.*Way out"):
        graphamp.convert(Model(), (torch.randn(3, 4),))
    assert issubclass(graphamp.UnsupportedFunctionError, graphamp.CaptureError)


def test_function_closing_over_a_forward_tensor_raises_a_typed_error():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            mask = x > 0
            return checkpoint(lambda h: self.lin(h) * mask, x, use_reentrant=True)

    with pytest.raises(graphamp.UnsupportedFunctionError, match="closes over 'mask'.*Way out: pass"):
        graphamp.convert(Model(), (torch.randn(3, 4, requires_grad=True),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_keeps_the_functions_backward(dtype):
    from test_backend import assert_exact_compiled, compiled

    torch._dynamo.reset()
    model = FunctionsNet()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Inside torch.autocast: custom_fwd reads the state while dynamo traces (README).
        assert_exact_compiled(compiled(model, dtype=dtype), model, (x,), {}, dtype, ambient=dtype)
    assert not [w for w in caught if "graphamp" in str(w.message)]  # kept, not inlined: nothing to warn


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_backend_checkpoint_matches_eager_and_recomputes(use_reentrant):
    from test_backend import assert_exact_compiled, compiled

    def saved_bytes(module, x):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            module(x)
        return sum(saved)

    torch._dynamo.reset()
    model, x = Checkpointed(use_reentrant), torch.randn(4, 16, requires_grad=True)
    cm = compiled(model)
    assert_exact_compiled(cm, model, (x,), {}, torch.bfloat16)
    plain = Unchecked(use_reentrant)
    plain.load_state_dict(model.state_dict())
    # AOTAutograd's partitioner recomputes the tagged regions: less is saved for backward.
    assert saved_bytes(cm, x) < 0.6 * saved_bytes(compiled(plain), x)


def test_train_step_with_ste_matches_the_canonical_loop():
    import torch.nn.functional as F

    model = SteNet()
    ours = copy.deepcopy(model)
    opt, our_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ours))
    scaler = torch.amp.GradScaler("cpu")
    step = graphamp.TrainStep(ours, F.mse_loss, our_opt, dtype=torch.float16, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, target = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), target)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        assert torch.equal(step(x, target=target), loss.detach().float())
    for (name, p), q in zip(model.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.quant_in.weight, SteNet().quant_in.weight)


def test_failed_capture_prints_nothing(capfd):
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # export refuses the branch; convert's dynamo fallback runs it, and it raises
                raise ValueError("positive")
            return x - 1

    with pytest.raises(graphamp.CaptureError) as info:
        graphamp.convert(Branchy(), (torch.ones(3, 4),))
    out, err = capfd.readouterr()
    assert out == ""
    assert "def forward" not in err  # torch.export's dump of the partial graph
    assert "data-dependent control flow" in str(info.value) and "Way out" in str(info.value)
