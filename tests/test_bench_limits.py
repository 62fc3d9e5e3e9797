"""graphamp.bench.limits: the GEMM rate, matmul FLOPs, and the matmul/other split of a step's time
(no wall-clock ratio asserted)."""

from __future__ import annotations

import torch
from torch import nn

from graphamp.bench import limits as bench_limits
from graphamp.bench.limits import Split, gemm_rate, is_matmul_op, limits_line, matmul_bound_ms, matmul_flops, time_split


def test_the_gemm_rate_is_positive_and_measured_once(monkeypatch):
    rate = gemm_rate(torch.float32, n=128)
    assert rate > 0
    key = (torch.float32, 128, torch.get_num_threads(), "nt")
    assert bench_limits._RATES[key] == rate
    # cached: a second call does not time again
    monkeypatch.setattr(bench_limits.benchmark, "Timer", None)
    assert gemm_rate(torch.float32, n=128) == rate
    assert matmul_bound_ms(2 * 128**3, torch.float32, n=128) == 2 * 128**3 / rate * 1e3


def test_matmul_flops_of_a_linear_layer_forward_and_backward():
    lin, x = nn.Linear(64, 32), torch.randn(8, 64)
    forward = 2 * 8 * 64 * 32  # FlopCounterMode counts 2 m n k per matmul (a multiply and an add)
    assert matmul_flops(lambda: lin(x)) == forward
    # Backward adds one matmul of the same size per gradient it computes: the weight's
    # (grad_out.T @ x) always, the input's (grad_out @ W) only where the input needs a gradient.
    # The bias gradient is a sum: no matmul FLOPs.
    assert matmul_flops(lambda: lin(x).sum().backward()) == 2 * forward
    assert matmul_flops(lambda: lin(x.clone().requires_grad_()).sum().backward()) == 3 * forward


def test_matmul_flops_counts_cpu_attention_and_the_encoder_fast_path():
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        # 4 projections of 32x32, two feed-forward matmuls (32x64, 64x32), attention's two batched
        # matmuls (q @ k.T and p @ v: 2 * 2*4*16*16*8 each) over 2*16 tokens
        tokens = 2 * 16
        want = 2 * tokens * (4 * 32 * 32 + 2 * 32 * 64) + 2 * (2 * 2 * 4 * 16 * 16 * 8)
        assert matmul_flops(lambda: layer(x)) == want
    assert torch.backends.mha.get_fastpath_enabled()  # turned back on


def test_the_split_of_an_eager_mlp():
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 16))
    x = torch.randn(32, 64)
    split = time_split(lambda: mlp(x), calls=2)
    assert split.matmul_ms > 0 and split.other_ms >= 0 and 0 <= split.fraction <= 1
    kinds = {name: kind for name, kind, _ in split.events}
    assert kinds["aten::addmm"] == "matmul"
    assert kinds["aten::gelu"] == "other" and kinds["aten::native_layer_norm"] == "other"
    assert kinds["aten::linear"] == "other"  # dispatch glue: its addmm is the kernel


def test_the_split_of_a_compiled_model_counts_its_extern_mm():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16))
    compiled = torch.compile(model)
    x = torch.randn(32, 64)
    with torch.no_grad():
        compiled(x)  # compiles
        split = time_split(lambda: compiled(x), calls=2)
    assert split.matmul_ms > 0 and split.other_ms >= 0 and 0 <= split.fraction <= 1
    matmuls = {name for name, kind, _ in split.events if kind == "matmul"}
    # inductor's extern_kernels.mm/addmm (or a packed oneDNN/MKL linear, with freezing) dispatch
    # through ATen and appear under their op names
    assert matmuls & {"aten::mm", "aten::addmm", "mkl::_mkl_linear", "mkldnn::_linear_pointwise"}
    # the generated kernels run inside inductor's "## Call CompiledFxGraph ... ##" range: other
    assert any(name.startswith("## Call CompiledFxGraph") and kind == "other" for name, kind, _ in split.events)


def test_the_classification_of_event_names():
    for name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkl::_mkl_linear", "mkldnn::_linear_pointwise",
                 "mkldnn::_convolution_pointwise", "aten::mkldnn_convolution", "aten::convolution_backward",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert is_matmul_op(name), name
    for name in ("aten::linear", "aten::matmul", "aten::convolution", "aten::copy_", "aten::gelu", "Torch-Compiled Region: 0/0",
                 "## Call CompiledFxGraph abc ##", "graph_0_cpp_fused_gelu_0", "autograd::engine::evaluate_function: MmBackward0"):
        assert not is_matmul_op(name), name


def test_the_limits_line():
    split = Split(matmul_ms=3.0, other_ms=1.0)
    line = limits_line(2 * 128**3, torch.float32, fastest="compile_fp32_freezing", fastest_ms=5.0, split=split, n=128)
    bound = matmul_bound_ms(2 * 128**3, torch.float32, n=128)
    assert line.startswith(f"matmul-only bound {bound:.3g} ms in fp32")
    assert f"compile_fp32_freezing, 5 ms = {5.0 / bound:.2f}x the fp32 bound, spends 75% of its time in matmul/conv kernels" in line
    assert Split(0.0, 0.0).fraction == 0.0


def test_a_cpp_wrapper_program_is_profiled_with_the_python_wrapper(monkeypatch):
    """Inductor's C++ wrapper calls its kernels past the profiler: profiled as it runs, a program of
    matmuls would spend 0% in them. The bench profiles the same program with the Python wrapper."""
    from graphamp.autotune import compiled as autotune_compiled
    from graphamp.bench import variants as bench_variants
    from graphamp.testing import zoo

    torch._dynamo.reset()
    # the C++ wrapper wins the timing, as it did on checkerboard
    monkeypatch.setattr(autotune_compiled, "time_programs", lambda steps: {"plan": [2.0] * 3, "C++ wrapper": [1.0] * 3})
    case = zoo.mlp()
    case.batch = 8
    variant = bench_variants.prepare("compile_fp32_freezing", case, "infer", torch.bfloat16, cpp_wrapper=True)
    assert variant.note.startswith("inductor's C++ wrapper kept")
    assert variant.profiled is not variant.step
    # What the bench would have printed without the twin: no matmul seen (if torch's C++ wrapper
    # becomes visible to the profiler, this fails, and the twin can go).
    assert time_split(variant.step, calls=1).matmul_ms == 0
    profiled = time_split(variant.profiled, calls=1)
    assert profiled.matmul_ms > 0 and profiled.fraction > 0


def test_a_python_wrapper_program_is_profiled_as_it_runs():
    from graphamp.bench import variants as bench_variants
    from graphamp.testing import zoo

    torch._dynamo.reset()
    case = zoo.mlp()
    case.batch = 8
    variant = bench_variants.prepare("compile_fp32", case, "infer", torch.bfloat16)
    assert variant.profiled is variant.step  # no "(profiled with inductor's Python wrapper ...)" on its line
