"""graphamp.verify: reports on real and fake-CUDA runs, the first divergent node, JSON, the CLI."""

import json
import types

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import graphamp
from conftest import build_case
from graphamp import policy as policy_module
from graphamp.cli.main import main
from graphamp.policy import Category
from graphamp.verify import OpSignature, first_divergence, op_signatures

CONFIGS = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cpu", torch.float16, id="cpu-fp16"),
    pytest.param("cuda", torch.float16, id="cuda-fp16-fake"),
]


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.proj(x)).softmax(-1)


class Net(nn.Module):
    """A LayerNorm in a named submodule, followed by more ops, so the divergence is not the last op."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        with torch.no_grad():  # weights that are not exactly representable in fp16, so values differ too
            self.encoder.norm.weight.uniform_(0.5, 1.5)
            self.encoder.norm.bias.uniform_(-0.5, 0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("device_type, dtype", CONFIGS)
def test_converted_model_is_equivalent(device_type, dtype):
    model, x = Net(), torch.randn(4, 5, 8)
    report = graphamp.verify(model, (x,), dtype=dtype, device_type=device_type)
    assert report.ok, str(report)
    assert report.divergence is None and report.structure_differences == 0
    assert report.ops["matched"] == report.ops["graphamp"] == report.ops["eager"] > 0
    assert report.casts["graphamp"] > 0 and report.casts["eager"] > 0
    assert report.values_compared is (device_type == "cpu")
    (out,) = report.outputs
    assert out.dtype_match and out.dtype == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    if device_type == "cpu":
        assert out.bitwise_equal is True and out.max_abs_error == 0.0 and out.sqnr_db == float("inf")
    else:
        assert out.bitwise_equal is None and "values not compared" in " ".join(report.notes)


@pytest.mark.parametrize("device_type, dtype", CONFIGS)
def test_wrong_policy_fails_and_names_the_first_divergent_node(device_type, dtype):
    wrong = graphamp.Config(op_overrides={"layer_norm": "lower_precision_fp"})
    report = graphamp.verify(Net(), (torch.randn(4, 5, 8),), dtype=dtype, device_type=device_type, config=wrong)
    assert not report.ok
    d = report.divergence
    assert d.kind == "dtype" and d.index == 1  # the Linear before it matches
    assert (d.node, d.target) == ("layer_norm", "aten.layer_norm.default")
    assert (d.module_path, d.module_type) == ("encoder.norm", "LayerNorm")
    assert d.graphamp_op == d.eager_op == "aten.native_layer_norm.default"
    low = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    # graphamp (wrongly) casts weight and bias down; eager keeps them fp32, and on CUDA casts x up.
    assert d.graphamp_inputs == (low, f"fp32->{low}", f"fp32->{low}")
    assert d.eager_inputs == ((low, "fp32", "fp32") if device_type == "cpu" else (f"{low}->fp32", "fp32", "fp32"))
    assert "config override" in d.reason
    assert "first divergence (dtype)" in str(report) and "encoder.norm (LayerNorm)" in str(report)
    if device_type == "cpu":
        assert report.outputs[0].bitwise_equal is False
        assert 0 < report.outputs[0].max_abs_error and report.outputs[0].sqnr_db < float("inf")


def _drift(monkeypatch, key, category):
    """Simulate a CPU op list that drifted from the installed torch."""
    drifted = types.MappingProxyType({**policy_module._REGISTERED["cpu"], key: category})
    monkeypatch.setitem(policy_module._REGISTERED, "cpu", drifted)


def test_drift_that_convert_cannot_see_is_caught(monkeypatch):
    # CPU layer_norm returns its input's dtype either way, so convert's node-dtype check passes;
    # the op signatures show the weight casts eager does not make.
    _drift(monkeypatch, "layer_norm", Category.LOWER_PRECISION_FP)
    graphamp.convert(Net(), (torch.randn(2, 8),))
    report = graphamp.verify(Net(), (torch.randn(2, 8),))
    assert not report.ok and report.divergence.module_path == "encoder.norm"


def test_drift_that_convert_raises_on_is_reported(monkeypatch):
    _drift(monkeypatch, "softmax.int", Category.FP32)
    with pytest.raises(graphamp.PolicyDriftError):
        graphamp.convert(Net(), (torch.randn(2, 8),))
    report = graphamp.verify(Net(), (torch.randn(2, 8),))
    assert not report.ok
    assert (report.divergence.node, report.divergence.module_path) == ("softmax", "encoder")
    assert report.divergence.graphamp_inputs == ("bf16->fp32",) and report.divergence.eager_inputs == ("bf16",)
    assert any("PolicyDriftError" in n for n in report.notes)


def test_output_metrics_when_values_differ():
    calls = [0]

    class Stateful(nn.Module):
        """Reads Python state: the captured graph keeps the value seen at conversion."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            calls[0] += 1
            return self.lin(x) * (1.0 + calls[0] / 8)

    report = graphamp.verify(Stateful(), (torch.randn(3, 4),))
    (out,) = report.outputs
    assert not report.ok and out.dtype_match and out.bitwise_equal is False
    assert out.max_abs_error > 0 and 0 < out.max_rel_error < 1 and 0 < out.sqnr_db < 60
    assert "NOT equal" in str(report)


def test_report_serializes_to_json(tmp_path):
    path = tmp_path / "report.json"
    report = graphamp.verify(Net(), (torch.randn(2, 8),), dtype="fp16")
    text = report.to_json(path)
    data = json.loads(path.read_text())
    assert data == json.loads(text)
    assert data["ok"] is True and data["dtype"] == "fp16" and data["device_type"] == "cpu"
    assert data["outputs"][0]["sqnr_db"] == "inf"  # non-finite floats as strings: strict JSON
    assert data["ops"]["matched"] == report.ops["matched"] and data["divergence"] is None


def test_multiple_outputs_keep_their_pytree_paths():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return {"low": h, "summed": h.float().sum(-1), "ids": x.argmax(-1)}

    report = graphamp.verify(Two(), (torch.randn(3, 4),))
    assert report.ok, str(report)
    paths = {o.path: o for o in report.outputs}
    assert set(paths) == {"['low']", "['summed']", "['ids']"}
    assert paths["['ids']"].dtype == "torch.int64" and paths["['ids']"].bitwise_equal


def test_frozen_weights_go_through_the_weight_cache_and_still_match():
    model = Net().requires_grad_(False)
    x = torch.randn(2, 8)
    report = graphamp.verify(model, (x,))
    assert report.ok, str(report)
    assert report.casts["graphamp"] >= report.ops["graphamp"]  # every weight cast shows on a cold call


def test_model_inputs_and_random_state_are_left_alone():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train(), torch.randn(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    for device_type in ("cpu", "cuda"):
        report = graphamp.verify(model, (x,), device_type=device_type)
        assert report.ok, str(report)  # dropout draws the same mask on both sides
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        graphamp.verify(lambda x: x, (torch.randn(2),))
    with pytest.raises(ValueError, match="device_type"):
        graphamp.verify(nn.Linear(2, 2), (torch.randn(2, 2),), device_type="tpu")
    with pytest.raises(ValueError, match="mode"):
        graphamp.verify(nn.Linear(2, 2), (torch.randn(2, 2),), mode="fast")


def test_signature_histories_are_modulo_exact_round_trips():
    def f(x):
        low = x.to(torch.bfloat16)
        round_trip = low.float().to(torch.bfloat16)  # exact: counts as no cast
        lossy = x.to(torch.bfloat16).float()  # rounds: kept
        return round_trip @ low.t(), lossy.exp()

    sigs = op_signatures(make_fx(f)(torch.randn(2, 2)))
    assert [(s.op, s.inputs) for s in sigs] == [
        ("aten.mm.default", ("fp32->bf16", "fp32->bf16")),
        ("aten.exp.default", ("fp32->bf16->fp32",)),
    ]


def test_alignment_reports_ops_present_on_one_side_only():
    def s(op):
        return OpSignature(op, ("bf16",), ("bf16",), None)

    assert first_divergence([s("mm"), s("exp")], [s("mm"), s("exp")]) == (2, None)
    assert first_divergence([s("mm"), s("cat"), s("exp")], [s("mm"), s("exp")]) == (2, (1, 1))


def test_a_model_graphamp_cannot_reproduce_on_cuda_is_reported():
    # Eager CUDA autocast runs nn.LSTM through the fused cell kernel; the captured graph unrolls it.
    case = build_case("lstm")
    args, kwargs = case.inputs
    report = graphamp.verify(case.model.eval(), args, kwargs, device_type="cuda")
    assert not report.ok and report.divergence.kind == "structure"
    assert report.divergence.module_path == "lstm" and "aten._thnn_fused_lstm_cell.default" in report.divergence.eager_only


@pytest.mark.parametrize("dtype, device_type", [("bf16", "cpu"), ("fp16", "cpu"), ("fp16", "cuda")])
def test_cli_verifies_a_transformers_model(tmp_path, capsys, dtype, device_type):
    build_case("bert")  # skips without transformers
    path = tmp_path / "bert.json"
    code = main(["verify", "--model", "bert", "--dtype", dtype, "--device-type", device_type, "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"BertModel {device_type}/{dtype} mode=exact: OK" in out
    data = json.loads(path.read_text())
    assert data["ok"] is True and data["divergence"] is None and data["values_compared"] is (device_type == "cpu")
    assert [o["path"] for o in data["outputs"]] == ["['last_hidden_state']", "['pooler_output']"]


def net_factory():
    return Net(), (torch.randn(2, 8),)


def test_cli_exits_nonzero_on_divergence(monkeypatch, tmp_path, capsys):
    _drift(monkeypatch, "softmax.int", Category.FP32)
    path = tmp_path / "r.json"
    code = main(["verify", "--model", "test_verify:net_factory", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 1 and "DIVERGES" in out and "in module encoder (Encoder)" in out
    assert json.loads(path.read_text())["divergence"]["node"] == "softmax"
