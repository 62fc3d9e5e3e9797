"""Code dynamo skips runs eagerly: outside torch.autocast, in fp32 (graphamp.backend.skipped_code).

A graph break inside a loop makes dynamo skip the rest of the frame: it runs as plain Python, with
the blocks it calls compiled by graphamp. Outside autocast its own ops run in fp32 on the values
graphamp's graphs hand over in autocast's dtypes; the backend says so, naming the outputs, or raises
where that code fails, and stays silent where the skipped code changes nothing.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp.backend.skipped_code as skipped_code
from graphamp.errors import EagerPathWarning
from test_backend_exact import DTYPES, _fresh_dynamo, assert_bitwise_inside_autocast, compiled, graph_break_error  # noqa: F401  (_fresh_dynamo: autouse)


class Block(nn.Module):
    def __init__(self, off: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.off = off

    def forward(self, x):
        y = torch.relu(self.lin(x))
        if self.off:  # the model's own fp32 region, inside code dynamo compiles
            with torch.autocast("cpu", enabled=False):
                y = y.float().softmax(-1) @ self.lin.weight
        return y


class SkipsInALoop(nn.Module):
    """A graph break inside the loop over blocks: dynamo skips the rest of forward from the break
    before the loop, and the head after the loop runs eagerly. ``tail``: what that code does."""

    def __init__(self, tail: str, off: bool = False) -> None:
        super().__init__()
        self.pre, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block(off) for _ in range(2))
        self.tail = tail

    def forward(self, x):
        x = self.pre(x)
        if x.sum().item() > 1e9:  # a graph break: dynamo resumes the rest of forward as its own frame
            x = x + 1
        for block in self.blocks:
            x = block(x)
            if x.sum().item() > 1e9:  # a graph break inside a loop: that rest is skipped
                x = x * 2
        if self.tail == "head":  # a bf16 activation into an fp32 linear: fails without autocast
            return {"y": self.head(x), "x": x}
        if self.tail == "head_fp32":  # the head runs in fp32 where eager autocast runs it in bf16
            return {"y": self.head(x.float()), "x": x}
        return {"y": (x * 2).flatten(), "x": x}  # ops autocast leaves alone


class MaskHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)

    def forward(self, x):  # compiled below the skipped frame: graphamp's graph returns it in bf16
        return self.lin(x).unsqueeze(1)


class AttentionLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h, mask):  # dynamo traces it without autocast: an fp32 query, the bf16 mask
        q, k, v = self.q(h).unsqueeze(1), self.k(h).unsqueeze(1), self.v(h).unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)


class SkippedCallsALayer(nn.Module):
    """transformers' SAM3 DETR decoder: a graph break in its loop over layers, where each layer's
    attention mask comes from a compiled head and its hidden state from the skipped code."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(MaskHead() for _ in range(2))
        self.layers = nn.ModuleList(AttentionLayer() for _ in range(2))

    def forward(self, x):
        h = x
        for head, layer in zip(self.heads, self.layers):
            if x.sum().item() > 1e9:  # a graph break in the loop: dynamo skips the frame
                x = x * 2
            h = layer(h, head(x))
        return h


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_the_skipped_code_calls_that_dynamo_cannot_trace_raises_typed(dtype):
    torch.manual_seed(0)
    model, x = SkippedCallsALayer().eval(), torch.randn(2, 6, 8)
    message = str(graph_break_error(model, x, dtype))
    assert "dynamo runs SkippedCallsALayer.forward (test_backend_skipped_code.py) eagerly" in message, message
    assert "dynamo's trace of AttentionLayer.forward (test_backend_skipped_code.py)" in message, message
    assert "refuses scaled_dot_product_attention" in message and "attn_mask" in message, message
    assert f"torch.autocast('cpu', dtype={dtype})" in message, message
    assert_bitwise_inside_autocast(model, x, dtype)


def _dynamo_runs(caught):
    return [w for w in caught if issubclass(w.category, EagerPathWarning) and "dynamo runs" in str(w.message)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_skipped_code_that_fails_on_the_hand_over_raises_typed(dtype):
    torch.manual_seed(0)
    model, x = SkipsInALoop("head").eval(), torch.randn(2, 8)
    error = graph_break_error(model, x, dtype)
    message = str(error)
    assert "dynamo runs SkipsInALoop.forward (test_backend_skipped_code.py from line" in message, message
    assert "mat1 and mat2 must have the same dtype" in message, message
    assert f"torch.autocast('cpu', dtype={dtype})" in message, message
    # The way out it names works, bitwise.
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        warnings.simplefilter("ignore", EagerPathWarning)
        out = compiled(model, dtype)(x)
        ref = model(x)
    assert all(torch.equal(out[k], ref[k]) and out[k].dtype == ref[k].dtype for k in ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("off", [False, True], ids=["plain", "fp32-region"])
def test_skipped_code_that_changes_an_output_warns_naming_it(dtype, off):
    # With off, the blocks dynamo compiles hold the model's own autocast(enabled=False) region,
    # which the replay as compiled keeps: output['x'] is not named.
    torch.manual_seed(0)
    model, x = SkipsInALoop("head_fp32", off=off).eval(), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = compiled(model, dtype)(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    said = _dynamo_runs(caught)
    assert len(said) == 1, [str(w.message) for w in caught]
    message = str(said[0].message)
    assert f"output['y'] (tensor #0): torch.float32 where eager autocast gives {dtype}" in message, message
    assert "linear at test_backend_skipped_code.py" in message, message
    assert "output['x']" not in message, message
    # What it says is what the compiled model does.
    assert out["y"].dtype == torch.float32 and ref["y"].dtype == dtype
    assert torch.equal(out["x"], ref["x"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("off", [False, True], ids=["plain", "fp32-region"])
def test_skipped_code_that_changes_nothing_is_silent_and_bitwise(dtype, off):
    torch.manual_seed(0)
    model, x = SkipsInALoop("pointwise", off=off).eval(), torch.randn(2, 8)
    replays = []
    real = skipped_code._replay
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(skipped_code, "_replay", lambda *a, **k: replays.append(a[2]) or real(*a, **k))
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            cm = compiled(model, dtype)
            out = cm(x)
            first = len(replays)
            again = cm(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    assert not _dynamo_runs(caught), [str(w.message) for w in _dynamo_runs(caught)]
    assert first >= 2 and len(replays) == first, "replayed once (eager autocast, then as compiled), not on later calls"
    for got in (out, again):
        assert all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)


def test_self_check_false_turns_the_replay_off(monkeypatch):
    monkeypatch.setattr(skipped_code, "_replay", lambda *a, **k: pytest.fail("replayed with self_check=False"))
    model, x = SkipsInALoop("head_fp32").eval(), torch.randn(2, 8)
    cm = torch.compile(model, backend="graphamp", options={"inner": "eager", "self_check": False})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        cm(x)
    assert not _dynamo_runs(caught)


def test_the_replays_leave_the_autocast_state_as_they_found_it():
    model, x = SkipsInALoop("head_fp32").eval(), torch.randn(2, 8)
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled(), skipped_code._autocast_nesting())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        compiled(model, torch.bfloat16)(x)
    after = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled(), skipped_code._autocast_nesting())
    assert after == before


def test_no_frame_is_skipped_outside_a_compile():
    assert skipped_code.skipped_frames(None) == []


class SkipsWithNoGraphBelow(nn.Module):
    """The rest of forward after a break, a loop over plain linears with a break inside, is skipped,
    and no graph compiles below it (dynamo compiles no frame of torch.nn): dynamo decides so on the
    first call, after the graph before the break ran. ``tail``: what the loop runs."""

    def __init__(self, tail: str) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.tail = tail

    def forward(self, x):
        x = torch.relu(self.pre(x))
        if self.tail == "linear_fp32":
            x = x.float()
        if x.sum().item() > 1e9:
            x = x + 1
        for lin in self.lins:
            x = lin(x) if self.tail == "linear_fp32" else x * 2
            if x.sum().item() > 1e9:
                x = x * 2
        return x


def _said_per_call(cm, x, calls: int = 3) -> list[list[str]]:
    said = []
    for _ in range(calls):
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = cm(x)
        said.append([str(w.message) for w in _dynamo_runs(caught)])
    assert out.dtype == torch.float32  # what the warning says
    return said


def _names_the_skipped_rest(message: str, dtype) -> None:
    assert "dynamo runs SkipsWithNoGraphBelow.forward (test_backend_skipped_code.py from line" in message, message
    assert f"output (tensor #0): torch.float32 where eager autocast gives {dtype}" in message, message


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_skipped_rest_with_no_graph_below_is_named_as_the_first_call_returns(dtype):
    torch.manual_seed(0)
    model, x = SkipsWithNoGraphBelow("linear_fp32").eval(), torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert model(x).dtype == dtype
    said = _said_per_call(compiled(model, dtype), x)
    # dynamo decides to skip the rest during the first call, after graphamp's graph ran: the check
    # runs as that call returns, named once
    assert len(said[0]) == 1 and said[1:] == [[], []], said
    _names_the_skipped_rest(said[0][0], dtype)
    assert sys.getprofile() is None  # the one-shot hook is gone


@pytest.mark.parametrize("dtype", DTYPES)
def test_under_a_profiler_the_skipped_rest_is_named_from_the_second_call(dtype):
    torch.manual_seed(0)
    model, x = SkipsWithNoGraphBelow("linear_fp32").eval(), torch.randn(2, 8)
    cm = compiled(model, dtype)
    events = []

    def profiler(frame, event, arg):  # the user's own, holding sys.setprofile: left alone
        events.append(event)

    sys.setprofile(profiler)
    try:
        said = _said_per_call(cm, x)
    finally:
        held = sys.getprofile()
        sys.setprofile(None)
    assert held is profiler and events
    assert said[0] == [] and len(said[1]) == 1 and said[2] == [], said
    _names_the_skipped_rest(said[1][0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_skipped_rest_that_changes_nothing_is_silent(dtype):
    torch.manual_seed(0)
    model, x = SkipsWithNoGraphBelow("pointwise").eval(), torch.randn(2, 8)
    cm = compiled(model, dtype)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        outs = [cm(x) for _ in range(3)]
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    assert not _dynamo_runs(caught), [str(w.message) for w in _dynamo_runs(caught)]
    assert all(torch.equal(out, ref) and out.dtype == ref.dtype for out in outs)
