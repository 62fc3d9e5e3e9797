"""convert's self-check: a conversion that differs from eager autocast on the example raises (or warns)."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp.config import Config
from graphamp.node_info import graph_info
from helpers import TransposedProjection, skip_unless_cached_cast_changes_the_kernel

# graphamp.convert is the function; the module is graphamp's conversion core.
convert_module = sys.modules["graphamp.convert"]
pipeline_module = sys.modules["graphamp.pipeline"]


def _patch_build(monkeypatch: pytest.MonkeyPatch, build) -> None:
    """Make every conversion (convert's own and the engine's fallbacks) call ``build``."""
    for module in (convert_module, pipeline_module):
        monkeypatch.setattr(module, "build", build)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_conversion_records_a_passing_check_with_gradients(dtype: torch.dtype) -> None:
    amp = graphamp.convert(Block(), (_x(),), dtype=dtype)
    check = graph_info(amp).self_check
    assert check.ok and check.grads and check.problem == "" and check.seconds > 0


def test_inference_checks_values_only() -> None:
    check = graph_info(graphamp.convert(Block(), (_x(),), inference=True)).self_check
    assert check.ok and not check.grads


def test_the_check_leaves_the_model_and_random_state_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    graphamp.convert(model, (_x(),))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def _with_wrong_policy(monkeypatch: pytest.MonkeyPatch, overrides: dict) -> None:
    """Make the conversion core build a graph under another policy than the one checked: a stand-in
    for a graphamp bug, which the self-check must catch without knowing where it is."""
    real = pipeline_module.build

    def wrong(model, args, kwargs, spec, **kw):
        bad = dataclasses.replace(spec, config=Config(op_overrides=overrides))
        return real(model, args, kwargs, bad, **kw)

    _patch_build(monkeypatch, wrong)


class ExpThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.exp(x))


def _sandwich() -> nn.Module:
    return ExpThenLinear()


def test_a_value_difference_raises_and_names_the_first_divergent_node(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_wrong_policy(monkeypatch, {"exp": "lower_precision_fp"})  # eager runs exp on the fp32 input
    with pytest.raises(graphamp.PolicyDriftError, match=r"output differs \(max abs .*First divergent node:.*node exp "):
        graphamp.convert(_sandwich(), (_x(),))


def test_a_gradient_only_difference_names_the_node_it_starts_at(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_wrong_policy(monkeypatch, {"layer_norm": "lower_precision_fp"})  # same values, weight cast to fp16
    with pytest.raises(graphamp.PolicyDriftError, match=r"(?s)gradient of proj.weight differs.*First divergent node:.*layer_norm"):
        graphamp.convert(Block(), (_x(),), dtype=torch.float16)


def test_a_dtype_difference_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_wrong_policy(monkeypatch, {"linear": None})  # linear left in fp32: the output comes back fp32
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(graphamp.PolicyDriftError, match=r"comes back torch.float32, eager autocast gives torch.bfloat16"):
        graphamp.convert(model, (_x(),))


def test_a_gradient_only_difference_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pipeline_module.build

    def detached_weight(model, args, kwargs, spec, **kw):
        amp = real(model, args, kwargs, spec, **kw)
        # Same forward values, no gradient through the first weight: what a dropped backward looks like.
        node = next(n for n in amp.graph.nodes if n.op == "get_attr" and n.target.endswith("weight"))
        with amp.graph.inserting_after(node):
            cut = amp.graph.call_function(torch.ops.aten.detach.default, (node,))
        node.replace_all_uses_with(cut, delete_user_cb=lambda user: user is not cut)
        amp.recompile()
        return amp

    _patch_build(monkeypatch, detached_weight)
    with pytest.raises(graphamp.PolicyDriftError, match=r"gradient of .*weight is missing"):
        graphamp.convert(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (_x(),))


def test_warn_returns_the_module_and_records_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_wrong_policy(monkeypatch, {"exp": "lower_precision_fp"})
    with pytest.warns(graphamp.PolicyDriftWarning, match=r"differs from eager"):
        amp = graphamp.convert(_sandwich(), (_x(),), self_check="warn")
    check = graph_info(amp).self_check
    assert not check.ok and "output" in check.problem


def test_off_skips_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_wrong_policy(monkeypatch, {"layer_norm": "lower_precision_fp"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.PolicyDriftWarning)
        amp = graphamp.convert(Block(), (_x(),), dtype=torch.bfloat16, self_check="off")
    assert graph_info(amp).self_check is None


def test_modes_and_policies_that_do_not_promise_equality_are_not_checked() -> None:
    cfg = Config(op_overrides={"layer_norm": "lower_precision_fp"})
    assert graph_info(graphamp.convert(Block(), (_x(),), config=cfg)).self_check is None


@pytest.mark.parametrize("bad", ["yes", 1, "strict"])
def test_a_bad_self_check_value_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"self_check=.*'raise'.*'warn'.*'off'"):
        graphamp.convert(Block(), (_x(),), self_check=bad)


def test_keep_io_types_compares_fp32_outputs_with_eagers_values() -> None:
    amp = graphamp.convert(nn.Sequential(nn.Linear(8, 8)), (_x(),), keep_io_types=True)
    assert graph_info(amp).self_check.ok and amp(_x()).dtype == torch.float32


def test_trainstep_checks_its_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Block()
    step = graphamp.TrainStep(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    step(_x(), target=torch.zeros(4, 8))
    assert graph_info(step.module).self_check.ok and graph_info(step.module).self_check.grads

    train_module = sys.modules["graphamp.train"]
    real = train_module.build

    def wrong(model, args, kwargs, spec, **kw):
        return real(model, args, kwargs, dataclasses.replace(spec, config=Config(op_overrides={"layer_norm": "lower_precision_fp"})), **kw)

    monkeypatch.setattr(train_module, "build", wrong)
    model = Block()
    before = [p.detach().clone() for p in model.parameters()]
    step = graphamp.TrainStep(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float16)
    with pytest.raises(graphamp.PolicyDriftError, match=r"(?s)gradient of model\.proj\.weight differs.*module model\.norm"):
        step(_x(), target=torch.zeros(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step was taken


def test_a_difference_only_under_no_grad_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = sys.modules["graphamp.runtime"]
    real = runtime.WeightCache.get

    def flag_lost(self, param, dtype):  # the cached weight loses eager's requires_grad flag
        return real(self, param, dtype).detach()

    monkeypatch.setattr(runtime.WeightCache, "get", flag_lost)
    monkeypatch.setattr(runtime, "cached_cast", lambda cache, param, dtype: (
        torch.ops.aten._to_copy.default(param, dtype=dtype) if param.requires_grad and torch.is_grad_enabled() else cache.get(param, dtype)
    ))

    x = torch.randn(2, 64, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = TransposedProjection().eval()
    skip_unless_cached_cast_changes_the_kernel(model, x)
    with pytest.warns(graphamp.PolicyDriftWarning, match=r"(?s)under torch.no_grad, output differs.*inference=True"):
        amp = graphamp.convert(model, (x,), dtype=torch.float16)
    assert not graph_info(amp).self_check.ok


def test_a_program_that_differs_only_without_grad_is_said_with_the_way_out() -> None:
    # The model's code reads the grad mode: the exact module holds the grad-mode program, which
    # eager leaves under no_grad. Said (with inference=True as the way out), not refused.
    class GradReader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            return y.softmax(-1) if torch.is_grad_enabled() else y

    model, x = GradReader(), torch.randn(2, 8)
    with pytest.warns(graphamp.PolicyDriftWarning, match=r"under torch.no_grad.*inference=True"):
        graphamp.convert(model, (x,))


def test_an_eval_encoder_is_exact_with_and_without_grad() -> None:
    # Eager runs an eval TransformerEncoder through its fused kernel under no_grad; the exact module
    # converts that program for its calls without grad (tests/test_amp_module_modes.py checks values).
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model, x = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval(), torch.randn(2, 5, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.PolicyDriftWarning)
        amp = graphamp.convert(model, (x,))
    assert graph_info(amp).self_check.ok


def test_outputs_of_a_type_without_key_paths_are_compared() -> None:
    # diffusers registers its output classes with pytree but without flatten_with_keys_fn.
    class Out:
        def __init__(self, sample: torch.Tensor) -> None:
            self.sample = sample

    torch.utils._pytree.register_pytree_node(Out, lambda o: ([o.sample], None), lambda leaves, _: Out(leaves[0]))
    try:

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj = nn.Linear(8, 8)

            def forward(self, x: torch.Tensor) -> Out:
                return Out(self.proj(x))

        with pytest.raises(ValueError, match="flatten_with_keys_fn"):
            torch.utils._pytree.tree_leaves_with_path(Out(_x()))
        amp = graphamp.convert(Model(), (_x(),))
        assert graph_info(amp).self_check.ok and isinstance(amp(_x()), Out)
    finally:
        torch.utils._pytree._deregister_pytree_node(Out)


class _PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with its default nested tensors and a padding mask: eager autocast runs
    it with grad, and fails without ("expected scalar type Float but found BFloat16", torch 2.13)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=padding)


def test_where_eager_itself_fails_under_no_grad_the_no_grad_comparison_is_skipped_and_said():
    # Before: convert raised eager's own RuntimeError from the self-check's no_grad comparison.
    torch.manual_seed(0)
    model = _PaddedEncoder().eval()
    x, padding = torch.randn(2, 6, 16), torch.arange(6).expand(2, 6) >= torch.tensor([[6], [4]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            model(x, padding)
            pytest.skip("eager autocast runs this model under no_grad with this torch: nothing to skip")
        except RuntimeError:
            pass
    with pytest.warns(graphamp.CheckSkippedWarning, match="fails on the example under torch.no_grad") as caught:
        amp = graphamp.convert(model, (x, padding))
    assert [w.message.reason for w in caught if isinstance(w.message, graphamp.CheckSkippedWarning)][0] == "error"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, padding)
    assert torch.equal(amp(x, padding), want)
