"""The convert API: bad input, the returned module's contract, config, and what users expect."""

import copy
import io
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import graphamp
from graphamp.verify.fake_cuda import fake_cuda_model
from conftest import build_case
from helpers import assert_exact, assert_same_outputs


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, x):
        h = self.norm(self.a(x)) * self.scale
        with torch.autocast("cpu", enabled=False):
            fp32 = self.b(h.float())
        return h, fp32


def _x(batch=4):
    return torch.randn(batch, 8)


# Bad input: a typed error that names the problem and the way out.

@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"dtype": torch.int8}, ValueError, ["torch.int8", "torch.bfloat16"]),
        ({"dtype": torch.float32}, ValueError, ["torch.float32", "torch.float16"]),
        ({"dtype": "int8"}, ValueError, ["int8", "bf16"]),
        ({"dtype": 16}, TypeError, ["torch.dtype"]),
        ({"device_type": "tpu"}, ValueError, ["tpu", "cpu", "cuda"]),
        ({"device_type": 0}, TypeError, ["device_type"]),
        ({"mode": "fast"}, ValueError, ["fast", "exact"]),
        ({"config": {"softmax.int": "fp32"}}, TypeError, ["graphamp.Config"]),
    ],
    ids=["int-dtype", "fp32-dtype", "str-dtype", "int-as-dtype", "unknown-device", "device-not-str", "unknown-mode", "dict-config"],
)
def test_bad_arguments_name_the_problem(kwargs, error, words):
    with pytest.raises(error) as info:
        graphamp.convert(Small(), (_x(),), **kwargs)
    for word in words:
        assert word in str(info.value)


def test_non_module_is_a_type_error():
    with pytest.raises(TypeError, match="nn.Module"):
        graphamp.convert(lambda x: x @ x, (_x(),))


def test_bad_example_inputs():
    with pytest.raises(TypeError, match="tuple"):
        graphamp.convert(Small(), 3)
    with pytest.raises(TypeError, match="dict"):
        graphamp.convert(Small(), (_x(),), [1])


def test_converting_twice_is_refused():
    amp = graphamp.convert(Small(), (_x(),))
    with pytest.raises(ValueError, match="already converted"):
        graphamp.convert(amp, (_x(),))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_untraceable_model_falls_back_to_dynamo_and_says_why():
    # torch.export refuses the value branch; convert then splits the graph there with dynamo.
    amp = graphamp.convert(DataDependent(), (_x(),))
    assert isinstance(amp, graphamp.DynamoAmpModule)
    reason = amp.cast_summary()["reason"]
    assert "data-dependent" in reason and "DataDependent" in reason
    for x in (_x(), -_x()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = DataDependent()(x)
        assert torch.equal(amp(x), want)


class BCE(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.binary_cross_entropy(torch.sigmoid(self.lin(x)), y)


def test_banned_op_under_cuda_policy():
    model = BCE()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = fake_cuda_model(model)
        x, y = torch.rand(4, 8, device="cuda"), torch.rand(4, 1, device="cuda")
        with pytest.raises(graphamp.BannedOpError, match="binary_cross_entropy_with_logits") as info:
            graphamp.convert(fake, (x, y))
    assert isinstance(info.value, RuntimeError)  # the same kind of error eager autocast raises


def test_banned_op_from_config_is_raised_by_the_pass():
    config = graphamp.Config(op_overrides={"binary_cross_entropy": "banned"})
    with pytest.raises(graphamp.BannedOpError, match="binary_cross_entropy_with_logits"):
        graphamp.convert(BCE(), (torch.rand(4, 8), torch.rand(4, 1)), config=config)


def test_bce_is_fp32_on_cpu_and_exact():
    model, args = BCE(), (torch.rand(4, 8), torch.rand(4, 1))
    amp = graphamp.convert(model, args)
    assert_exact(model, amp, args, {}, torch.bfloat16)


def test_wrong_inputs_at_call_time():
    amp = graphamp.convert(Small(), (_x(),))
    with pytest.raises(graphamp.InputMismatchError, match="torch.float64"):
        amp(_x().double())
    with pytest.raises(graphamp.InputMismatchError, match="dim 1"):
        amp(torch.randn(4, 9))
    assert amp(_x(1))[0].shape == (1, 8)  # batch 1 works though the example had batch 4


# The returned module.

def test_defaults_follow_autocast():
    amp = graphamp.convert(Small(), (_x(),))
    assert amp.graphamp_info.device_type == "cpu" and amp.graphamp_info.dtype is torch.bfloat16


def test_shares_parameters_and_state_dict_keys():
    case = build_case("gpt2")  # tied input and output embeddings
    args, kwargs = case.inputs
    amp = graphamp.convert(case.model, args, kwargs)
    assert amp.state_dict().keys() == case.model.state_dict().keys()
    ours = dict(amp.named_parameters(remove_duplicate=False))
    for name, p in case.model.named_parameters(remove_duplicate=False):
        assert ours[name] is p
    amp.load_state_dict(case.model.state_dict())


def test_non_persistent_buffers_stay_out_of_state_dict():
    model = Small()
    amp = graphamp.convert(model, (_x(),))
    assert amp.state_dict().keys() == model.state_dict().keys()
    assert "cache" not in amp.state_dict()


def test_optimizer_on_model_parameters_trains_converted_module():
    model, x = Small(), _x()
    amp = graphamp.convert(model, (x,))
    reference = copy.deepcopy(model)
    for m, run in ((model, amp), (reference, None)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            if run is None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = m(x)
            else:
                out = run(x)
            (out[0].float().pow(2).sum() + out[1].sum()).backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_model_is_not_mutated():
    model = Small().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    graphamp.convert(model, (_x(),))
    assert model.training
    assert dict(model.named_modules()) == modules
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not torch.is_autocast_enabled("cpu")
    assert all(p.grad is None for p in model.parameters())


def test_torch_save_round_trip():
    model, x = Small(), _x()
    amp = graphamp.convert(model, (x,))
    buffer = io.BytesIO()
    torch.save(amp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, graphamp.AmpModule)
    assert loaded.graphamp_info == amp.graphamp_info
    assert_same_outputs(loaded(x), amp(x))


class NoGradPart(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            h = self.frozen(x)
        return self.head(h)


def test_saved_module_keeps_its_no_grad_region():
    # A re-trace on load once ran set_grad_enabled(False) instead of recording it: the region
    # vanished and the frozen layer silently got gradients.
    model, x = NoGradPart(), torch.randn(3, 4)
    amp = graphamp.convert(model, (x,))
    buffer = io.BytesIO()
    torch.save(amp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    out = loaded(x)
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert loaded.get_parameter("frozen.weight").grad is None
    assert loaded.get_parameter("head.weight").grad is not None
    torch.save(loaded, io.BytesIO())  # and saves again


def test_deepcopy():
    model, x = Small(), _x()
    amp = graphamp.convert(model, (x,))
    clone = copy.deepcopy(amp)
    assert_same_outputs(clone(x), amp(x))
    assert clone.a.weight is not model.a.weight
    # the conversion's record travels (FX's own deepcopy dropped it), and a copied inference module
    # still runs under no_grad
    assert clone.graphamp_info == amp.graphamp_info
    frozen = copy.deepcopy(graphamp.convert(model, (x,), inference=True))
    assert not frozen(x)[0].requires_grad


def test_no_runtime_autocast_even_inside_an_ambient_region():
    model, x = Small(), _x()
    amp = graphamp.convert(model, (x,))
    plain = amp(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = amp(x)
    assert_same_outputs(inside, plain)
    assert "autocast" not in amp.code


def test_converting_inside_an_ambient_region_changes_nothing():
    model, x = Small(), _x()
    outside = graphamp.convert(model, (x,))
    with torch.autocast("cpu", dtype=torch.float16):
        inside = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert_same_outputs(inside(x), outside(x))


def test_mode_switch_converts_the_other_graph():
    model = Small().eval()
    amp = graphamp.convert(model, (_x(),))
    amp.train()  # tests/test_amp_module_modes.py checks the training graph against eager
    assert amp.training and not model.training
    amp(_x())
    assert set(amp.__dict__["_graphamp_modes"]) == {(True, False)}


def test_thread_safety():
    model = Small()
    amp = graphamp.convert(model, (_x(),))
    inputs = [_x(b) for b in (1, 2, 3, 5, 7, 8)]
    expected = [amp(x) for x in inputs]
    results: dict[int, object] = {}

    def work(i):
        for _ in range(20):
            results[i] = amp(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        assert_same_outputs(results[i], want)


def test_graph_records_decisions():
    amp = graphamp.convert(Small(), (_x(),))
    linears = [n for n in amp.graph.nodes if n.target is torch.ops.aten.linear.default]
    low, region = linears
    assert low.meta["graphamp"].dtype is torch.bfloat16
    assert "lower_precision_fp" in low.meta["graphamp"].reason
    assert "disabled by a region" in region.meta["graphamp"].reason
    casts = [n for n in amp.graph.nodes if getattr(n.meta.get("graphamp"), "cast", False)]
    assert casts and all("input of" in n.meta["graphamp"].reason for n in casts)


# Config.

def test_op_override_forces_fp32():
    model, x = Small(), _x()
    amp = graphamp.convert(model, (x,), config=graphamp.Config(op_overrides={torch.ops.aten.linear.default: "fp32"}))
    h, _ = amp(x)
    assert h.dtype is torch.float32
    with torch.autocast("cpu", enabled=False):
        assert torch.equal(h, model(x)[0])


def test_op_override_forces_low_precision():
    model, x = Small(), _x()
    amp = graphamp.convert(model, (x,), config=graphamp.Config(op_overrides={"layer_norm": "lower_precision_fp"}))
    norm = next(n for n in amp.graph.nodes if n.target is torch.ops.aten.layer_norm.default)
    assert norm.meta["graphamp"].dtype is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model.a(x)
        expected = F.layer_norm(low, (8,), model.norm.weight.bfloat16(), model.norm.bias.bfloat16()) * model.scale
    assert torch.equal(amp(x)[0], expected)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.layers(x))


def _stack_reference(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.layers[0](x)
        with torch.autocast("cpu", enabled=False):
            h = model.layers[1](h.float())
        return model.norm(model.layers[2](h))


@pytest.mark.parametrize("kept", ["layers.1", "*.1"], ids=["name", "glob"])
def test_fp32_modules_by_name(kept):
    model, x = Stack(), _x()
    amp = graphamp.convert(model, (x,), config=graphamp.Config(fp32_modules=(kept,)))
    assert torch.equal(amp(x), _stack_reference(model, x))


def test_fp32_modules_by_type():
    model, x = Stack(), _x()
    amp = graphamp.convert(model, (x,), config=graphamp.Config(fp32_modules=(nn.LayerNorm,)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.layers(x)
    assert torch.equal(amp(x), F.layer_norm(h.float(), (8,), model.norm.weight, model.norm.bias))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"op_overrides": {"not_an_op": "fp32"}}, ValueError, ["not_an_op", "softmax.int"]),
        ({"op_overrides": {"linear": "fp64"}}, ValueError, ["fp64", "'fp32'"]),
        ({"op_overrides": {3: "fp32"}}, TypeError, ["op_overrides"]),
        ({"fp32_modules": (3,)}, TypeError, ["fp32_modules"]),
    ],
    ids=["unknown-op", "unknown-category", "key-type", "module-entry"],
)
def test_bad_config(kwargs, error, words):
    with pytest.raises(error) as info:
        graphamp.Config(**kwargs)
    for word in words:
        assert word in str(info.value)


class Flags(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=1.0, extra=None):
        out = self.lin(x) * scale
        return out if extra is None else out + extra["bias"]


def test_inputs_of_another_structure_or_constant_convert_again(caplog):
    x = _x()
    model = Flags()
    amp = graphamp.convert(model, (x,), {"scale": 2.0, "extra": {"bias": torch.ones(8)}})
    amp(_x(3), extra={"bias": torch.zeros(8)}, scale=2.0)  # keyword order and sizes may vary
    for kwargs in ({"scale": 3.0, "extra": {"bias": torch.ones(8)}},  # a baked-in constant changed
                   {"scale": 2.0, "extra": {"bias": torch.ones(8), "other": torch.ones(8)}},  # another structure
                   {}):
        with caplog.at_level("INFO", logger="graphamp"):
            got = amp(x, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(got, model(x, **kwargs))
    assert len(amp.__dict__["_graphamp_variants"]) == 3 and "converted Flags again" in caplog.text
    with pytest.raises(graphamp.InputStructureError, match="Way out"):
        for scale in range(10, 20):
            amp(x, scale=float(scale))


def test_the_models_containers_stay_its_own_objects():
    # Non-strict torch.export left copies of a module's list/dict/set attributes in their place;
    # code holding the originals (Lightning's self.outputs.append) then wrote where the model no
    # longer looked. Found by the Lightning integration.
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.outputs, self.table, self.seen = [], {"a": 1}, set()

        def forward(self, x):
            return self.lin(x)

    model = Holder()
    held = model.outputs, model.table, model.seen
    graphamp.convert(model, (_x(),))
    assert (model.outputs, model.table, model.seen) == held
    assert all(a is b for a, b in zip((model.outputs, model.table, model.seen), held))
