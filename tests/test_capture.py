"""capture: the program eager runs, the sizes it accepts, and the device the policy applies to."""

import re

import pytest
import torch
from torch import nn

import graphamp
from helpers import assert_exact


class CompilePath(nn.Module):
    """Takes another, forward-equivalent program when compiled, as transformers' masks do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if torch.compiler.is_compiling():
            return (h * 2).sum(0)
        return h.sum(0) * 2  # eager's: sums in the low dtype before doubling


def test_traces_the_eager_program_not_the_compile_path():
    model, x = CompilePath(), torch.randn(6, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    ops = [n.target for n in amp.graph.nodes if n.op == "call_function"]
    assert ops.index(torch.ops.aten.sum.dim_IntList) < ops.index(torch.ops.aten.mul.Tensor)
    assert_exact(model, amp, (x,), {}, torch.bfloat16)


class UntraceableEagerPath(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if not torch.compiler.is_compiling() and bool((h > 100).any()):  # a value read, eager only
            raise ValueError("too large")
        return h


def test_falls_back_to_the_compile_path_and_says_so():
    model, x = UntraceableEagerPath(), torch.randn(4, 8)
    with pytest.warns(graphamp.EagerPathWarning, match="could not be traced"):
        amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert_exact(model, amp, (x,), {}, torch.bfloat16)


def test_capture_leaves_no_hook_on_the_model():
    model = CompilePath()
    graphamp.convert(model, (torch.randn(3, 8),))
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_batch_one_where_only_torch_kernels_asked_for_two():
    # A conv's fake kernel guards batch > 1 to choose a memory format; export then pins batch to
    # [2, inf). The model's own code has no such condition, so batch 1 must run, as in eager.
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1])
    model = transformers.ConvNextModel(config).train()
    amp = graphamp.convert(model, (torch.randn(2, 3, 32, 32),), dtype=torch.bfloat16)
    for shape in [(1, 3, 32, 32), (3, 3, 64, 48)]:
        assert_exact(model, amp, (torch.randn(shape),), {}, torch.bfloat16)


class BatchBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        if x.shape[0] > 1:  # the model's own condition: the graph holds its branch for batch > 1
            return self.lin(x) * 2
        return self.lin(x)


def test_a_size_the_model_code_bounds_converts_again_and_logs_the_reason(caplog):
    model = BatchBranch()
    amp = graphamp.convert(model, (torch.randn(2, 3),))
    with caplog.at_level("INFO", logger="graphamp"):
        assert_exact(model, amp, (torch.randn(1, 3),), {}, torch.bfloat16)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert re.search(r"model's code tested .*> 1 at test_capture.py:\d+", caplog.records[0].getMessage())


def test_cpu_model_under_the_cuda_policy_is_refused():
    model, args = nn.Linear(4, 4), (torch.randn(2, 4),)
    with pytest.raises(graphamp.DeviceMismatchError, match="verify.*device_type='cuda'") as info:
        graphamp.convert(model, args, device_type="cuda")
    assert isinstance(info.value, ValueError) and "model.to('cuda')" in str(info.value)
    step = graphamp.TrainStep(model, lambda out, y: out.float().pow(2).mean(), torch.optim.SGD(model.parameters()), device_type="cuda")
    with pytest.raises(graphamp.DeviceMismatchError):
        step(*args, target=None)
    compiled = torch.compile(model, backend="graphamp", options={"device_type": "cuda", "inner": "eager"})
    with pytest.raises(Exception, match="DeviceMismatchError"):
        compiled(*args)
    assert graphamp.verify(model, args, device_type="cuda").ok  # the fake-CUDA check is the way


def test_capture_errors_print_nothing(capfd):
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # export refuses the branch; dynamo runs it, and it raises
                raise ValueError("positive")
            return x

    with pytest.raises(graphamp.CaptureError, match="data-dependent"):
        graphamp.convert(DataDependent(), (torch.ones(3),))
    assert capfd.readouterr().out == ""


def test_conversion_leaves_no_trace_values_in_the_models_python_caches():
    # timm's LeViT caches its attention bias in a dict on the first eval call: the trace's fake
    # tensor must not stay there, or the model (and convert's own self-check) later computes with it.
    from test_backend_exact import BiasCache

    torch.manual_seed(0)
    model, x = BiasCache().eval(), torch.randn(2, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)  # the self-check compares with eager
    assert model.attention_bias_cache == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert torch.equal(amp(x), expected)


def test_node_stack_traces_are_the_same_with_source_lines_read_lazily():
    """capture.stacks reads a frame's source line only when a kept frame is formatted: every node's
    stack trace is what torch records without it, and torch's function is back afterwards."""
    import torch.utils._traceback as torch_traceback

    from graphamp.capture.stacks import source_lines_read_lazily

    model, x = CompilePath(), torch.randn(6, 8)
    original = torch_traceback._extract_symbolized_tb

    def traces() -> list[tuple[str, str | None]]:
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False)
        return [(n.name, n.meta.get("stack_trace")) for n in ep.graph.nodes]

    want = traces()
    with source_lines_read_lazily(), source_lines_read_lazily():  # re-entrant
        assert torch_traceback._extract_symbolized_tb is not original
        got = traces()
    assert torch_traceback._extract_symbolized_tb is original
    assert any(trace and "h = self.lin(x)" in trace for _, trace in want)
    assert got == want
