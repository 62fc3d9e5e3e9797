"""The capture on the example's values (graphamp/capture/values.py): eager's own program, guarded.

Where torch.export's program is not eager's (model code that asks whether it is traced, or reads a
tensor's value), convert captures the model by running it on the example, and the graph checks as
it runs that each value the model's code read, and each data-dependent size, is the example's; a
call that differs gets a conversion of its own. Each case below is checked bitwise against eager
autocast, outputs and gradients, on the example and on inputs that take the other branch.
"""

from __future__ import annotations

import io
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp.capture.values import capture_by_values
from graphamp.emit import _VARIANTS
from graphamp.errors import InputValueError
from graphamp.runtime import guard_size, guard_value
from helpers import assert_exact
from test_grad_regressions import MaskedEncoder, _inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _by_values(model: nn.Module, args: tuple, dtype: torch.dtype = torch.bfloat16) -> graphamp.AmpModule:
    """``model`` converted from the capture on values (convert takes it where the self-check finds
    export's or the dynamo fallback's program differs; these models the fallback runs exactly)."""
    import dataclasses

    from graphamp.pipeline import build as _convert
    from graphamp.spec import AmpSpec

    spec = dataclasses.replace(AmpSpec.resolve(model, (args, {}), dtype=dtype), capture="values")
    return _convert(model, args, {}, spec)


def _guards(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in (guard_value, guard_size)]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_model_that_detects_tracing_converts_to_eagers_program(dtype: torch.dtype) -> None:
    # transformers' mask utilities: eager skips an all-zeros bias by the mask's values, a trace on
    # fake tensors builds it (fp32 scores, fp32 softmax). The mask is positional, so passing None
    # for it (the all-ones fallback) does not apply: the capture on values does.
    model = MaskedEncoder(skip_bias_without_padding=True).train()
    args, kwargs = _inputs(padded=False)
    amp = graphamp.convert(model, args, kwargs, dtype=dtype)
    assert amp.graphamp_info.capture == "values"
    assert_exact(model, amp, args, kwargs, dtype)
    padded, _ = _inputs(padded=True)  # eager adds the bias: the guard refuses, a graph of its own
    assert_exact(model, amp, padded, {}, dtype)
    assert len(amp.__dict__[_VARIANTS]) == 1
    assert_exact(model, amp, args, kwargs, dtype)  # the example's values: the first graph again
    assert len(amp.__dict__[_VARIANTS]) == 1


def test_the_graph_guards_the_value_it_follows() -> None:
    model = MaskedEncoder(skip_bias_without_padding=True).eval()
    args, _ = _inputs(padded=False)
    gm = capture_by_values(model, args, {}, device_type="cpu", dtype=torch.bfloat16)
    (guard,) = _guards(gm)
    assert guard.args[0] == "bool" and guard.args[2] is True
    assert not any(isinstance(n.target, torch._ops.OpOverload) and torch.Tag.data_dependent_output in n.target.tags for n in gm.graph.nodes)
    assert "where" not in str(gm.code)  # the bias eager skips is not in the graph
    _, padded = args[0], _inputs(padded=True)[0][1]
    with pytest.raises(InputValueError, match="read a tensor value"):
        gm(args[0], padded)


class BranchOnSum(nn.Module):
    """A branch torch.export refuses (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:
            return h.relu() @ h.T
        return h.softmax(-1)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_branch_export_refuses_is_captured_by_values(dtype: torch.dtype) -> None:
    model = BranchOnSum().train()
    x = 10 * torch.randn(4, 8, generator=torch.Generator().manual_seed(0))  # the sign of h.sum() follows x's
    positive = x if model.lin(x).sum() > 0 else -x
    assert isinstance(graphamp.convert(model, (positive,), dtype=dtype), graphamp.DynamoAmpModule)  # exact already
    amp = _by_values(model, (positive,), dtype)
    assert isinstance(amp, graphamp.AmpModule) and amp.graphamp_info.capture == "values"
    assert_exact(model, amp, (positive,), {}, dtype)
    assert_exact(model, amp, (-positive,), {}, dtype)  # the other branch: converted on first use
    assert len(amp.__dict__[_VARIANTS]) == 1


class SplitByLengths(nn.Module):
    """Reads values with tolist() and int(): sizes that come from a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        parts = self.lin(x).split(lengths.tolist())
        longest = int(lengths.max())
        return torch.stack([F.pad(p, (0, 0, 0, longest - p.shape[0])) for p in parts])


def test_tolist_and_int_reads_are_guarded() -> None:
    model = SplitByLengths()
    x = torch.randn(5, 6)
    amp = _by_values(model, (x, torch.tensor([2, 3])))
    assert amp.graphamp_info.capture == "values"
    assert {n.args[0] for n in _guards(amp)} >= {"tolist", "int"}
    assert_exact(model, amp, (x, torch.tensor([2, 3])), {}, torch.bfloat16)
    assert_exact(model, amp, (x, torch.tensor([4, 1])), {}, torch.bfloat16)
    assert len(amp.__dict__[_VARIANTS]) == 1


class SelectPositive(nn.Module):
    """An op whose output size depends on values (boolean indexing: nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        picked = h[x[:, 0] > 0]
        if picked.shape[0] == 0:
            return h.sum(0)
        return picked.mean(0) + h.sum(0)


def test_a_data_dependent_size_is_guarded() -> None:
    model = SelectPositive()
    x = torch.tensor([[1.0, 2, 3, 4], [-1, 0, 1, 2], [2, 1, 0, -1]])
    amp = _by_values(model, (x,))
    assert amp.graphamp_info.capture == "values"
    assert any(n.target is guard_size for n in amp.graph.nodes)
    assert_exact(model, amp, (x,), {}, torch.bfloat16)
    other = x.clone()
    other[1, 0] = 5.0  # three rows picked where the example picked two
    assert_exact(model, amp, (other,), {}, torch.bfloat16)
    assert len(amp.__dict__[_VARIANTS]) == 1


class PicksRows(nn.Module):
    """Rows picked by a value-sized op torch does not tag dynamic_output_shape; the reshape reads
    the picked count, which the capture on values writes into the graph as the example's."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        keep = x[:, 0] > 0
        if self.how == "nonzero_as_tuple":
            (rows,) = keep.nonzero(as_tuple=True)
        elif self.how == "where":
            (rows,) = torch.where(keep)
        else:
            rows = torch.arange(x.shape[0]).repeat_interleave(keep.long())
        picked = h[rows]
        return picked.reshape(picked.shape[0], -1).softmax(-1)


@pytest.mark.parametrize("how", ["nonzero_as_tuple", "where", "repeat_interleave"])
def test_a_size_from_an_untagged_value_sized_op_is_guarded(how: str) -> None:
    # transformers' Longformer: global attention indices from mask.nonzero(as_tuple=True); a
    # padded mask changed their count, and the graph failed on the example's size.
    from graphamp.capture.values import VALUE_SIZED_UNTAGGED

    model = PicksRows(how)
    x = torch.tensor([[1.0, 2, 3, 4], [-1, 0, 1, 2], [2, 1, 0, -1]])
    amp = _by_values(model, (x,))
    assert amp.graphamp_info.capture == "values"
    sized = [n for n in amp.graph.nodes if n.target in VALUE_SIZED_UNTAGGED]
    assert sized and all(any(u.target is guard_size for u in _users_through_getitem(n)) for n in sized), amp.graph
    other = x.clone()
    other[1, 0] = 5.0  # three rows picked where the example picked two
    assert_exact(model, amp, (other,), {}, torch.bfloat16)
    assert len(amp.__dict__[_VARIANTS]) == 1


def test_the_untagged_value_sized_ops_are_untagged_and_value_sized() -> None:
    # What the list claims, on the installed torch (a torch that tags them makes it redundant, not wrong).
    from graphamp.capture.values import VALUE_SIZED_UNTAGGED

    keep = [torch.tensor([True, False, True]), torch.tensor([True, True, True])]
    sizes = {
        torch.ops.aten.nonzero_numpy.default: lambda k: torch.ops.aten.nonzero_numpy.default(k)[0].shape,
        torch.ops.aten.where.default: lambda k: torch.ops.aten.where.default(k)[0].shape,
        torch.ops.aten.repeat_interleave.self_Tensor: lambda k: torch.ops.aten.repeat_interleave.self_Tensor(torch.arange(3), k.long()).shape,
    }
    assert set(sizes) == VALUE_SIZED_UNTAGGED
    for op, size in sizes.items():
        assert size(keep[0]) != size(keep[1]), op


def _users_through_getitem(node: torch.fx.Node) -> list[torch.fx.Node]:
    users = list(node.users)
    return users + [u2 for u in users if u.target is operator.getitem for u2 in u.users]


class DropoutThenRead(nn.Module):
    """A random draw before the read: a refused call must not have drawn."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))
        if flag.any():
            return h * 2
        return h.softmax(-1)


def test_a_guard_after_a_random_draw_runs_first() -> None:
    model = DropoutThenRead().train()
    x = torch.randn(4, 8)
    yes, no = torch.tensor([True, False]), torch.tensor([False, False])
    amp = _by_values(model, (x, yes))
    assert amp.graphamp_info.capture == "values"
    (guard,) = [n for n in amp.graph.nodes if n.target is guard_value]
    first_draw = next(n for n in amp.graph.nodes if n.target is torch.ops.aten.dropout.default)
    order = {n: i for i, n in enumerate(amp.graph.nodes)}
    assert order[guard] < order[first_draw]
    for flag in (yes, no, yes):  # the refused call draws nothing: the same masks as eager
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x, flag)
        torch.manual_seed(3)
        assert torch.equal(amp(x, flag), expected)


class ReadsAfterChanges(nn.Module):
    """DETR's encoder layer in training: a read of values that a random draw and batch norm's
    in-place statistics produced, so its guard cannot run first."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.lin = nn.Linear(8, 8)
        self.taken: set[bool] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.bn(self.lin(x)), 0.5, training=self.training)
        positive = bool(h.sum() > 0)
        self.taken.add(positive)
        return h.softmax(-1) if positive else h * 2


def test_a_refused_call_puts_back_what_the_graph_changed_before_its_guard() -> None:
    from graphamp.node_info import graph_info

    model = ReadsAfterChanges().train()
    twin = ReadsAfterChanges().train()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    amp = _by_values(model, (x,))
    buffers, rng = graph_info(amp).restore_on_refusal
    assert rng and set(buffers) >= {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for seed in range(6):
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = twin(x)
        torch.manual_seed(seed)
        assert torch.equal(amp(x), expected)
        for name, buf in twin.named_buffers():  # batch-norm statistics updated once per call, as eager's
            assert torch.equal(model.get_buffer(name), buf), name
    assert twin.taken == {True, False} and len(amp.__dict__[_VARIANTS]) == 1


def test_a_converted_module_by_values_saves_and_loads() -> None:
    model = BranchOnSum().eval()
    x = 10 * torch.randn(4, 8)
    amp = _by_values(model, (x,))
    buffer = io.BytesIO()
    torch.save(amp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for inp in (x, -x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(inp)
        assert torch.equal(loaded(inp), expected)
    assert len(loaded.__dict__[_VARIANTS]) == 1  # -x took the other branch: converted after loading


def test_guard_value_compares_as_a_branch_would() -> None:
    guard_value("tolist", [torch.tensor([1.0, float("nan")])], [1.0, float("nan")])
    guard_value("equal", [torch.ones(2), torch.ones(2)], True)
    with pytest.raises(InputValueError):
        guard_value("int", [torch.tensor(3)], 3.0)  # another type is another value to Python code
    with pytest.raises(InputValueError, match="output size"):
        guard_size(torch.zeros(3, 2), [2, 2])


def test_where_dynamo_cannot_run_the_model_either_convert_captures_it_on_values(monkeypatch) -> None:
    # I-BERT in training: torch.export refuses its value branch and dynamo stops on a data-dependent
    # output (quant_modules.py); the capture on values runs eager's program.
    import sys

    from graphamp.errors import CaptureError

    convert_module = sys.modules["graphamp.convert"]  # the package exports the function of that name

    def dynamo_fails(model, args, kwargs, spec, refused):
        raise CaptureError("torch.compile with graph breaks failed too")

    monkeypatch.setattr(convert_module, "dynamo_fallback", dynamo_fails)
    model = BranchOnSum().train()
    x = 10 * torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert amp.graphamp_info.capture == "values"
    assert_exact(model, amp, (x,), {}, torch.bfloat16)
    assert_exact(model, amp, (-x,), {}, torch.bfloat16)


def test_what_neither_capture_can_run_keeps_dynamos_error(monkeypatch) -> None:
    from test_capture_fallback import FailsOnTheExample

    with pytest.raises(graphamp.CaptureError, match="torch.compile with graph breaks failed too"):
        graphamp.convert(FailsOnTheExample(), (torch.ones(3),))


class LogsOnPadding(nn.Module):
    """Reads values only to log (transformers' padding warning): no program depends on the read."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # transformers' padding warning: reads the last and first tokens (a size in the read), skipped when traced
        if not isinstance(ids, torch._subclasses.FakeTensor) and 0 in ids[:, [-1, 0]]:
            import logging

            logging.getLogger("test").debug("padding without a mask")
        return self.emb(ids).softmax(-1)


class BranchesOnAWindow(nn.Module):
    """Reads values through a slice (a size baked into the read): no guard can check it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if isinstance(mask, torch._subclasses.FakeTensor) or not bool(mask[:, -2:].all()):
            h = h + (1.0 - mask[..., None].float()) * -1e4
        return h.softmax(-1)


def test_a_read_no_guard_can_check_that_only_logs_is_not_warned() -> None:
    import warnings

    model = LogsOnPadding()
    for ids in (torch.tensor([[1, 2, 0]]), torch.tensor([[1, 2, 3]])):
        with warnings.catch_warnings():
            warnings.simplefilter("error", graphamp.EagerPathWarning)
            amp = graphamp.convert(model, (ids,), dtype=torch.bfloat16)
        assert not _guards(amp)
        assert_exact(model, amp, (torch.tensor([[0, 5, 0]]),), {}, torch.bfloat16)
        assert not amp.__dict__.get(_VARIANTS)


def test_a_read_no_guard_can_check_is_warned() -> None:
    model = BranchesOnAWindow()
    args = (torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.long))
    with pytest.warns(graphamp.EagerPathWarning, match=r"reads tensor values to choose its program \(test_capture_values.py:\d+\)"):
        graphamp.convert(model, args, dtype=torch.bfloat16, self_check="off")


def test_a_compiled_module_runs_inputs_that_fail_a_guard_uncompiled_and_exact() -> None:
    # In the compiled code the guard is an ATen assertion: one graph, no graph break at the read.
    from torch._dynamo.utils import counters

    model = MaskedEncoder(skip_bias_without_padding=True).eval()
    args, _ = _inputs(padded=False)
    counters.clear()
    cm = graphamp.convert(model, args, dtype=torch.bfloat16, compile=True)
    assert any(n.target is guard_value for n in cm.amp.graph.nodes)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    padded, _ = _inputs(padded=True)
    with pytest.warns(graphamp.CompileFallbackWarning, match="another path"):
        got = cm(*padded)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(got, model(*padded))


class DropsAFullMaskBySum(nn.Module):
    """transformers' ``fast_all``: ``mask.sum() == mask.numel()``, whose numel the trace bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if isinstance(mask, torch._subclasses.FakeTensor) or not bool(mask.sum() == mask.numel()):
            h = h.masked_fill(mask[..., None] == 0, -1e4)  # the traced path: the same values for a full mask
        return h.softmax(-1)


def test_a_guard_computes_a_size_the_read_uses_at_the_calls_size() -> None:
    model = DropsAFullMaskBySum()
    ones = torch.ones(2, 4, dtype=torch.long)
    amp = graphamp.convert(model, (torch.randn(2, 4, 8), ones), dtype=torch.bfloat16)
    assert amp.graphamp_info.capture == "export" and len(_guards(amp)) == 1
    assert any(n.target is torch.ops.aten.sym_numel.default for n in amp.graph.nodes)  # not the example's 8
    for b, s in ((1, 4), (3, 6)):
        assert_exact(model, amp, (torch.randn(b, s, 8), torch.ones(b, s, dtype=torch.long)), {}, torch.bfloat16)
    assert not amp.__dict__.get(_VARIANTS)
    padded = torch.ones(3, 6, dtype=torch.long)
    padded[0, -2:] = 0
    assert_exact(model, amp, (torch.randn(3, 6, 8), padded), {}, torch.bfloat16)
    assert len(amp.__dict__[_VARIANTS]) == 1


class ReadsValuesWhenLong(nn.Module):
    """Reads a value only for inputs longer than the example: torch.export takes the example's
    branch, and refuses the longer inputs' (data-dependent), where eager runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] > 4:
            return h * 2 if h.sum() > 0 else h - 1
        return h


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_shape_export_refuses_converts_again_on_values(dtype: torch.dtype) -> None:
    model = ReadsValuesWhenLong()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    amp = graphamp.convert(model, (x,), dtype=dtype)
    assert isinstance(amp, graphamp.AmpModule) and amp.graphamp_info.capture != "values"
    longer = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    assert_exact(model, amp, (longer,), {}, dtype)
    assert_exact(model, amp, (-longer,), {}, dtype)  # the other value branch: guarded, converted again
    assert_exact(model, amp, (x,), {}, dtype)
    variants = amp.__dict__[_VARIANTS]
    assert variants and all(v.graphamp_info.capture == "values" for v in variants), variants
