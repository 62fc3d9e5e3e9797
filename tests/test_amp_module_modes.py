"""The converted module behaves as the model: its training mode and grad mode pick the graph eager's
program needs, its parameters come in the model's order, its forward shows the model's signature,
hooks run, and a model whose parameters were swapped after conversion is refused."""

from __future__ import annotations

import inspect
import io
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import graphamp
from graphamp.testing import zoo
from helpers import assert_exact, assert_same_outputs

sys.path.insert(0, str(Path(__file__).parent))
from factories import llama  # noqa: E402


class DropNorm(nn.Module):
    """Dropout and batch norm: what train() and eval() change."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x)))))


def _eager(model, x, dtype=torch.bfloat16):
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=dtype):
        return model(x)


def _amp(amp, x):
    torch.manual_seed(1)
    return amp(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_train_and_eval_switch_graphs(dtype, caplog):
    torch.manual_seed(0)
    model, x = DropNorm().train(), torch.randn(6, 8)
    amp = graphamp.convert(model, (x,), dtype=dtype)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        amp.eval()
        assert not any(m.training for m in amp.modules())
        model.eval()
        assert torch.equal(_amp(amp, x), _eager(model, x, dtype))  # running stats, no dropout
        model.train()
        assert all(m.training for m in model.modules())  # conversion left the model's mode alone
    assert "eval mode" in caplog.text
    amp.train()
    out = _amp(amp, x)
    assert torch.equal(out, _eager(model, x, dtype))
    # the model and the module share buffers: a training call moved the running stats of both
    assert amp.get_buffer("norm.running_mean") is model.norm.running_mean


def test_eval_graph_is_exact_in_gradients_too():
    case = zoo.build("bert")
    model = case.model.train()
    args, kwargs = case.make_inputs(2, 8)
    amp = graphamp.convert(model, args, kwargs)
    amp.eval()
    model.eval()
    assert_exact(model, amp, args, kwargs, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transformer_encoder_without_grad_takes_eagers_fused_kernel(dtype):
    """Eval nn.TransformerEncoder under no_grad runs eager's fused kernel; an exact module follows it
    there (converted on the first such call) and the ordinary ops with grad, so both are bitwise."""
    case = zoo.build("transformer_encoder")
    model = case.model.eval()
    args, kwargs = case.make_inputs(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.PolicyDriftWarning)  # nothing left to warn about
        amp = graphamp.convert(model, args, kwargs, dtype=dtype)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=dtype):
            want = model(*args, **kwargs)
        got = amp(*args, **kwargs)
        assert_same_outputs(got, want)
        assert_same_outputs(amp(*case.make_inputs(3, 5)[0]), _fused_eager(model, case.make_inputs(3, 5)[0][0], dtype))
    with torch.no_grad():
        variant = amp._for_mode(args, kwargs)
    assert variant is not amp and "_transformer_encoder_layer_fwd" in variant.code
    assert_exact(model, amp, args, kwargs, dtype)  # with grad: the ordinary ops, as eager


def test_frozen_encoder_with_grad_enabled_takes_the_fused_kernel_too():
    # Eager's fast path asks whether the call builds an autograd graph, not only the grad mode.
    case = zoo.build("transformer_encoder")
    model = case.model.eval()
    args, kwargs = case.make_inputs(2, 8)
    amp = graphamp.convert(model, args, kwargs)
    model.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(*args, **kwargs)
    assert_same_outputs(amp(*args, **kwargs), want)
    model.requires_grad_(True)


def _fused_eager(model, x, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return model(x)


def test_parameters_in_the_models_order():
    model, args, kwargs = llama(hidden=32)
    amp = graphamp.convert(model, args, kwargs)
    assert [n for n, _ in amp.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(amp.parameters(), model.parameters()))
    assert list(amp.state_dict()) == list(model.state_dict())


def test_forward_shows_the_models_signature_and_runs_the_dispatch():
    model, args, kwargs = llama(hidden=32)
    amp = graphamp.convert(model, args, kwargs)
    assert inspect.signature(amp.forward) == inspect.signature(model.forward)
    calls = []
    amp.register_forward_hook(lambda *_: calls.append(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # amp.forward switches the ambient region off too
        direct = amp.forward(*args, **kwargs)
        want = model(*args, **kwargs)
    assert_same_outputs(direct, want)
    amp(*args, **kwargs)
    assert calls == [1]  # hooks run once per call, not on forward()


def test_saved_module_keeps_signature_and_switches_mode(tmp_path):
    torch.manual_seed(0)
    model, x = DropNorm().eval(), torch.randn(6, 8)
    amp = graphamp.convert(model, (x,))
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert list(inspect.signature(loaded.forward).parameters) == ["x"]
    loaded.train()
    loaded_model = loaded.__dict__["_graphamp_model"]
    assert torch.equal(_amp(loaded, x), _eager(loaded_model.train(), x))


def test_replaced_parameter_raises():
    torch.manual_seed(0)
    model, x = DropNorm().eval(), torch.randn(6, 8)
    amp = graphamp.convert(model, (x,))
    model.a.weight = nn.Parameter(model.a.weight.detach().clone())
    with pytest.raises(graphamp.ModelChangedError, match="a.weight"):
        amp(x)


def test_model_class_swapped_by_a_wrapper_is_fine():
    torch.manual_seed(0)
    model, x = DropNorm().eval(), torch.randn(6, 8)
    amp = graphamp.convert(model, (x,))
    model.__class__ = type("Wrapped", (DropNorm,), {})
    assert torch.equal(amp(x), _eager(model, x))


def test_the_models_public_attributes_and_safe_methods_pass_through(tmp_path):
    model, args, kwargs = llama(hidden=32)
    amp = graphamp.convert(model, args, kwargs)
    assert amp.config is model.config and amp.main_input_name == "input_ids"
    amp.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    with pytest.raises(graphamp.ModelMethodError, match="unconverted code.*transformers.compile"):
        amp.generate  # noqa: B018 (the model's generate would run the eager model: refused)
    assert not hasattr(amp, "generate")
    with pytest.raises(AttributeError):
        amp.no_such_attribute  # noqa: B018
    assert not hasattr(amp, "_hf_hook")  # private names are never the model's
