"""graphamp.explain: decisions and reasons per node, module roll-ups, numerics against fp32, HTML/JSON."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import graphamp
from graphamp.testing import zoo


def overflow_mlp() -> nn.Sequential:
    """One Linear ("2") whose output exceeds fp16's 65504; its weights still fit fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(2e5)
    assert model[2].weight.abs().max() < 65504
    return model.eval()


def test_first_inf_producer_is_the_scaled_linear():
    model, x = overflow_mlp(), torch.randn(8, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    e = graphamp.explain(model, (x,), dtype=torch.float16)
    assert e.first_nonfinite is not None
    assert (e.first_nonfinite.module, e.first_nonfinite.op) == ("2", "aten.linear.default")
    assert e.first_nonfinite.numerics.overflow > 0 and not e.ok
    assert e.ranking()[0].path == "2" and e.module("2").own_local_overflow > 0
    # downstream modules see the inf but do not make it
    assert e.module("3").overflow > 0 and e.module("3").own_local_overflow == 0
    assert "first inf/nan: node linear_1 (aten.linear.default) in module 2 (Linear)" in str(e)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_numerics_match_the_converted_module_and_the_fp32_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    e = graphamp.explain(model, (x,), dtype=torch.bfloat16)
    assert e.ok and e.first_nonfinite is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    out = e.outputs[0]
    assert out.dtype == "bf16" and out.max_abs == pytest.approx((low.float() - model(x)).abs().max().item())
    lin = e.node("linear")
    assert lin.dtype == "bf16" and "lower_precision_fp" in lin.reason and len(lin.input_casts) == 3
    assert lin.numerics.max_rel > 0 and lin.numerics.local_rel > 0 and lin.numerics.sqnr_db > 20
    assert "fp32->bf16" in lin.input_casts[0]


def test_bert_every_node_has_a_reason_rollup_sums_and_html_has_every_module(tmp_path):
    case = zoo.bert()
    model = case.model.eval()
    args, kwargs = case.inputs
    e = graphamp.explain(model, args, kwargs, dtype=torch.float16)
    assert e.nodes and all(n.reason for n in e.nodes)
    root = e.module("")
    assert root.ops == len(e.nodes) == sum(m.own_ops for m in e.modules)
    assert root.ops_low + root.ops_fp32 + root.ops_other == root.ops
    assert root.casts_to_low + root.casts_to_fp32 == e.casts
    layer = e.module("encoder.layer.0")
    children = [m for m in e.modules if m.path.startswith("encoder.layer.0.") and m.path.count(".") == 3]
    assert layer.ops == layer.own_ops + sum(c.ops for c in children)
    page = e.to_html(tmp_path / "bert.html")
    assert (tmp_path / "bert.html").read_text() == page
    for path, _ in model.named_modules():
        assert f'data-path="{path}"' in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    data = json.loads(e.to_json(tmp_path / "bert.json"))
    assert len(data["nodes"]) == len(e.nodes) and data["modules"][0]["path"] == ""


def test_html_marks_the_overflow():
    model, x = overflow_mlp(), torch.randn(8, 16)
    page = graphamp.explain(model, (x,), dtype=torch.float16).to_html()
    assert 'class="first"' in page and "First inf/nan" in page and "overflows" in page


def test_without_numerics_decisions_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    e = graphamp.explain(model, (torch.randn(2, 4),), numerics=False)
    assert not e.numerics and e.outputs == () and e.nodes[0].numerics is None
    assert e.node("linear").dtype == "bf16" and e.node("softmax").reason
    assert "first inf/nan" not in str(e)


def test_config_from_model_t5_and_explain_says_why():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    config = graphamp.Config.from_model(model, dtype=torch.float16)
    assert config.fp32_modules == ("wo", "*.wo")
    assert graphamp.Config.from_model(model, dtype="bf16").fp32_modules == ()  # not _strict: fp16 only
    kw = dict(input_ids=torch.randint(0, 32, (1, 4)), decoder_input_ids=torch.randint(0, 32, (1, 3)), use_cache=False)
    e = graphamp.explain(model, (), kw, dtype=torch.float16, config=config)
    kept = dict(e.kept_fp32)
    assert set(kept) == {"encoder.block.0.layer.1.DenseReluDense.wo", "decoder.block.0.layer.2.DenseReluDense.wo"}
    assert all("_keep_in_fp32_modules" in why for why in kept.values())
    wo = [n for n in e.nodes if n.module.endswith(".wo") and n.op == "aten.linear.default"]
    assert wo and all(n.dtype == "fp32" and n.kept_fp32_by for n in wo)


def test_grads_underflow_without_and_with_scaling():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * 1e-8  # its gradient is below fp16's smallest subnormal (6e-8)

    torch.manual_seed(0)
    model = Tiny().train()
    e = graphamp.explain(model, (torch.randn(8, 16),), dtype=torch.float16, grads=True)
    g = {r.name: r for r in e.grads}
    assert set(g) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert g["a.weight"].underflow > 0.9 and g["a.weight"].underflow_scaled < 0.05
    assert all(p.grad is None for p in model.parameters())
    assert "with GradScaler's 65536" in str(e)


def test_explain_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        graphamp.explain(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="numerics"):
        graphamp.explain(nn.Linear(2, 2), (torch.randn(1, 2),), numerics="yes")
