"""torch.compile(backend="graphamp", options={"inner": "eager"}) is bitwise eager autocast where
dynamo's graph alone would not be: attention that eager runs with grouped key/value heads, a
weight that autocast's cache casts once for two uses, nn.LSTM on the kernel eager picks here, and
(without grad) ops AOTAutograd would decompose.

Every check compares with eager autocast on the machine the test runs on.
"""

import contextlib
import dis
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed

import factories
import graphamp
import graphamp.backend
import graphamp.backend.break_calls
import graphamp.backend.handover
import graphamp.backend.observe as observe
from graphamp.errors import EagerPathWarning, GraphBreakError, PolicyDriftError
from graphamp.backend.observe import frame_arguments
from graphamp.policy import lstm_uses_onednn
from helpers import _loss, assert_same_grads, assert_same_outputs, run_eager

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, dtype):
    return torch.compile(model, backend="graphamp", options={"inner": "eager", "dtype": dtype})


def run_compiled(cm, model, args, kwargs):
    model.zero_grad(set_to_none=True)
    out = cm(*args, **kwargs)
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def assert_exact_compiled(model, args, kwargs, dtype):
    ref, ref_grads = run_eager(model, args, kwargs, dtype, grads=True)
    out, grads = run_compiled(compiled(model, dtype), model, args, kwargs)
    assert_same_outputs(out, ref)
    assert ref_grads, "the model produced no gradients; the check would be empty"
    assert_same_grads(grads, ref_grads)


def tiny_llama(kv_heads: int):
    pytest.importorskip("transformers")
    model, _, kwargs = factories.llama(kv_heads, hidden=32, layers=1, vocab=64, seq=8)
    return model, kwargs


# Attention: transformers repeats grouped heads when compiled and groups them in SDPA in eager.

@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_query_llama_is_bitwise_forward_and_gradients(dtype):
    model, kwargs = tiny_llama(kv_heads=2)
    assert_exact_compiled(model, (), kwargs, dtype)


def test_the_eager_run_happens_only_for_repeated_heads(monkeypatch):
    calls = []
    real = observe.eager_frame_sdpa_calls

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(observe, "eager_frame_sdpa_calls", counting)
    model, kwargs = tiny_llama(kv_heads=4)  # as many key/value heads as query heads: nothing repeated
    compiled(model, torch.bfloat16)(**kwargs)
    assert calls == []
    torch._dynamo.reset()
    model, kwargs = tiny_llama(kv_heads=2)
    compiled(model, torch.bfloat16)(**kwargs)
    assert calls == [1]


def test_the_eager_run_leaves_no_trace():
    model, kwargs = tiny_llama(kv_heads=2)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    compiled(model, torch.bfloat16)(**kwargs)  # eval mode: the call itself draws no random numbers
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert not model._forward_hooks and not model._forward_pre_hooks


class RepeatedHeads(nn.Module):
    """Attention that repeats its key/value heads in eager too: the traced program is eager's."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 8).transpose(1, 2).split(4, dim=-1)
        k = k[:, :, None].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4)
        v = v[:, :, None].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_that_repeats_heads_in_eager_keeps_them(dtype):
    torch.manual_seed(0)
    assert_exact_compiled(RepeatedHeads(), (torch.randn(2, 5, 16),), {}, dtype)


class GroupsWhenEager(nn.Module):
    """transformers' construct by hand: grouped heads in eager, repeated ones when compiled."""

    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)
        self.graph_break = graph_break

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 8).transpose(1, 2).split(4, dim=-1)
        if self.graph_break:
            torch._dynamo.graph_break()  # the attention lands in the graph of a resume function
        if not torch.compiler.is_compiling():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k = k[:, :, None].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4)
        v = v[:, :, None].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("graph_break", [False, True], ids=["one_graph", "graph_break"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_heads_in_eager_are_followed_in_any_graph(dtype, graph_break):
    torch.manual_seed(0)
    assert_exact_compiled(GroupsWhenEager(graph_break), (torch.randn(2, 5, 16),), {}, dtype)


def test_frame_arguments_rebuild_the_call():
    def f(a, b=2, *rest, k, **more):
        pass

    f_locals = {"a": 1, "b": 2, "rest": (3,), "k": 4, "more": {"m": 5}}
    assert frame_arguments(f.__code__, f_locals) == ((1, 2, 3), {"k": 4, "m": 5})


# Weights: autocast's cache casts a weight that requires grad once per region, for all its uses.

class SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return F.linear(F.linear(x, self.w, self.b).relu(), self.w, self.b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_used_twice_is_cast_once_as_autocast_caches_it(dtype):
    torch.manual_seed(0)
    assert_exact_compiled(SharedWeight(), (torch.randn(4, 16),), {}, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_frozen_weight_used_twice_is_cast_twice_as_autocast_does(dtype):
    # Autocast caches only leaves that require grad; the input's gradient tells the casts apart.
    torch.manual_seed(0)
    model = SharedWeight()
    model.w.requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    _loss(ref).backward()
    ref_grad, x.grad = x.grad, None
    out = compiled(model, dtype)(x)
    _loss(out).backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, ref_grad)


# Code that reads a tensor's dtype: dynamo, tracing outside torch.autocast, sees the fp32 program.

class ReadsDtype(nn.Module):
    """RMSNorm as transformers writes it, after a projection autocast runs in low precision."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = self.proj(x)
        input_dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(input_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_code_reading_dtypes_outside_autocast_follows_eagers_dtypes(dtype):
    # Dynamo traced h.to(input_dtype) as h.to(torch.float32); the backend gives it eager's dtype.
    torch.manual_seed(0)
    model, x = ReadsDtype(), torch.randn(4, 16)
    ref, ref_grads = run_eager(model, (x,), {}, dtype, grads=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        out, grads = run_compiled(compiled(model, dtype), model, (x,), {})
    assert_same_outputs(out, ref)
    assert_same_grads(grads, ref_grads)


class BranchesOnDtype(nn.Module):
    """Code that runs other calls when its input is low precision: no graph call can follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        if h.dtype != torch.float32:
            h = h.to(torch.float32).softmax(-1).to(h.dtype)
        return h * 2


def test_code_taking_another_path_under_autocast_warns_with_the_way_out():
    torch.manual_seed(0)
    model, x = BranchesOnDtype(), torch.randn(4, 16)
    with pytest.warns(EagerPathWarning, match=r"BranchesOnDtype.forward.*another path.*torch.autocast\('cpu', dtype=torch.bfloat16\)"):
        out = compiled(model, torch.bfloat16)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert not torch.equal(out, ref)  # what the warning is about: the fp32 program's values


@pytest.mark.parametrize("dtype", DTYPES)
def test_code_reading_dtypes_inside_autocast_is_bitwise_without_a_warning(dtype):
    torch.manual_seed(0)
    model, x = ReadsDtype(), torch.randn(4, 16)
    ref, ref_grads = run_eager(model, (x,), {}, dtype, grads=True)
    cm = compiled(model, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        with torch.autocast("cpu", dtype=dtype):
            out = cm(x)
    _loss(out).backward()
    assert_same_outputs(out, ref)
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, ref_grads)


def test_code_not_reading_dtypes_does_not_warn():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        compiled(SharedWeight(), torch.bfloat16)(torch.randn(4, 16))


class MasksWithDtypeMin(nn.Module):
    """DeBERTa's masking: the fill value comes from the scores' dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = self.proj(x)
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_value_from_the_dtype_outside_autocast_follows_eager(dtype):
    # Dynamo traced torch.finfo(scores.dtype).min as fp32's -3.4e38; eager autocast fills the low dtype's.
    torch.manual_seed(0)
    model, x, mask = MasksWithDtypeMin(), torch.randn(2, 8), torch.rand(2, 8) > 0.5
    ref, ref_grads = run_eager(model, (x, mask), {}, dtype, grads=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        out, grads = run_compiled(compiled(model, dtype), model, (x, mask), {})
    assert_same_outputs(out, ref)
    assert_same_grads(grads, ref_grads)


def test_fill_value_beyond_the_low_dtype_is_a_typed_error_with_the_way_out(monkeypatch):
    # Where the frame cannot be observed, the fill value stays fp32's, and the check catches it.
    monkeypatch.setattr(graphamp.backend, "compiled_frame", lambda: None)
    model, x, mask = MasksWithDtypeMin(), torch.randn(2, 8), torch.rand(2, 8) > 0.5
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(model, torch.bfloat16)(x, mask)
    assert isinstance(info.value.inner_exception, PolicyDriftError)
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in str(info.value.inner_exception)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_value_from_the_dtype_inside_autocast_is_bitwise(dtype):
    torch.manual_seed(0)
    model, x, mask = MasksWithDtypeMin(), torch.randn(2, 8), torch.rand(2, 8) > 0.5
    ref, ref_grads = run_eager(model, (x, mask), {}, dtype, grads=True)
    with torch.autocast("cpu", dtype=dtype):
        out = compiled(model, dtype)(x, mask)
    _loss(out).backward()
    assert_same_outputs(out, ref)
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, ref_grads)


# nn.LSTM: the graph takes the kernel eager's aten::lstm picks on this machine.

class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.lstm(self.proj(x))[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lstm_inference_takes_eagers_kernel_on_this_machine(dtype):
    torch.manual_seed(0)
    model, x = LSTMModel(), torch.randn(2, 5, 8)
    with torch._dynamo.config.patch(allow_rnn=True), torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected = model(x)
        got = compiled(model, dtype)(x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


class Upsampler(nn.Module):
    """Gemma3n's vision tower (timm's MobileNetV5 fusion adapter) resizes its fp32 features bilinearly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return F.interpolate(self.conv(x).float(), size=(11, 11), mode="bilinear")


@pytest.mark.parametrize("outside", [False, True], ids=["inside-autocast", "outside-autocast"])
def test_inference_runs_the_rewritten_graph_itself(outside):
    # AOTAutograd decomposes upsample_bilinear2d into index arithmetic, 1 ulp off eager's kernel
    # (torch.compile's own aot_eager differs below): without grad inner="eager" needs no
    # AOTAutograd and runs graphamp's graph, whose ATen ops are eager's.
    torch.manual_seed(0)
    model, x = Upsampler().eval(), torch.randn(2, 3, 10, 10)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        aot = torch.compile(model, backend="aot_eager")(x)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=not outside):
        got = compiled(model, torch.bfloat16)(x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    if torch.equal(aot, expected):  # the decomposition's rounding depends on the CPU's kernels
        pytest.skip("exact, but AOTAutograd's decomposition matches eager's kernel on this CPU: nothing to tell apart here")


def test_lstm_kernel_question_is_eagers():
    # aten/src/ATen/native/RNN.cpp, use_mkldnn(input, params, hx): oneDNN runs fp16 only without
    # grad and where mkldnn_fp16_device_check() holds; bf16 where mkldnn_bf16_device_check() holds.
    fp16 = bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert lstm_uses_onednn(torch.float16, projections=False, grad_enabled=False) == fp16
    assert not lstm_uses_onednn(torch.float16, projections=False, grad_enabled=True)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not lstm_uses_onednn(torch.float32, projections=False, grad_enabled=False)


class BiasCache(nn.Module):
    """Fills a Python dict on its first eval call, as timm's LeViT and EfficientFormer do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(8))
        self.attention_bias_cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.proj(x) + self.bias
        key = str(x.device)
        if key not in self.attention_bias_cache:
            self.attention_bias_cache[key] = self.bias * 2
        return self.proj(x) + self.attention_bias_cache[key]


def test_a_python_cache_filled_by_the_models_code_survives_compile_time_probes() -> None:
    # The backend runs the frame eagerly at compile time (fp32-trace and attention checks); a cache
    # it left filled made dynamo's guards fail on the frame that created them.
    torch._dynamo.reset()
    model, x = BiasCache().eval(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="graphamp", options={"inner": "eager"})
    with torch.no_grad():
        out = compiled(x)
    model.attention_bias_cache.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


# The backend's own check: where dynamo's graph holds the whole frame, it is compared with the
# frame's eager autocast run on the call being compiled.

class ProgramWhenCompiled(nn.Module):
    """Code that computes something else when traced, as transformers' mask utilities do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        if torch.compiler.is_compiling():
            h = h * 2
        return h.softmax(-1)


@pytest.mark.parametrize("ambient", [False, True], ids=["outside", "inside"])
def test_a_graph_other_than_eagers_program_warns(ambient):
    model, x = ProgramWhenCompiled(), torch.randn(2, 8)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if ambient else contextlib.nullcontext()
    with region, pytest.warns(EagerPathWarning, match=r"ProgramWhenCompiled.forward: .*1 of the tensors it returns differ from eager torch.autocast"):
        compiled(model, torch.bfloat16)(x)


def test_the_check_can_be_turned_off():
    model, x = ProgramWhenCompiled(), torch.randn(2, 8)
    cm = torch.compile(model, backend="graphamp", options={"inner": "eager", "self_check": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        cm(x)


def test_a_graph_that_draws_random_numbers_is_not_compared():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        compiled(model, torch.bfloat16)(torch.randn(2, 8))


class BreaksTheGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h @ h.T)  # after the break: a graph of its own, which graphamp rewrites


@torch.compiler.disable
def _matmul_dynamo_skips(x):
    return x @ x.T  # run eagerly at the break: without autocast, outside torch.autocast


class BreaksAtASkippedMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        g = _matmul_dynamo_skips(x)
        return self.b(g + h)


class BreaksAtAnItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        scale = h.sum().item()  # the instruction dynamo runs eagerly: no call autocast casts
        return self.b(h * scale)


@torch.compiler.disable
def _noise_dynamo_skips(h):
    return h + torch.rand_like(h)


class BreaksAtARandomDraw(BreaksAtAnItem):
    def forward(self, x):
        h = _noise_dynamo_skips(self.a(x))  # replayed on the same random state: equal
        return self.b(h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [BreaksTheGraph, BreaksAtAnItem, BreaksAtARandomDraw])
def test_a_break_whose_instruction_autocast_leaves_alone_is_bitwise_and_unsaid(cls, dtype):
    model, x = cls(), torch.randn(8, 8)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerPathWarning)
        out = compiled(model, dtype)(x)  # outside torch.autocast
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    assert torch.equal(out, ref) and out.dtype == ref.dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_break_at_a_call_autocast_casts_names_it(dtype):
    model, x = BreaksAtASkippedMatmul(), torch.randn(8, 8)
    with pytest.warns(EagerPathWarning) as said:
        out = compiled(model, dtype)(x)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    assert not torch.equal(out, ref)  # the warning is about a real difference
    messages = [str(w.message) for w in said if w.category is EagerPathWarning]
    # Named: the module, the break's line and dynamo's reason, the call and its line, then the way out.
    line = BreaksAtASkippedMatmul.forward.__code__.co_firstlineno + 2
    call = next(i for i, text in enumerate(open(__file__), 1) if "return x @ x.T  # run eagerly at the break" in text)
    assert len(messages) == 1, messages
    assert re.search(
        rf"dynamo broke BreaksAtASkippedMatmul.forward into several graphs at {re.escape(__file__)}:{line} in forward \(.*disable.*\)"
        rf".*matmul on {re.escape(__file__)}:{call} gives torch.float32 where eager autocast gives {dtype}"
        rf".*torch.autocast\('cpu', dtype={dtype}\)", messages[0], re.S,
    ), messages[0]
    torch._dynamo.reset()
    assert_bitwise_inside_autocast(model, x, dtype)


def test_a_break_instruction_that_cannot_be_observed_is_said(monkeypatch):
    monkeypatch.setattr(graphamp.backend.break_calls, "break_call_differences", lambda *a, **k: None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compiled(BreaksAtASkippedMatmul(), torch.bfloat16)(torch.randn(8, 8))
    assert not [w for w in said if w.category is EagerPathWarning]
    reasons = [getattr(w.message, "reason", None) for w in said if w.category is graphamp.CheckSkippedWarning]
    assert "break_instruction" in reasons, [str(w.message) for w in said]


class RotaryThenBreak(nn.Module):
    """Query and key through an fp32 rotary-like scale (fp32 under autocast too), value straight
    from a linear (bf16 under autocast), then a graph break before the attention: eager autocast
    casts all three to one dtype; dynamo traces the attention after the break without autocast."""

    def __init__(self, rotary: bool = True) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("cos", torch.linspace(0.5, 1.0, 16))
        self.rotary = rotary

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.rotary:
            q, k = q * self.cos, k * self.cos
        torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_hand_over_the_code_after_a_break_cannot_take_raises_typed(dtype):
    model, x = RotaryThenBreak(), torch.randn(2, 4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerPathWarning)
        with pytest.raises(BackendCompilerFailed) as raised:
            compiled(model, dtype)(x)
    error = raised.value.inner_exception
    assert isinstance(error, GraphBreakError), repr(error)
    line = RotaryThenBreak.forward.__code__.co_firstlineno + 4
    message = str(error)
    assert f"RotaryThenBreak.forward into several graphs at {__file__}:{line} in forward" in message, message
    assert "Expected query, key, and value to have the same dtype" in message, message
    assert f"torch.autocast('cpu', dtype={dtype})" in message, message
    # The way out it names works, bitwise.
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=dtype):
        warnings.simplefilter("error", EagerPathWarning)
        out = compiled(model, dtype)(x)
        ref = model(x)
    assert torch.equal(out, ref) and out.dtype == ref.dtype


def test_a_hand_over_the_code_after_a_break_takes_is_checked_and_runs(monkeypatch):
    # Value, query and key all bf16 across the break: the attention after it runs as eager's.
    runs = []
    real = graphamp.backend.handover.handover_error
    monkeypatch.setattr(graphamp.backend.handover, "handover_error", lambda *a, **k: runs.append(a[1]) or real(*a, **k))
    model, x = RotaryThenBreak(rotary=False), torch.randn(2, 4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerPathWarning)
        out = compiled(model, torch.bfloat16)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert runs == [(__file__, RotaryThenBreak.forward.__code__.co_firstlineno + 4)]
    assert torch.equal(out, ref) and out.dtype == ref.dtype


def graph_break_error(model, x, dtype):
    """The GraphBreakError the backend raises compiling ``model`` on ``x`` without grad (fails otherwise)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", EagerPathWarning)
        with pytest.raises(BackendCompilerFailed) as raised:
            compiled(model, dtype)(x)
    error = raised.value.inner_exception
    assert isinstance(error, GraphBreakError), repr(error)
    return error


def assert_bitwise_inside_autocast(model, x, dtype):
    """The way out: the compiled model called inside torch.autocast is bitwise to eager autocast."""
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        warnings.simplefilter("ignore", EagerPathWarning)
        out = compiled(model, dtype)(x)
        ref = model(x)
    assert torch.equal(out, ref) and out.dtype == ref.dtype


class LinearBeforeTheFailingCall(nn.Module):
    """After the break, a linear on the bf16 hand-over that fake propagation takes and a real run
    without autocast refuses (graphamp's rewrite casts it), then the call dynamo's trace refuses
    (transformers' Nemotron ASR streaming encoder: a feed-forward, then an attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin1(x)
        q = x * 2
        torch._dynamo.graph_break()
        g = self.lin2(h)
        return q @ h.transpose(-1, -2), g


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_hand_over_run_goes_past_a_call_only_the_real_run_refuses(dtype):
    model, x = LinearBeforeTheFailingCall().eval(), torch.randn(2, 4, 16)
    error = graph_break_error(model, x, dtype)
    assert "expected scalar type" in str(error) or "same dtype" in str(error), str(error)


class ConvAfterABreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):
        x = x * 2
        torch._dynamo.graph_break()
        return self.conv(x)  # traced without autocast: a bf16 input and an fp32 bias fail


class ConvAfterABreakBelow(ConvAfterABreak):
    """transformers' Mimi: the break is in F.pad, below a call; the conv follows its return."""

    def forward(self, x):
        x = _breaks(x * 2)
        return self.conv(x)


class ConvLayers(nn.Module):
    """transformers' Mimi: a loop over layers that break; each layer's graph returns bf16 to the loop
    (dynamo traced fp32), which calls the next layer with it."""

    def __init__(self, layer: type[nn.Module] = ConvAfterABreak) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("layer", [ConvAfterABreak, ConvAfterABreakBelow])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_frame_called_with_what_an_earlier_graph_returned_raises_typed(dtype, layer):
    model, x = ConvLayers(layer).eval(), torch.randn(2, 4, 8)
    error = graph_break_error(model, x, dtype)
    message = str(error)
    assert f"dynamo broke {layer.__name__}.forward into several graphs" in message, message
    assert f"(argument 'x' in {dtype})" in message and "bias type (float)" in message, message
    assert_bitwise_inside_autocast(model, x, dtype)


def _breaks(x):
    torch._dynamo.graph_break()
    return x


class ProjectThenBreakBelow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.lin = nn.Conv2d(4, 4, 1), nn.Linear(8, 8)

    def forward(self, features):
        y = self.proj(features)  # traced as a new frame without autocast: bf16 features, fp32 bias
        return self.lin(_breaks(y))


class BackboneThenDecoder(nn.Module):
    """transformers' OneFormer: the pixel decoder, called with the backbone's features, breaks in a
    helper below it; dynamo ends the outer graph before the call (its bf16 features handed over) and
    traces the decoder as a new frame from its first line, projections included."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.decoder = nn.Conv2d(3, 4, 1), ProjectThenBreakBelow()

    def forward(self, x):
        return self.decoder(self.backbone(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_break_below_a_call_hands_over_before_the_call(dtype):
    model, x = BackboneThenDecoder().eval(), torch.randn(2, 3, 8, 8)
    error = graph_break_error(model, x, dtype)
    message = str(error)
    assert "dynamo broke BackboneThenDecoder.forward into several graphs" in message, message
    assert "so its graph ends before the call on" in message and "bias type (float)" in message, message
    assert_bitwise_inside_autocast(model, x, dtype)


class AttendAfterItsOwnBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        y = _breaks(self.lin(h.float()))  # its graph runs the linear in bf16 and hands that over
        return F.scaled_dot_product_attention(h[None], y[None], y[None])


class BackboneThenCalleeThatBreaks(nn.Module):
    """The callee's own break hands over its graph's bf16, so its attention after the break meets one
    dtype: the outer frame's check answers only up to that break (the callee's graph checks the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.callee = nn.Linear(8, 8), AttendAfterItsOwnBreak()

    def forward(self, x):
        return self.callee(self.backbone(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_break_below_a_call_is_checked_up_to_where_the_callee_breaks(dtype):
    model, x = BackboneThenCalleeThatBreaks().eval(), torch.randn(4, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", EagerPathWarning)
        out = compiled(model, dtype)(x)
        with torch.autocast("cpu", dtype=dtype):
            ref = model(x)
    assert torch.equal(out, ref) and out.dtype == ref.dtype == dtype


_SEEN = []  # the frame's arguments are copied for the run: a global sees what it did


def _mixes_after_the_line(x):
    y = torch.mm(x, x)  # under autocast: bf16
    _SEEN.append(torch.is_autocast_enabled("cpu"))  # the line: autocast off from here
    return torch.bmm(y[None], x[None])  # fake propagation refuses a bf16 and an fp32 batch


def _fails_only_when_run_after_the_line(x):
    y = torch.mm(x, x)
    _SEEN.append(torch.is_autocast_enabled("cpu"))
    return torch.mm(y, x)  # fake propagation passes it (a later graph would cast it): not dynamo's error


def _promotes_after_the_line(x):
    y = torch.mm(x, x)
    _SEEN.append(torch.is_autocast_enabled("cpu"))
    return y + x


@pytest.mark.parametrize("fn, fails", [
    (_mixes_after_the_line, True), (_fails_only_when_run_after_the_line, False), (_promotes_after_the_line, False),
])
def test_handover_run_switches_autocast_off_at_the_line_and_restores_the_process(fn, fails):
    site = (__file__, fn.__code__.co_firstlineno + 2)
    _SEEN.clear()
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), sys.gettrace())
    error = graphamp.backend.handover.handover_error(observe.Frame(fn, (torch.randn(4, 4),), {}), site, device_type="cpu", dtype=torch.bfloat16)
    assert _SEEN == [False]
    assert (isinstance(error, RuntimeError) and "bfloat16" in str(error).lower()) if fails else error is None, error
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), sys.gettrace()) == before


def _two_calls_on_the_line(x):
    _SEEN.append(torch.is_autocast_enabled("cpu"))
    return torch.bmm(torch.mm(x, x)[None], x[None])  # the break at bmm: mm is in the graph, under autocast


def _outer_call_columns(fn, line):
    calls = [i.positions for i in dis.get_instructions(fn) if i.opname.startswith("CALL") and i.positions.lineno == line]
    widest = max(calls, key=lambda p: p.end_col_offset - p.col_offset)
    return widest.col_offset, widest.end_col_offset


@pytest.mark.parametrize("at_the_instruction", [True, False])
def test_handover_run_switches_at_the_instruction_dynamo_broke_at(at_the_instruction):
    line = _two_calls_on_the_line.__code__.co_firstlineno + 2
    columns = _outer_call_columns(_two_calls_on_the_line, line) if at_the_instruction else None
    frame = observe.Frame(_two_calls_on_the_line, (torch.randn(4, 4),), {})
    error = graphamp.backend.handover.handover_error(frame, (__file__, line), columns=columns, device_type="cpu", dtype=torch.bfloat16)
    # At the instruction: a bf16 mm meets the fp32 x in bmm. From the line's start: both fp32.
    assert (isinstance(error, RuntimeError) and "bfloat16" in str(error).lower()) if at_the_instruction else error is None, error


def test_handover_run_switches_at_the_line_where_no_instruction_has_the_columns():
    site = (__file__, _mixes_after_the_line.__code__.co_firstlineno + 2)
    frame = observe.Frame(_mixes_after_the_line, (torch.randn(4, 4),), {})
    error = graphamp.backend.handover.handover_error(frame, site, columns=(900, 901), device_type="cpu", dtype=torch.bfloat16)
    assert isinstance(error, RuntimeError) and "bfloat16" in str(error).lower(), error


def test_handover_run_leaves_a_tracer_alone():
    def tracer(frame, event, arg):
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        site = (__file__, _mixes_after_the_line.__code__.co_firstlineno + 2)
        frame = observe.Frame(_mixes_after_the_line, (torch.randn(4, 4),), {})
        assert graphamp.backend.handover.handover_error(frame, site, device_type="cpu", dtype=torch.bfloat16) is None
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)


class ReadsDtypeAfterBreak(BreaksTheGraph):
    """After the break the frame gets the bf16 activation the graph before it hands over, which an
    fp32 linear takes only under autocast (or in dynamo's fake propagation): the frame cannot run
    eagerly without autocast, yet its x.to(orig_dtype) must still follow eager autocast's bf16."""

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        q = self.b(h)
        orig = q.dtype
        return (q.float() * 0.5).to(orig)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_reads_after_a_break_follow_eager_where_the_frame_cannot_run_in_fp32(dtype):
    model, x = ReadsDtypeAfterBreak(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerPathWarning)
        out = compiled(model, dtype)(x)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    assert out.dtype == ref.dtype == dtype
    assert torch.equal(out, ref)


class RecurrentAfterBreak(nn.Module):
    """An LSTM after a graph break: nn.LSTM's Python refuses a bf16 input for fp32 weights, a check
    it skips under autocast, and dynamo traces it without autocast on the bf16 the graph hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.rnn = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True)

    def forward(self, x):
        h = self.proj(x)
        torch._dynamo.graph_break()
        return self.rnn(h)[0]


def test_an_error_the_models_python_raises_after_a_break_is_a_graph_break_error():
    model, x = RecurrentAfterBreak(), torch.randn(2, 5, 8)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model(x)
    except RuntimeError as e:  # oneDNN's LSTM on some CPUs
        pytest.skip(f"eager autocast itself cannot run this LSTM here: {e}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerPathWarning)
        with pytest.raises(BackendCompilerFailed) as raised:
            compiled(model, torch.bfloat16)(x)
    error = raised.value.inner_exception
    assert isinstance(error, GraphBreakError) and "ValueError: RNN input dtype" in str(error), repr(error)
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error", EagerPathWarning)
        out = compiled(model, torch.bfloat16)(x)
    assert torch.equal(out, ref)
