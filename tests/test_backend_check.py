"""The backend's own check (graphamp.backend.eager_check): the compiled graph against the frame's
eager autocast run on the call being compiled, output by output and, in training, the gradients of
one backward; and a CheckSkippedWarning, naming the reason, where it cannot check.
"""

import contextlib
import warnings

import pytest
import torch
from torch import nn

import graphamp
import graphamp.backend
import graphamp.backend.eager_check as eager_check
from graphamp.errors import CheckSkippedWarning, EagerPathWarning, PolicyDriftWarning

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    eager_check._said.clear()  # each reason is said once per frame: each test starts unsaid
    yield
    torch._dynamo.reset()


def compiled(model, **options):
    return torch.compile(model, backend="graphamp", options={"inner": "eager", "dtype": BF16, **options})


@contextlib.contextmanager
def silent():
    """Every warning of the check an error."""
    with warnings.catch_warnings():
        for category in (EagerPathWarning, CheckSkippedWarning, PolicyDriftWarning):
            warnings.simplefilter("error", category)
        yield


def skipped(record, reason):
    found = [w.message for w in record if isinstance(w.message, CheckSkippedWarning) and w.message.reason == reason]
    assert len(found) == 1, [str(w.message) for w in record]
    return str(found[0])


def set_membership_passes(result, graph_outputs, inputs):
    """The check before outputs were paired by position: each tensor eager returns equal, in value
    and dtype, to some graph output or some input."""
    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    leaves = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    return all(any(same(t, o) for o in [*graph_outputs, *inputs]) for t in leaves)


def edit_graph(monkeypatch, edit):
    """Have the backend's rewrite return its graph edited by ``edit(graph, outputs) -> outputs``."""
    rewrite = graphamp.backend.rewrite

    def edited(*args, **kwargs):
        gm = rewrite(*args, **kwargs)
        out = gm.graph.output_node()
        with gm.graph.inserting_before(out):
            out.args = (tuple(edit(gm.graph, list(out.args[0]))),)
        gm.recompile()
        return gm

    monkeypatch.setattr(graphamp.backend, "rewrite", edited)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), self.b(x)


class PassesItsInput(nn.Module):
    """Returns relu(x), equal to x where x is positive, and a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x.relu(), self.proj(x)


# By position

def test_swapped_outputs_are_a_difference_set_membership_would_miss(monkeypatch):
    model, x = Pair(), torch.randn(4, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        ref = model(x)
    assert set_membership_passes(ref, [ref[1], ref[0]], [x])
    edit_graph(monkeypatch, lambda graph, outs: [outs[1], outs[0]])
    with torch.no_grad(), pytest.warns(EagerPathWarning) as record:
        compiled(model)(x)
    message = str(record[0].message)
    assert "Pair.forward: " in message and "1 of the tensors it returns differ from eager torch.autocast" not in message
    assert "2 of the tensors it returns differ" in message and "compared by position" in message
    assert "graph output #0 (the frame's output[0])" in message
    assert "torch.bfloat16 as eager autocast's, max abs difference" in message


def test_an_output_equal_to_an_input_is_still_compared_by_position(monkeypatch):
    model, x = PassesItsInput(), torch.rand(4, 8) + 0.5  # relu(x) is x
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        ref = model(x)
    assert set_membership_passes(ref, [ref[1], ref[1]], [x])  # relu(x) equals the input x
    edit_graph(monkeypatch, lambda graph, outs: [outs[1], outs[1]])
    with torch.no_grad(), pytest.warns(EagerPathWarning, match=r"1 of the tensors it returns differ .*graph output #0 \(the frame's output\[0\]\) is torch.bfloat16 where eager autocast gives torch.float32"):
        compiled(model)(x)


def test_a_dtype_difference_names_both_dtypes(monkeypatch):
    model, x = Pair(), torch.randn(4, 8)

    def to_fp32(graph, outs):
        return [graph.call_function(torch.ops.aten._to_copy.default, (outs[0],), {"dtype": torch.float32}), outs[1]]

    edit_graph(monkeypatch, to_fp32)
    with torch.no_grad(), pytest.warns(EagerPathWarning, match=r"graph output #0 \(the frame's output\[0\]\) is torch.float32 where eager autocast gives torch.bfloat16 \(max abs difference 0\)"):
        compiled(model)(x)


def test_nan_where_both_are_nan_is_equal():
    nan = float("nan")
    assert eager_check.output_difference(torch.tensor([1.0, nan]), torch.tensor([1.0, nan])) == ""
    assert "max abs difference inf" in eager_check.output_difference(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.a(x)
        return {"h": h, "pair": (self.b(h).softmax(-1), mask, h)}


def test_outputs_are_paired_through_the_return_value(monkeypatch):
    """Dynamo's tracer says where each output is returned: a dict, a nested tuple, a value passed
    through, a tensor returned twice."""
    seen = []
    pairs = eager_check._pairs

    def spy(*args):
        seen.append(pairs(*args))
        return seen[-1]

    monkeypatch.setattr(eager_check, "_pairs", spy)
    with silent(), torch.no_grad():
        compiled(Nested())(torch.randn(4, 8), torch.ones(4, dtype=torch.bool))
    pairs, unread = seen[0]
    assert [(j, str(w)) for j, w in pairs] == [(0, "output['h']"), (1, "output['pair'][0]")] and unread == ()


class Box:
    """An object of the model's own that pytree does not list, as transformers' DynamicCache."""

    def __init__(self, t):
        self.t = t


class ReturnsABox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), Box(self.b(x))


def test_outputs_beside_an_unlisted_object_are_compared_and_the_object_is_named(monkeypatch):
    # A causal LM returns its logits beside a DynamicCache: the whole check was skipped ("unpaired"),
    # so a difference in the logits went unsaid. The logits are compared; the cache is named.
    model, x = ReturnsABox(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        compiled(model)(x)
    assert not [w for w in record if isinstance(w.message, EagerPathWarning)]
    assert "the 1 tensor it returns where the backend can locate them equal eager autocast's, but those it returns inside a Box" in skipped(record, "unread")
    torch._dynamo.reset()
    eager_check._said.clear()
    edit_graph(monkeypatch, lambda graph, outs: [graph.call_function(torch.ops.aten.mul.Tensor, (o, 2)) for o in outs])
    with torch.no_grad(), pytest.warns(EagerPathWarning, match=r"1 of the tensors it returns differ .*\(the frame's output\[0\]\)"):
        compiled(model)(x)


# In training, the gradients

def test_a_gradient_difference_in_training_is_found(monkeypatch):
    model, x = Pair().train(), torch.randn(4, 8)

    def twice_the_gradient(graph, outs):
        # The same value (y.detach() + 0), twice the gradient: what a wrong backward would give.
        y = outs[0]
        d = graph.call_function(torch.ops.aten.detach.default, (y,))
        zero = graph.call_function(torch.ops.aten.sub.Tensor, (y, d))
        return [graph.call_function(torch.ops.aten.add.Tensor, (d, graph.call_function(torch.ops.aten.mul.Tensor, (zero, 2)))), outs[1]]

    edit_graph(monkeypatch, twice_the_gradient)
    with pytest.warns(EagerPathWarning) as record:
        compiled(model)(x)
    message = str(record[0].message)
    assert "its outputs equal eager torch.autocast's but the gradients of one backward" in message
    assert "the gradient of a.weight is torch.float32 as eager autocast's, max abs difference" in message


def test_the_gradient_check_runs_in_training_and_not_without_grad(monkeypatch):
    runs = []
    backward = eager_check.eager_backward

    def spy(*args, **kwargs):
        runs.append(1)
        return backward(*args, **kwargs)

    monkeypatch.setattr(eager_check, "eager_backward", spy)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    with silent(), torch.no_grad():
        compiled(model)(torch.randn(4, 8))
    assert runs == []
    torch._dynamo.reset()
    with silent():
        out = compiled(model.train())(torch.randn(4, 8))
    assert runs == [1] and out.requires_grad


# Where it cannot check, it says so, once

class BreaksTheGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_a_graph_break_is_said_once(monkeypatch):
    model = BreaksTheGraph()
    with warnings.catch_warnings(record=True) as record, torch.autocast("cpu", dtype=BF16):
        warnings.simplefilter("always")
        cm = compiled(model)
        cm(torch.randn(4, 8))
        torch._dynamo.reset()
        cm = compiled(model)
        cm(torch.randn(4, 8))  # compiled again: not said again
    message = skipped(record, "graph_break")
    assert message.startswith("BreaksTheGraph.forward: dynamo broke it into several graphs")
    assert "graphamp.verify(model, args)" in message and "graphamp.convert(model, args)" in message
    assert not [w for w in record if issubclass(w.category, EagerPathWarning)]  # the rest of the frame is checked and equal


def test_dropout_in_training_is_said():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled(model)(torch.randn(4, 8))
    message = skipped(record, "random")
    assert "draws random numbers" in message and "model.eval()" in message and "graphamp.verify" in message
    with silent():  # in eval mode dropout draws nothing: compared, and equal
        torch._dynamo.reset()
        compiled(model.eval())(torch.randn(4, 8))


class FailsInEager(nn.Module):
    """Code that runs only when traced: the check's eager run raises."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if not torch.compiler.is_compiling():
            raise RuntimeError("this model runs compiled only")
        return self.proj(x)


def test_an_exception_in_the_check_is_said():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled(FailsInEager())(torch.randn(4, 8))
    message = skipped(record, "error")
    assert "eager autocast could not run the frame here (RuntimeError: this model runs compiled only)" in message


def test_a_graph_that_raises_in_the_check_is_said(monkeypatch):
    def raising(graph, outs):
        return [graph.call_function(torch.ops.aten.mm.default, (outs[0], outs[1])), outs[1]]  # (4, 8) @ (4, 8)

    edit_graph(monkeypatch, raising)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        try:
            compiled(Pair())(torch.randn(4, 8))
        except Exception:
            pass  # the call raises too; the check said why it did not compare first
    assert "the compiled graph raised when the check ran it (RuntimeError: " in skipped(record, "error")


def test_a_backward_that_raises_is_said_and_the_outputs_still_compared(monkeypatch):
    def raising(*args, **kwargs):
        raise RuntimeError("no backward here")

    monkeypatch.setattr(eager_check, "eager_backward", raising)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled(Pair().train())(torch.randn(4, 8))
    message = skipped(record, "gradients")
    assert "its outputs equal eager autocast's, but the gradients were not compared: eager autocast's backward raised (RuntimeError: no backward here)" in message
    assert not [w for w in record if issubclass(w.category, EagerPathWarning)]


def test_outputs_paired_in_order_only_where_counts_and_shapes_agree():
    a, b, x = torch.ones(2), torch.zeros(3), torch.full((2,), 3.0)
    assert [(j, str(w)) for j, w in eager_check.flat_pairs((a, x, b), [a, b], [x])] == [(0, "output[0]"), (1, "output[2]")]
    with pytest.raises(eager_check._Unpaired, match="returns 2 tensors it computes and the graph has 1"):
        eager_check.flat_pairs((a, b), [a], [])
    with pytest.raises(eager_check._Unpaired, match=r"graph output #0 has shape \(3,\) and the frame's output\[0\] \(2,\)"):
        eager_check.flat_pairs((a, b), [b, a], [])


# A correct model: nothing

@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_a_correct_model_warns_nothing(grad):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Dropout(0.0)).train(grad)
    x = torch.randn(4, 8)
    with silent(), torch.set_grad_enabled(grad):
        out = compiled(model)(x)
        with torch.autocast("cpu", dtype=BF16):
            ref = model(x)
    assert torch.equal(out, ref)


# The eager run of a frame leaves the caller's tensors alone

class WritesItsArgument(nn.Module):
    """After the break, dynamo compiles a resume function whose argument ``h`` the code writes in
    place (Higgs Audio's ``hidden_states[mask] += mlp(...)``): the backend's eager run of that frame
    must not write the tensor the real call then writes."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        h += self.b(h)
        return h


@pytest.mark.parametrize("ambient", [True, False], ids=["in_autocast", "outside_autocast"])
def test_a_frame_that_writes_its_argument_in_place_is_run_once(ambient):
    model, x = WritesItsArgument().eval(), torch.randn(4, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckSkippedWarning)
        warnings.simplefilter("ignore", EagerPathWarning)  # outside autocast: the code between graphs
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=ambient):
            got = compiled(model)(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_eager_runs_arguments_are_copies_that_keep_their_aliasing():
    from graphamp.backend.observe import Frame, _fresh_arguments

    base = torch.randn(4, 8)
    view, param, leaf = base[1:3], nn.Parameter(torch.randn(2)), torch.randn(2, requires_grad=True)
    (b, v, p), kw = _fresh_arguments(Frame(lambda *a, **k: None, (base, view, param), {"leaf": leaf}))
    assert torch.equal(b, base) and torch.equal(v, view) and b.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    v.add_(1)  # the copy of the view writes the copy of the base, and nothing of the caller's
    assert torch.equal(b[1:3], v) and not torch.equal(b, base)
    assert p is param and kw["leaf"] is leaf  # parameters and leaves that require grad: as they are


def test_the_reference_takes_eagers_fused_attention_where_the_call_does(monkeypatch):
    # Eval, no grad, self-attention: eager runs _native_multi_head_attention. With the backend's
    # graph left on the ordinary path dynamo traced, the check must name the difference: its
    # reference run keeps query, key and value one tensor (a copy each turned eager's fast path
    # off) and runs without its TorchFunctionMode (which turned it off too).
    monkeypatch.setattr(graphamp.backend, "follow_fused_attention", lambda gm: False)
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(3, 7, 32)
    with pytest.warns(EagerPathWarning, match="MultiheadAttention"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.compile(model, backend="graphamp", options={"inner": "eager"})(x, x, x, need_weights=False)
