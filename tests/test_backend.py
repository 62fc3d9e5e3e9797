"""torch.compile(backend="graphamp"): registration, options, exactness against eager autocast, user
regions, custom Functions, graph breaks, dynamic shapes, fused fast paths, recompiles, inductor.

Exactness runs with options={"inner": "eager"} (AOTAutograd with eager graphs), where graphamp's
graph is bitwise eager autocast; inductor tests are few and small, since each compile takes seconds.
"""

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed

import graphamp
from graphamp.backend import BackendOptions, graphamp_backend, rewrite
from graphamp.policy import lstm_uses_onednn
from graphamp.spec import AmpSpec
from conftest import build_case
from helpers import _loss, assert_same_grads, assert_same_outputs, matmul_function, run_eager

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
EAGER = {"inner": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Compiled code is cached per code object; each test starts from an empty cache.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, **options):
    return torch.compile(model, backend="graphamp", options={**EAGER, **options})


def run_compiled(cm, model, args, kwargs, *, ambient=None):
    """Output and parameter grads of the compiled model; ``ambient`` wraps the call in torch.autocast."""
    model.zero_grad(set_to_none=True)
    if ambient is None:
        out = cm(*args, **kwargs)
    else:
        with torch.autocast("cpu", dtype=ambient):
            out = cm(*args, **kwargs)
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def assert_exact_compiled(cm, model, args, kwargs, dtype, *, ambient=None):
    ref, ref_grads = run_eager(model, args, kwargs, dtype, grads=True)
    out, grads = run_compiled(cm, model, args, kwargs, ambient=ambient)
    assert_same_outputs(out, ref)
    assert ref_grads, "the model produced no gradients; the check would be empty"
    assert_same_grads(grads, ref_grads)


class CountingBackend:
    """graphamp, counting the graphs dynamo hands it."""

    def __init__(self, **options):
        self.options = {**EAGER, **options}
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return graphamp_backend(gm, example_inputs, options=self.options)


# Registration: backend="graphamp" works after pip install, without importing graphamp.

def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    (ep,) = [ep for ep in eps if ep.name == "graphamp"]
    assert ep.value == "graphamp.backend:graphamp_backend"
    assert ep.load() is graphamp_backend
    assert "graphamp" in torch._dynamo.list_backends(exclude_tags=())


def test_backend_name_resolves_in_a_fresh_process_without_importing_graphamp():
    script = textwrap.dedent(
        """
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        assert "graphamp" not in sys.modules
        cm = torch.compile(model, backend="graphamp", options={"inner": "eager"})
        assert "graphamp" in sys.modules  # loaded by torch through the entry point
        x = torch.randn(3, 8)
        y = cm(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


# Options: graphamp's own, validated with errors that name the option and the accepted ones.

@pytest.mark.parametrize(
    "options, words",
    [
        ({"dtypes": torch.float16}, ["'dtypes'", "dtype, device_type, mode, config, inner"]),
        ({"freezing": True}, ["'freezing'", "torch._inductor.config"]),
        ({"inner": "tvm"}, ["'tvm'", "inductor", "eager"]),
        ({"mode": "fast"}, ["'fast'", "exact"]),
        ({"dtype": torch.int8}, ["torch.int8", "torch.bfloat16"]),
        ({"dtype": "half-ish"}, ["half-ish", "bf16"]),
        ({"device_type": "tpu"}, ["'tpu'", "cpu", "cuda"]),
        ({"config": {"softmax.int": "fp32"}}, ["graphamp.Config"]),
    ],
    ids=["typo", "inductor-option", "inner", "mode", "int-dtype", "str-dtype", "device", "config-dict"],
)
def test_bad_options_are_typed_errors_naming_the_option(options, words):
    with pytest.raises(graphamp.OptionError) as info:
        BackendOptions.parse(options)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, graphamp.GraphampError)


def test_bad_option_through_torch_compile_chains_the_typed_error():
    cm = torch.compile(nn.Linear(4, 4), backend="graphamp", options={"dtpye": torch.float16})
    with pytest.raises(BackendCompilerFailed) as info:
        cm(torch.randn(2, 4))
    assert isinstance(info.value.inner_exception, graphamp.OptionError)
    assert "'dtpye'" in str(info.value)


def test_torch_compile_mode_needs_inductor():
    with pytest.raises(graphamp.OptionError, match="max-autotune"):
        graphamp_backend(torch.fx.symbolic_trace(nn.Linear(4, 4)), [torch.randn(2, 4)], options=EAGER, mode="max-autotune")


def test_an_empty_graph_is_handed_back_as_it_is():
    # Dynamo hands over graphs of no ops (``return ()``) around graph breaks: nothing to cast.
    graph = torch.fx.Graph()
    graph.output(())
    compiled = graphamp_backend(torch.fx.GraphModule(nn.Module(), graph), [])
    assert compiled() == ()


def test_options_dtype_and_config_apply():
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1))
    x = torch.randn(4, 8)
    out = compiled(model, dtype="fp16")(x)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(out, model(x))
    torch._dynamo.reset()
    config = graphamp.Config(op_overrides={"linear": None})
    assert compiled(model, config=config)(x).dtype == torch.float32


# Exactness on real models: outputs and every parameter gradient bitwise equal to eager autocast.

MODELS = [("bert", False), ("gpt2", False), ("vit", False), ("resnet", False), ("transformer_encoder", True), ("mha", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, train", MODELS, ids=[m for m, _ in MODELS])
def test_models_bitwise_equal_eager_autocast(name, train, dtype):
    case = build_case(name, train=train)
    args, kwargs = case.inputs
    cm = compiled(case.model, dtype=dtype)
    assert_exact_compiled(cm, case.model, args, kwargs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lstm(dtype):
    # Dynamo refuses nn.LSTM unless allow_rnn is set. nn.LSTM sizes its initial state with the
    # input's dtype, which dynamo reads while tracing: inside torch.autocast it reads eager's.
    case = build_case("lstm")
    args, kwargs = case.inputs
    model = case.model
    with torch._dynamo.config.patch(allow_rnn=True):
        cm = compiled(model, dtype=dtype)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=dtype):
                expected = model(*args)
                got = cm(*args)
        assert torch.equal(got, expected)
        ref, ref_grads = run_eager(model, args, kwargs, dtype, grads=True)
        out, grads = run_compiled(cm, model, args, kwargs, ambient=dtype)
        assert out.dtype == ref.dtype
        # The LSTM's input is already low (the projection's output). Where eager's aten::lstm
        # runs native cells with grad on this machine, the graph runs the same cells: bitwise.
        # Where it runs oneDNN with grad (use_mkldnn in RNN.cpp), AOTAutograd cannot trace that
        # kernel's backward and decomposes aten.lstm into per-step cells: equal to rounding.
        if not lstm_uses_onednn(dtype, projections=False, grad_enabled=True):
            assert_same_outputs(out, ref)
            assert_same_grads(grads, ref_grads)
            return
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=2e-2, rtol=5e-2)


def test_lstm_outside_autocast_follows_eager_and_warns_where_it_cannot_be_exact():
    # nn.LSTM sizes its initial state with the input's dtype: outside torch.autocast dynamo reads
    # fp32, and the backend gives the graph the dtype eager autocast reads (backend/eager_dtypes.py).
    case = build_case("lstm")
    model, args = case.model, case.inputs[0]
    with torch._dynamo.config.patch(allow_rnn=True):
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            expected = model(*args)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", graphamp.EagerPathWarning)
            got = compiled(model)(*args)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(*args)
        if lstm_uses_onednn(torch.bfloat16, projections=False, grad_enabled=True):
            # AOTAutograd decomposes oneDNN's LSTM with grad into cells: the self-check says so.
            with pytest.warns(graphamp.EagerPathWarning, match="differ from eager torch.autocast"):
                got = compiled(model)(*args)
            assert not torch.equal(got, expected)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", graphamp.EagerPathWarning)
                got = compiled(model)(*args)
            assert torch.equal(got, expected)


def test_dynamic_shapes_recompile_once_and_stay_exact():
    case = build_case("bert")
    model = case.model
    backend = CountingBackend()
    cm = torch.compile(model, backend=backend)
    for batch, seq in [(2, 8), (3, 11), (4, 5), (5, 9)]:
        args, kwargs = case.make_inputs(batch, seq)
        assert_exact_compiled(cm, model, args, kwargs, torch.bfloat16)
    assert backend.graphs == 2  # static first, then one dynamic graph for every later size


def test_no_recompile_on_repeated_calls():
    case = build_case("transformer_encoder", train=True)
    backend = CountingBackend()
    cm = torch.compile(case.model, backend=backend)
    args, kwargs = case.inputs
    first = cm(*args, **kwargs)
    for _ in range(3):
        assert torch.equal(cm(*args, **kwargs), first)
    assert backend.graphs == 1
    with torch.no_grad():
        for _ in range(3):
            cm(*args, **kwargs)
    assert backend.graphs == 2  # dynamo guards on grad mode: one inference graph, once


# Ambient autocast: graphamp's casts are authoritative; autocast is off inside compiled code.

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.norm(F.gelu(self.a(x)))
        with torch.autocast("cpu", enabled=False):
            fp32 = self.b(h.float())  # fp32 on purpose: an ambient autocast must not lower it
        return h.softmax(-1), fp32


def test_ambient_autocast_is_not_applied_twice():
    model, x = Block(), torch.randn(4, 16)
    backend = CountingBackend()
    cm = torch.compile(model, backend=backend)
    outside, outside_grads = run_compiled(cm, model, (x,), {})
    inside, inside_grads = run_compiled(cm, model, (x,), {}, ambient=torch.bfloat16)
    assert inside[1].dtype == torch.float32
    assert_same_outputs(inside, outside)
    assert_same_grads(inside_grads, outside_grads)
    assert_exact_compiled(cm, model, (x,), {}, torch.bfloat16, ambient=torch.bfloat16)
    # Dynamo guards on the autocast state: the first call inside a region compiles once more.
    assert backend.graphs == 2
    run_compiled(cm, model, (x,), {}, ambient=torch.bfloat16)
    run_compiled(cm, model, (x,), {})
    assert backend.graphs == 2


def test_backward_inside_ambient_autocast_is_unchanged():
    model, x = Block(), torch.randn(4, 16)
    cm = compiled(model)
    _, outside = run_compiled(cm, model, (x,), {})
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss(cm(x)).backward()
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, outside)


def test_dtype_defaults_to_the_ambient_autocast_dtype():
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    cm = compiled(model)
    assert cm(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert cm(x).dtype == torch.float16


# Regions in forward, grad-mode regions, custom Functions, graph breaks.

MatMul = matmul_function(cast_inputs=torch.float32)


class Regions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = self.a(x)
            with torch.autocast("cpu", dtype=torch.float16):
                g = self.b(h)
        with torch.no_grad():
            k = self.c(x)
        y = MatMul.apply(self.d(x), self.w)
        torch._dynamo.graph_break()
        return h, g.float() + k, (y.sum(-1) + self.a(x).sum(-1)).softmax(-1)


def test_regions_custom_fwd_and_graph_breaks_match_eager():
    model, x = Regions(), torch.randn(2, 8)
    backend = CountingBackend()
    cm = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # custom_fwd reads the autocast state while dynamo traces: call inside the region.
        assert_exact_compiled(cm, model, (x,), {}, torch.bfloat16, ambient=torch.bfloat16)
    # The Function is kept whole: no warning but the check's own, that the part before the break is not checked.
    said = [w for w in caught if "graphamp" in str(w.message)]
    assert [(w.category, w.message.reason) for w in said] == [(graphamp.CheckSkippedWarning, "graph_break")]
    assert backend.graphs == 2  # each side of the graph break is converted


def test_custom_fwd_traced_outside_autocast_warns():
    model, x = Regions(), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(model)(x)
    messages = [str(w.message) for w in caught]
    assert any("torch.amp.custom_fwd" in m and "inside torch.autocast('cpu'" in m for m in messages), messages


def test_no_grad_region_is_a_grad_region_of_the_graph():
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                frozen = self.lin(x)
            return self.lin(x) + frozen

    model, x = NoGrad(), torch.randn(2, 8)
    assert_exact_compiled(compiled(model), model, (x,), {}, torch.bfloat16)


# Fused inference kernels: eval-mode TransformerEncoder and MultiheadAttention.

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_transformer_encoder_inference_runs_eager_fused_layer_under_autocast(dtype, mask):
    # Eval, no grad: eager runs each layer's fused kernel whole, autocast casting inside it (a
    # low-precision output), where the module's ordinary path gives fp32.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 7, 32)
    padded = torch.zeros(3, 7, dtype=torch.bool)
    padded[0, 5:] = True
    kwargs = {} if mask is None else {"src_key_padding_mask": padded if mask == "bool" else torch.zeros(3, 7).masked_fill(padded, float("-inf"))}
    seen = []

    def backend(gm, example_inputs):
        seen.append(rewrite(gm, example_inputs, AmpSpec("cpu", dtype, inference=True, target="aot")))
        return graphamp_backend(gm, example_inputs, options={**EAGER, "dtype": dtype})

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the self-check compares with eager's fused run: no difference to warn of
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(x, **kwargs)
    fused = [n for n in seen[0].graph.nodes if n.target is torch.ops.graphamp.encoder_layer_under_autocast.default]
    assert len(fused) == 2
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected = model(x, **kwargs)
    assert expected.dtype == dtype  # eager's fused kernel
    assert out.dtype == dtype and torch.equal(out, expected)


def test_transformer_encoder_inference_behind_inductor_keeps_eager_fused_layer():
    # AOTAutograd would trace the fused kernel without the autocast it runs under (fp32): the layer
    # is one graphamp op that inductor calls whole.
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        out = torch.compile(model, backend="graphamp")(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_transformer_encoder_with_grad_keeps_the_ordinary_path():
    # With grad and weights that require it, eager takes the ordinary path, and so does dynamo.
    case = build_case("transformer_encoder", train=False)
    (x,), _ = case.inputs
    out = compiled(case.model)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = case.model(x)
    assert torch.equal(out, expected)


def _attention_calls():
    x = torch.randn(3, 7, 32)
    padded = torch.zeros(3, 7, dtype=torch.bool)
    padded[0, 5:] = True
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    return x, {
        "plain": lambda m: m(x, x, x, need_weights=False)[0],
        "padding_mask": lambda m: m(x, x, x, key_padding_mask=padded, need_weights=False)[0],
        "weights": lambda m: m(x, x, x, key_padding_mask=padded, average_attn_weights=False),
        "attn_mask": lambda m: m(x, x, x, attn_mask=causal, need_weights=False)[0],
        "both_masks": lambda m: m(x, x, x, attn_mask=causal, key_padding_mask=padded),
        "float_mask": lambda m: m(x, x, x, attn_mask=torch.zeros(7, 7).masked_fill(causal, float("-inf")), need_weights=False)[0],
        "cross": lambda m: m(x, x[:, :5], x[:, :5], need_weights=False)[0],
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("call", list(_attention_calls()[1]))
@pytest.mark.parametrize("ambient", [True, False], ids=["inside_autocast", "outside"])
def test_multihead_attention_inference_runs_eagers_fused_attention(dtype, call, ambient):
    # Eval, no grad: eager's self-attention takes _native_multi_head_attention (bool masks only),
    # where dynamo's trace takes the ordinary path (the module turns its fast path off while traced).
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    _, calls = _attention_calls()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected = calls[call](model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.EagerPathWarning)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=ambient):
            out = calls[call](compiled(model, dtype=dtype))
    for got, want in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(expected)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # fully masked rows are NaN on both sides


def test_multihead_attention_inference_behind_inductor_runs_eagers_fused_attention():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    _, calls = _attention_calls()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = calls["padding_mask"](model)
        out = calls["padding_mask"](torch.compile(model, backend="graphamp"))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# Inductor: few and small; each compile takes seconds.

class Tiny(nn.Module):
    def __init__(self, norm: bool = True):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32) if norm else nn.Identity()

    def forward(self, x):
        return self.norm(x + self.down(F.relu(self.up(x))))


def test_inductor_is_bitwise_where_it_generates_no_reductions():
    # Matmuls run aten's kernels and elementwise code rounds as eager does, so a model without
    # normalizations or softmax is bitwise eager autocast, gradients included.
    model, x = Tiny(norm=False), torch.randn(8, 16, 32)
    cm = torch.compile(model, backend="graphamp")
    ref, ref_grads = run_eager(model, (x,), {}, torch.bfloat16, grads=True)
    out, grads = run_compiled(cm, model, (x,), {})
    assert_same_outputs(out, ref)
    assert_same_grads(grads, ref_grads)


def test_inductor_reductions_match_to_rounding():
    # Inductor generates its own fp32 layer_norm (and softmax), whose reduction order differs
    # from aten's in the last fp32 bit; emulate_precision_casts does not change that.
    model, x = Tiny(), torch.randn(8, 16, 32)
    cm = torch.compile(model, backend="graphamp")
    ref, ref_grads = run_eager(model, (x,), {}, torch.bfloat16, grads=True)
    out, grads = run_compiled(cm, model, (x,), {})
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-2, rtol=1.6e-2)


def test_inductor_inference_with_freezing():
    # Freezing makes parameters graph constants, so graphamp's weight casts fold into bf16 weights.
    model, x = Tiny(norm=False).eval(), torch.randn(8, 16, 32)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        out = torch.compile(model, backend="graphamp")(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1.6e-2)
