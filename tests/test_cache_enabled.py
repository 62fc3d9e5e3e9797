"""Config(cache_enabled=False): graphamp against eager ``torch.autocast(cache_enabled=False)``.

Eager autocast caches the low-precision cast of an fp32 leaf that requires grad (a weight) for the
length of its region: a weight used by two low-precision ops is cast once, and their gradients are
summed in the low dtype before one cast up. With ``cache_enabled=False`` (PyTorch Lightning's
``precision="bf16-mixed"``) every use casts, and the gradients are summed in fp32. Outputs agree;
gradients of a weight used twice do not. Each setting must be reproduced bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp import Config
from graphamp.backend.options import BackendOptions
from graphamp.errors import OptionError
from graphamp.node_info import graph_info
from graphamp.verify.reference import count_casts, trace
from helpers import TransposedProjection, float_leaves, skip_unless_cached_cast_changes_the_kernel

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
CACHE = pytest.mark.parametrize("cache_enabled", [True, False], ids=["cache", "no_cache"])


class Twice(nn.Module):
    """One Linear applied twice: its weight and bias each feed two low-precision ops."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _loss(out: object) -> torch.Tensor:
    total = torch.zeros(())
    for i, t in enumerate(float_leaves(out)):
        total = total + (t.float() * torch.linspace(-1, 1, t.numel()).reshape(t.shape) * (i + 1)).sum()
    return total


def _grads(call, model: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = call()
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [t.detach() for t in float_leaves(out)], grads


def _eager(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, cache_enabled: bool):
    def call():
        with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
            return model(*args, **kwargs)

    return _grads(call, model)


def _same(a, b) -> bool:
    (out_a, g_a), (out_b, g_b) = a, b
    return (
        len(out_a) == len(out_b)
        and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(out_a, out_b))
        and g_a.keys() == g_b.keys()
        and all(torch.equal(g_a[n], g_b[n]) for n in g_a)
    )


def _eager_casts(model: nn.Module, x: torch.Tensor, dtype: torch.dtype, cache_enabled: bool) -> int:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
            return model(x)

    return count_casts(trace(run, (x,), {}, no_grad=False))


@DTYPES
def test_installed_torch_shares_weight_casts_only_with_the_cache(dtype: torch.dtype) -> None:
    # The facts the feature rests on, asked of the installed torch: with the cache a weight used
    # twice is cast once (bias and weight once, x once: the second linear's input is already low),
    # without it on each use;
    # and the two settings' gradients differ, so neither is a stand-in for the other.
    model, x = Twice(), _x(4, 16)
    assert _eager_casts(model, x, dtype, True) == 3
    assert _eager_casts(model, x, dtype, False) == 5
    with_cache, without = _eager(model, (x,), {}, dtype, True), _eager(model, (x,), {}, dtype, False)
    assert all(torch.equal(a, b) for a, b in zip(with_cache[0], without[0]))
    assert not all(torch.equal(with_cache[1][n], without[1][n]) for n in with_cache[1])


@DTYPES
@CACHE
def test_cast_counts_and_gradients_follow_cache_enabled(dtype: torch.dtype, cache_enabled: bool) -> None:
    model, x = Twice(), _x(4, 16)
    config = Config(cache_enabled=cache_enabled)
    report = graphamp.verify(model, (x,), dtype=dtype, config=config, grads=True)
    assert report.ok, report
    assert report.casts["graphamp"] == report.casts["eager"] == (3 if cache_enabled else 5)
    amp = graphamp.convert(model, (x,), dtype=dtype, config=config)
    got = _grads(lambda: amp(x), model)
    assert _same(got, _eager(model, (x,), {}, dtype, cache_enabled))
    assert not _same(got, _eager(model, (x,), {}, dtype, not cache_enabled))


def _albert() -> tuple[nn.Module, dict]:
    # ALBERT shares one layer's weights across all layers: every weight feeds three linears.
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.AlbertConfig(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return transformers.AlbertForMaskedLM(cfg), {"input_ids": ids}


@DTYPES
def test_albert_shared_layers_bitwise_to_uncached_autocast(dtype: torch.dtype) -> None:
    model, kwargs = _albert()
    amp = graphamp.convert(model, (), kwargs, dtype=dtype, config=Config(cache_enabled=False))
    assert graph_info(amp).self_check.ok and graph_info(amp).self_check.grads  # its self-check ran uncached
    got = _grads(lambda: amp(**kwargs), model)
    assert _same(got, _eager(model, (), kwargs, dtype, False))
    assert not _same(got, _eager(model, (), kwargs, dtype, True))


@DTYPES
def test_a_leaf_input_used_twice_is_cast_per_use(dtype: torch.dtype) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("a", _x(8, 8))
            self.register_buffer("b", _x(8, 8) * 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.a + x @ self.b

    model = TwoHeads()

    def input_grad(call, x):
        x = x.clone().requires_grad_(True)
        _loss(call(x)).backward()
        return x.grad

    x = _x(8, 8)
    amp = graphamp.convert(model, (x,), dtype=dtype, config=Config(cache_enabled=False))

    def eager(cache_enabled):
        def call(x):
            with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
                return model(x)

        return call

    got = input_grad(amp, x)
    assert torch.equal(got, input_grad(eager(False), x))
    assert not torch.equal(got, input_grad(eager(True), x))


@pytest.mark.parametrize("inference", [False, True], ids=["exact", "inference"])
def test_no_grad_calls_take_the_uncached_kernel(inference: bool) -> None:
    # Under no_grad eager's cached cast still requires grad (matmul folds into mm), an uncached
    # one does not (bmm), and fp16 rounds the two differently.
    model, x = TransposedProjection().eval(), _x(2, 64, 16, 16)

    def eager(cache_enabled):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache_enabled):
            return model(x)

    skip_unless_cached_cast_changes_the_kernel(model, x)
    ref = eager(False)
    assert not torch.equal(ref, eager(True))
    amp = graphamp.convert(model, (x,), dtype=torch.float16, inference=inference, config=Config(cache_enabled=False))
    for _ in range(2):  # and again, after a first call
        with torch.no_grad():
            out = amp(x)
        assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_train_step_matches_an_uncached_autocast_loop() -> None:
    torch.manual_seed(0)
    model = Twice()
    twin = Twice()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    step = graphamp.TrainStep(model, F.mse_loss, opt, dtype=torch.bfloat16, max_grad_norm=1.0, config=Config(cache_enabled=False))
    for i in range(3):
        x, y = _x(4, 16) + i, _x(4, 16) * i
        loss = step(x, target=y)
        twin_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            ref = F.mse_loss(twin(x), y)
        ref.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        twin_opt.step()
        assert torch.equal(loss, ref.detach())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


class BranchTwice(nn.Module):
    """A Python branch on a value (torch.export refuses it: convert falls back to dynamo); the
    Linear is applied twice on both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = torch.relu(h) if h.float().sum() > 0 else -h
        return self.lin(h)


def test_the_dynamo_fallback_keeps_cache_enabled() -> None:
    torch._dynamo.reset()
    model, x = BranchTwice(), _x(4, 16)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16, config=Config(cache_enabled=False))
    assert isinstance(amp, graphamp.DynamoAmpModule)
    got = _grads(lambda: amp(x), model)
    assert _same(got, _eager(model, (x,), {}, torch.bfloat16, False))
    assert not _same(got, _eager(model, (x,), {}, torch.bfloat16, True))
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "options, ambient",
    [({"cache_enabled": False}, None), ({"config": Config(cache_enabled=False)}, None), ({}, False)],
    ids=["option", "config", "enclosing_region"],
)
def test_backend_reproduces_uncached_autocast(options: dict, ambient: bool | None) -> None:
    torch._dynamo.reset()
    model, x = Twice(), _x(4, 16)
    compiled = torch.compile(model, backend="graphamp", options={"inner": "eager", **options})

    def call():
        if ambient is None:
            return compiled(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=ambient):
            return compiled(x)

    got = _grads(call, model)
    assert _same(got, _eager(model, (x,), {}, torch.bfloat16, False))
    assert not _same(got, _eager(model, (x,), {}, torch.bfloat16, True))
    torch._dynamo.reset()


def test_backend_options_resolve_cache_enabled() -> None:
    assert BackendOptions.parse({"cache_enabled": False}).config.cache_enabled is False
    assert BackendOptions.parse(None).cache_enabled is True
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert BackendOptions.parse({}).config.cache_enabled is False
        # An explicit option wins over the enclosing region.
        assert BackendOptions.parse({"cache_enabled": True}).cache_enabled is True
    with pytest.raises(OptionError, match="contradicts option config"):
        BackendOptions.parse({"cache_enabled": True, "config": Config(cache_enabled=False)})
    with pytest.raises(OptionError, match="True or False"):
        BackendOptions.parse({"cache_enabled": "no"})


def test_config_cache_enabled_is_validated_and_keeps_the_dtype_check() -> None:
    with pytest.raises(TypeError, match="cache_enabled must be True or False"):
        Config(cache_enabled=0)
    config = Config(cache_enabled=False)
    assert not config.is_default and config.keeps_policy
    spec = graphamp.spec.AmpSpec("cpu", torch.bfloat16, config=config)
    assert spec.check and not spec.cache_enabled  # dtypes are still checked against eager's
