"""graphamp.search: a small set of fp32 modules that makes fp16 outputs finite and close to fp32."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import graphamp
from graphamp.search import default_validate
from test_explain import overflow_mlp


def _search(model, args, kwargs=None, caplog=None, **options):
    with caplog.at_level(logging.INFO, logger="graphamp.search"):
        config = graphamp.search(model, args, kwargs, dtype=torch.float16, **options)
    report = next(r.report for r in caplog.records if hasattr(r, "report"))
    return config, report


def _assert_fixed(model, args, kwargs, config):
    amp = graphamp.convert(model, args, kwargs, dtype=torch.float16, config=config)
    with torch.no_grad():
        out, ref = amp(*args, **kwargs), model(*args, **kwargs)
    out = out if isinstance(out, torch.Tensor) else out[0]
    ref = ref if isinstance(ref, torch.Tensor) else ref[0]
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_mlp_keeps_just_the_overflowing_linear(caplog):
    model, x = overflow_mlp(), torch.randn(8, 16)
    config, report = _search(model, (x,), caplog=caplog, max_trials=4)
    assert config.fp32_modules == ("2",)
    assert len(report.trials) <= 4 and report.trials[0].nonfinite > 0 and report.trials[-1].passed
    assert report.ms_result is not None and report.outputs_max_rel < 1e-2
    _assert_fixed(model, (x,), {}, config)


def test_t5_keeps_the_wo_layers(caplog):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=4, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(3e4)  # T5's known fp16 overflow
    kwargs = dict(input_ids=torch.randint(0, 64, (2, 8)), decoder_input_ids=torch.randint(0, 64, (2, 5)), use_cache=False)
    e = graphamp.explain(model, (), kwargs, dtype=torch.float16)
    assert e.first_nonfinite.module == "encoder.block.1.layer.1.DenseReluDense.wo"
    config, report = _search(model, (), kwargs, caplog=caplog, max_trials=6)
    assert config.fp32_modules == ("encoder.block.1.layer.1.DenseReluDense.wo",)
    assert len(report.trials) <= 6
    _assert_fixed(model, (), kwargs, config)


def test_vit_with_an_injected_overflow(caplog):
    from graphamp.testing import zoo

    case = zoo.vit()
    model = case.model.eval()
    args, kwargs = case.inputs
    with torch.no_grad():
        model.get_submodule("layers.1.mlp.fc1").weight.mul_(20)  # larger activations, still far from 65504
        model.get_submodule("layers.1.mlp.fc2").weight.mul_(5e5)  # its output overflows fp16
    config, report = _search(model, args, kwargs, caplog=caplog, max_trials=6)
    assert config.fp32_modules == ("layers.1.mlp.fc2",)
    assert len(report.trials) <= 6
    _assert_fixed(model, args, kwargs, config)


def test_a_model_that_already_passes_gets_the_empty_config(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.warns(graphamp.SearchWarning, match="already passes"):
        config, report = _search(model, (torch.randn(4, 8),), caplog=caplog)
    assert config == graphamp.Config() and report.already_passed and len(report.trials) == 1


def test_bad_arguments_are_typed_errors():
    model, x = overflow_mlp(), torch.randn(8, 16)
    with pytest.raises(TypeError, match="validate must be a callable"):
        graphamp.search(model, (x,), dtype=torch.float16, validate=True)
    with pytest.raises(ValueError, match="max_trials=0"):
        graphamp.search(model, (x,), dtype=torch.float16, max_trials=0)
    with pytest.raises(ValueError, match="rtol"):
        graphamp.search(model, (x,), dtype=torch.float16, rtol=-1.0)


def test_nothing_passes_within_max_trials():
    model, x = overflow_mlp(), torch.randn(8, 16)
    with pytest.raises(graphamp.SearchError, match="max_trials=1") as info:
        graphamp.search(model, (x,), dtype=torch.float16, max_trials=1)
    assert len(info.value.report.trials) == 1 and info.value.report.config is None


def test_custom_validate_drives_the_search():
    model, x = overflow_mlp(), torch.randn(8, 16)
    seen = []

    def validate(outputs):
        seen.append(outputs)
        return bool(torch.isfinite(outputs).all())

    assert graphamp.search(model, (x,), dtype=torch.float16, validate=validate).fp32_modules == ("2",)
    assert len(seen) >= 2 and not torch.isfinite(seen[0]).all()
    assert default_validate(torch.ones(2), torch.float16, rtol=0.0)(torch.ones(2, dtype=torch.float16))
