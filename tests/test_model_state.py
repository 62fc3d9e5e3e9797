"""A parameter or buffer replaced anywhere in the model after conversion is caught at the next call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphamp
from graphamp.model_state import ModelState

BF16 = torch.bfloat16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4))


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        return model(x)


def _replace_second_weight(model: nn.Module) -> None:
    model[2].weight = nn.Parameter(torch.randn(4, 8))


def _assign_state_dict(model: nn.Module) -> None:
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _replace_buffer(model: nn.Module) -> None:
    model[3].running_mean = torch.ones(4, dtype=torch.float64)  # of another dtype (one of the same is followed)


def _swap_submodule(model: nn.Module) -> None:
    model[2] = nn.Linear(8, 4)


def _swap_class(model: nn.Module) -> None:
    # As fully_shard does to each unit: a subclass, with the unit's parameters swapped through the
    # module's own dictionary (no registration hook runs).
    unit = model[2]
    unit.__class__ = type("FSDPLinear", (nn.Linear,), {})
    unit._parameters["weight"] = nn.Parameter(unit.weight.detach().clone())


@pytest.mark.parametrize("inference", [False, True], ids=["training graph", "inference"])
@pytest.mark.parametrize(
    "change, names",
    [
        (_replace_second_weight, "2.weight"),
        (_assign_state_dict, "0.weight"),
        (_replace_buffer, "3.running_mean"),
        (_swap_submodule, "2.weight"),
        (_swap_class, "2.weight"),
    ],
    ids=["non-first parameter", "load_state_dict(assign=True)", "buffer", "submodule", "class and dictionary"],
)
def test_a_replaced_tensor_is_named_at_the_next_call(change, names, inference):
    model = _model().eval()
    x = torch.randn(3, 4)
    amp = graphamp.convert(model, (x,), inference=inference)
    assert torch.equal(amp(x), _eager(model, x))  # the warm path first
    change(model)
    with pytest.raises(graphamp.ModelChangedError, match=names.replace(".", r"\.")):
        amp(x)
    with pytest.raises(graphamp.ModelChangedError):  # and at every call after
        amp(x)


def test_in_place_updates_are_not_replacements():
    model = _model().train()
    x = torch.randn(3, 4)
    amp = graphamp.convert(model, (x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp(x).float().sum().backward()
    opt.step()
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # copies into the same tensors
    with torch.no_grad():
        model[0].weight.data.copy_(torch.randn(8, 4))
    model[0].add_module("extra", nn.Linear(2, 2))  # a new submodule the graph never reads
    amp.eval(), model.eval()
    assert torch.equal(amp(x), _eager(model, x))


def test_a_graphamp_run_of_code_that_assigns_a_buffer_leaves_the_model_as_it_was():
    # The self-check runs the model eagerly; code that assigns a buffer in forward would leave
    # another object in the model, which the next call took for a replaced tensor.
    class Assigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = self.seen + 0  # a new object each call, same values
            return self.lin(x) + self.seen

    model, x = Assigns(), torch.randn(2, 4)
    buffer = model.seen
    amp = graphamp.convert(model, (x,))
    assert model.seen is buffer
    assert torch.equal(amp(x), _eager(model, x))


class _AssignsInTraining(nn.Module):
    """Keeps a running minimum by assigning a new buffer in training forward, as I-BERT's QuantAct does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("low", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.training:
            self.low = torch.minimum(self.low, y.detach().float().amin(0))
        return y + self.low


@pytest.mark.parametrize(
    "options", [{}, {"inference": True}, {"compile": True, "inference": True}], ids=["graph", "inference", "compiled, frozen"],
)
def test_a_buffer_the_model_replaces_with_one_of_its_kind_is_followed(options):
    # Eager training calls of the model leave a new buffer in it; the converted eval module, and
    # the one it converted for another batch size, read it from then on, as eager does.
    torch.manual_seed(0)
    model, x, x5 = _AssignsInTraining().eval(), torch.randn(2, 4), torch.randn(5, 4)
    amp = graphamp.convert(model, (x,), **options)
    assert torch.equal(amp(x), _eager(model, x)) and torch.equal(amp(x5), _eager(model, x5))
    for scale in (1.0, 5.0):
        model.train()
        _eager(model, scale * torch.randn(3, 4))
        model.eval()
        assert torch.equal(amp(x), _eager(model, x)) and torch.equal(amp(x5), _eager(model, x5))
    assert model.low.min() < 0  # the values moved, so an old buffer would have differed


def test_a_buffer_a_converted_training_module_writes_stays_the_models():
    torch.manual_seed(0)
    model, x = _AssignsInTraining().train(), torch.randn(2, 4)
    reference = copy.deepcopy(model)
    amp = graphamp.convert(model, (x,))
    for _ in range(3):
        x = torch.randn(2, 4)
        assert torch.equal(amp(x), _eager(reference, x))
        assert torch.equal(model.low, reference.low) and amp.low is model.low


def test_model_state_is_cheap_when_nothing_changed():
    model = _model()
    state = ModelState(model)
    assert state.unchanged() and state.replaced(model) == []
    nn.Linear(2, 2)  # any registration anywhere in the process moves the count: then compared once
    assert not state.unchanged() and state.replaced(model) == []
    state.accept(model)
    assert state.unchanged()


def test_a_loaded_inference_module_checks_against_its_loaded_model():
    # Its weights frozen to low precision are its own buffers under the model's parameter names:
    # compared with what they were cast from, not taken for replacements.
    import io

    model = _model().eval()
    x = torch.randn(3, 4)
    amp = graphamp.convert(model, (x,), inference=True)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    nn.Linear(2, 2)  # a registration anywhere: the next call compares every tensor
    want = _eager(model, x)
    assert torch.equal(loaded(x), want)
    loaded_model = loaded.__dict__["_graphamp_model"]
    loaded_model[2].weight = nn.Parameter(torch.randn(4, 8))
    with pytest.raises(graphamp.ModelChangedError, match=r"2\.weight"):
        loaded(x)


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("retype", ["half", "double"])
def test_a_model_retyped_after_conversion_is_named_where_the_graph_fails(retype, inference):
    # The graph's casts were chosen for fp32 tensors: after model.half() the LayerNorm (an fp32 op,
    # where eager autocast casts its fp16 weight up) gets an fp16 weight and the graph fails.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4)
    amp = graphamp.convert(model, (x,), inference=inference)
    getattr(model, retype)()
    with pytest.raises(graphamp.ModelChangedError, match=r"changed dtype or device .*6 of 6: 0\.weight.*Way out"):
        amp(x)


def test_a_model_retyped_to_the_low_dtype_still_matches_eager():
    # To bf16 the graph's casts become no-ops and it still runs eager autocast's program.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4)
    amp = graphamp.convert(model, (x,))
    model.to(BF16)
    assert torch.equal(amp(x), _eager(model, x))
