"""emit: the AmpModule over the model's own state, with the input guard and the spec's record."""

import pytest
import torch
from torch import nn

import graphamp
from graphamp.capture import capture
from graphamp.emit import emit
from graphamp.passes import build_pipeline, run_passes
from graphamp.spec import AmpSpec


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("offset", torch.ones(4), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale + self.offset


def _emitted(model, x, spec):
    gm = capture(model, (x,), {}, device_type=spec.device_type, dtype=spec.dtype)
    run_passes(gm, spec, build_pipeline(spec))
    return emit(gm, model, spec, example=((x,), {}))


def test_state_is_the_models_own_and_state_dict_matches():
    model, x = WithBuffers(), torch.randn(3, 4)
    spec = AmpSpec("cpu", torch.bfloat16)
    amp = _emitted(model, x, spec)
    assert amp.get_parameter("lin.weight") is model.lin.weight and amp.get_buffer("scale") is model.scale
    assert list(amp.state_dict()) == list(model.state_dict())  # the non-persistent buffer stays out
    info = amp.graphamp_info
    assert (info.device_type, info.dtype, info.mode, info.inference, info.training) == ("cpu", torch.bfloat16, "exact", False, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(amp(x), model(x))


def test_the_input_guard_refuses_what_the_graph_was_not_built_for():
    model, x = WithBuffers(), torch.randn(3, 4)
    amp = _emitted(model, x, AmpSpec("cpu", torch.bfloat16))
    with pytest.raises(graphamp.InputMismatchError, match="converted for torch.float32"):
        amp(x.double())
    with pytest.raises(graphamp.InputMismatchError, match="dim 1 is 5"):
        amp(torch.randn(3, 5))
