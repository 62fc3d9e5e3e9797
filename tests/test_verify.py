"""graphamp.verify: reports on real and fake-CUDA runs, the first divergent node, JSON, the CLI."""

import json
import sys
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


def test_an_inference_conversion_is_diagnosed_at_its_divergence_not_at_its_frozen_weights():
    # inference=True freezes weights to low-precision buffers; the lowered graph read them as bare
    # bf16, so the first Linear (weight "bf16" against eager's "fp32->bf16") was named instead.
    from graphamp.verify.check import check

    wrong = graphamp.Config(op_overrides={"layer_norm": "lower_precision_fp"})
    model, x = Net().eval(), torch.randn(4, 5, 8)
    amp = graphamp.convert(model, (x,), inference=True, config=wrong, self_check="off")
    assert amp.cast_summary()["frozen_weights"] > 0
    d = check(model, (x,), {}, dtype=torch.bfloat16, device_type="cpu", mode="exact", config=wrong, grads=False, amp=amp).divergence
    assert (d.kind, d.index, d.node) == ("dtype", 1, "layer_norm")
    assert d.graphamp_inputs == ("bf16", "fp32->bf16", "fp32->bf16") and d.eager_inputs == ("bf16", "fp32", "fp32")


def _drift(monkeypatch, key, category):
    """Simulate a CPU op list that drifted from the installed torch."""
    drifted = types.MappingProxyType({**policy_module._REGISTERED["cpu"], key: category})
    monkeypatch.setitem(policy_module._REGISTERED, "cpu", drifted)


def test_drift_that_the_node_dtype_check_cannot_see_is_caught(monkeypatch):
    # CPU layer_norm returns its input's dtype either way, so convert's node-dtype check passes;
    # its self-check finds the output differs (weights rounded to bf16), and the op signatures show the weight
    # casts eager does not make.
    _drift(monkeypatch, "layer_norm", Category.LOWER_PRECISION_FP)
    with pytest.raises(graphamp.PolicyDriftError, match=r"(?s)output differs.*module encoder\.norm"):
        graphamp.convert(Net(), (torch.randn(2, 8),))
    assert graphamp.convert(Net(), (torch.randn(2, 8),), self_check="off") is not None
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


def test_lstm_on_cuda_follows_eagers_fused_cell():
    # Eager CUDA autocast runs nn.LSTM through the fused cell kernel: its C++ composite picks it.
    # graphamp decomposes lstm with that C++ kernel too (not torch's Python decomposition, which
    # unrolls plain cells), so the fake-CUDA comparison finds the same ops, dtypes and shapes.
    case = build_case("lstm")
    args, kwargs = case.inputs
    report = graphamp.verify(case.model.eval(), args, kwargs, device_type="cuda")
    assert report.ok and report.divergence is None, report


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


# -- grads=True ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grads_are_bitwise_on_a_small_model_and_leave_grad_fields_alone(dtype):
    model, x = Net(), torch.randn(4, 5, 8)
    model.head.weight.grad = torch.ones_like(model.head.weight)
    report = graphamp.verify(model, (x,), dtype=dtype, grads=True)
    assert report.ok and report.grads_compared and report.grad_divergence is None, str(report)
    names = [g.name for g in report.grads]
    assert names == [n for n, _ in model.named_parameters()] + ["args[0]"]
    assert [g.kind for g in report.grads] == ["param"] * 6 + ["input"]
    assert all(g.bitwise_equal and g.max_abs == 0.0 and g.sqnr_db == float("inf") and g.dtype == "fp32" for g in report.grads)
    assert "7 compared (6 parameters, 1 floating inputs)" in str(report) and "all bitwise equal" in str(report)
    # autograd.grad, not backward(): the model's .grad fields are as the caller left them.
    assert torch.equal(model.head.weight.grad, torch.ones_like(model.head.weight)) and model.encoder.proj.weight.grad is None
    assert not x.requires_grad


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_grads_are_bitwise_on_bert_in_train_mode(dtype):
    case = build_case("bert", train=True)
    args, kwargs = case.inputs
    report = graphamp.verify(case.model, args, kwargs, dtype=dtype, grads=True)
    assert report.ok, str(report)
    trainable = [n for n, p in case.model.named_parameters() if p.requires_grad]
    # Integer ids and mask: no input gradients; every parameter reached by the loss is compared.
    assert {g.kind for g in report.grads} == {"param"} and len(report.grads) == len(trainable)
    assert all(g.bitwise_equal for g in report.grads)


class Fork(nn.Module):
    """One fp32 activation read by two low-precision linears: eager casts it once per consumer."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        return self.a(h) * self.b(h)


def _share_activation_casts(monkeypatch):
    """Make verify's conversions share one cast between all consumers of a value.

    The forward is unchanged, but the backward then sums the consumers' gradients in low
    precision before casting back, where eager casts each to fp32 and sums there.
    """
    verify_module = sys.modules["graphamp.verify"]  # the frontend hands the engine's build to the check
    real_convert = verify_module.build

    def convert(*args, **kwargs):
        amp = real_convert(*args, **kwargs)
        first = {}
        for node in list(amp.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten._to_copy.default:
                key = (node.args[0], node.kwargs.get("dtype"))
                if key in first:
                    node.replace_all_uses_with(first[key])
                    amp.graph.erase_node(node)
                else:
                    first[key] = node
        amp.recompile()
        return amp

    monkeypatch.setattr(verify_module, "build", convert)


def test_gradients_that_alone_differ_are_caught_and_localised(monkeypatch, tmp_path):
    _share_activation_casts(monkeypatch)
    report = graphamp.verify(Fork(), (torch.randn(4, 8),), grads=True)
    assert not report.ok
    assert report.outputs[0].bitwise_equal and report.divergence is None  # the forward is exact
    assert report.casts["graphamp"] == report.casts["eager"] - 1
    differ = {g.name for g in report.grads if not g.bitwise_equal}
    assert differ == {"norm.weight", "norm.bias", "args[0]"}, str(report)
    by_name = {g.name: g for g in report.grads}
    assert 0 < by_name["norm.weight"].max_abs and 0 < by_name["norm.weight"].sqnr_db < float("inf")
    d = report.grad_divergence
    # Walking back from the output: the linears' output gradients agree; the layer_norm output's,
    # the sum of both linears' backwards through the shared cast, is the first that differs.
    assert (d.node, d.target, d.module_path, d.module_type) == ("layer_norm", "aten.layer_norm.default", "norm", "LayerNorm")
    assert d.op == "aten.native_layer_norm.default" and d.max_abs > 0
    assert d.consumers == ("linear", "linear_1") and d.consumer_modules == ("a", "b")
    assert d.reason == "not on an autocast list"
    text = str(report)
    assert "first divergent gradient in backward order: output of node layer_norm" in text and "in module norm (LayerNorm)" in text
    assert "its gradient comes from the backward of: linear (a), linear_1 (b)" in text
    assert "param norm.weight: fp32 NOT equal" in text and "a.weight" not in text
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data["ok"] is False and data["grads_compared"] is True
    assert {g["name"]: g["bitwise_equal"] for g in data["grads"]} == {n: n not in differ for n in by_name}
    assert data["grads"][-1]["kind"] == "input" and data["grad_divergence"]["module_path"] == "norm"


def test_a_forward_divergence_shows_in_the_backward_at_the_same_node():
    wrong = graphamp.Config(op_overrides={"layer_norm": "lower_precision_fp"})
    report = graphamp.verify(Net(), (torch.randn(4, 5, 8),), dtype=torch.float16, config=wrong, grads=True)
    assert not report.ok and report.divergence.node == "layer_norm"
    assert not all(g.bitwise_equal for g in report.grads)
    d = report.grad_divergence
    # The head's gradient reaches the softmax unchanged; softmax's backward reads its (changed)
    # output, so the layer_norm output's gradient is the first to differ.
    assert (d.node, d.module_path, d.consumers) == ("layer_norm", "encoder.norm", ("softmax",))
    assert "config override" in d.reason


def test_grads_on_fake_cuda_raise_with_the_way_out():
    with pytest.raises(ValueError, match="device_type='cpu'"):
        graphamp.verify(Net(), (torch.randn(2, 8),), device_type="cuda", grads=True)
    with pytest.raises(TypeError, match="grads"):
        graphamp.verify(Net(), (torch.randn(2, 8),), grads="yes")


def test_grads_with_nothing_to_differentiate_say_so():
    report = graphamp.verify(nn.Embedding(10, 4).requires_grad_(False), (torch.tensor([1, 2]),), grads=True)
    assert report.ok and report.grads == () and "no gradient to compare" in " ".join(report.notes)


def test_cli_grads_exit_zero_when_bert_gradients_are_bitwise(tmp_path, capsys):
    build_case("bert")  # skips without transformers
    path = tmp_path / "bert.json"
    code = main(["verify", "--model", "bert", "--train", "--grads", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gradients: 39 compared (39 parameters, 0 floating inputs)" in out and "all bitwise equal" in out
    data = json.loads(path.read_text())
    assert len(data["grads"]) == 39 and all(g["bitwise_equal"] for g in data["grads"]) and data["grad_divergence"] is None


def test_cli_grads_report_a_llama_with_grouped_query_attention(capsys):
    pytest.importorskip("transformers")
    code = main(["verify", "--model", "factories:llama", "--train", "--grads"])
    out = capsys.readouterr().out
    assert "LlamaForCausalLM cpu/bf16" in out and "gradients: 21 compared (21 parameters" in out
    # The acceptance check of exact training on decoders: grouped-query attention included.
    assert code == 0 and "all bitwise equal" in out and "NOT bitwise" not in out


def test_cli_grads_exit_one_when_gradients_differ(monkeypatch, capsys):
    _share_activation_casts(monkeypatch)
    code = main(["verify", "--model", "test_verify:fork_factory", "--grads"])
    out = capsys.readouterr().out
    assert code == 1 and "in module norm (LayerNorm)" in out
    assert main(["verify", "--model", "test_verify:fork_factory"]) == 0  # the forward alone is bitwise


def fork_factory():
    return Fork(), (torch.randn(4, 8),)


def test_cli_model_factory_errors_say_the_way_out():
    with pytest.raises(ValueError, match="PYTHONPATH"):
        main(["verify", "--model", "no_such_module_here:factory"])
    with pytest.raises(ValueError, match="no callable 'nope'"):
        main(["verify", "--model", "test_verify:nope"])
    with pytest.raises(TypeError, match=r"\(model, args\[, kwargs\]\)"):
        main(["verify", "--model", "test_verify:Net"])
