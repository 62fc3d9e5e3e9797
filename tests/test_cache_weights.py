"""cache_weights / freeze_weights: weights' low-precision copies persist, stay exact, and refresh."""

import io
import threading

import pytest
import torch
from torch import nn

import graphamp
from graphamp.passes.cache_weights import WEIGHT_CACHE
from conftest import build_case
from helpers import assert_exact, assert_same_outputs


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _eager(model, x, dtype=torch.bfloat16):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return model(x)


def test_weights_are_cast_once_across_no_grad_calls():
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,))
    cache = getattr(amp, WEIGHT_CACHE)
    with torch.no_grad():
        amp(x)
        first = {k: v[-1] for k, v in cache._entries.items()}
        out = amp(x)
    assert len(first) == 4  # two weights and two biases of the linears; LayerNorm's stay fp32
    assert all(cache._entries[k][-1] is v for k, v in first.items())  # reused, not recast
    assert torch.equal(out, _eager(model, x))


def test_an_optimizer_step_refreshes_the_copies():
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(amp(x), _eager(model, x))
        opt.zero_grad()
        amp(x).float().sum().backward()  # grad mode: casts recomputed inside the autograd graph
        opt.step()
    with torch.no_grad():
        assert torch.equal(amp(x), _eager(model, x))


def test_load_state_dict_refreshes_the_copies():
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,))
    with torch.no_grad():
        amp(x)
    other = _mlp()
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(amp(x), _eager(other, x))


def test_changes_through_data_need_refresh():
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,))
    with torch.no_grad():
        amp(x)
        model[0].weight.data.mul_(2)  # .data has its own version counter: invisible to the cache
        stale = amp(x)
        amp.refresh()
        fresh = amp(x)
    assert torch.equal(fresh, _eager(model, x))
    assert not torch.equal(stale, fresh)


def test_frozen_parameters_use_the_cache_in_grad_mode_and_stay_exact():
    model, x = _mlp(), torch.randn(4, 8)
    model[0].requires_grad_(False)
    amp = graphamp.convert(model, (x,))
    assert_exact(model, amp, (x,), {}, torch.bfloat16)
    assert any(k[0] == id(model[0].weight) for k in getattr(amp, WEIGHT_CACHE)._entries)


def test_tied_weights_are_cast_once():
    case = build_case("gpt2")
    args, kwargs = case.inputs
    amp = graphamp.convert(case.model, args, kwargs)
    with torch.no_grad():
        amp(*args, **kwargs)
    keys = [k[0] for k in getattr(amp, WEIGHT_CACHE)._entries]
    assert len(keys) == len(set(keys))
    assert id(case.model.lm_head.weight) in keys


def test_concurrent_calls_share_the_cache_safely():
    model = _mlp()
    amp = graphamp.convert(model, (torch.randn(4, 8),))
    inputs = [torch.randn(b, 8) for b in (1, 2, 3, 4)]
    results = {}

    def work(i):
        with torch.no_grad():
            for _ in range(25):
                results[i] = amp(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(inputs):
        assert torch.equal(results[i], _eager(model, x))


def test_save_drops_the_cache():
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,))
    with torch.no_grad():
        amp(x)
    buffer = io.BytesIO()
    torch.save(amp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not getattr(loaded, WEIGHT_CACHE)._entries
    with torch.no_grad():
        assert torch.equal(loaded(x), amp(x))


# inference=True

def test_inference_mode_is_exact_and_holds_low_weights_only():
    case = build_case("bert")
    args, kwargs = case.inputs
    amp = graphamp.convert(case.model, args, kwargs, inference=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = case.model(*args, **kwargs)
    out = amp(*args, **kwargs)
    assert_same_outputs(out, expected)
    assert not out.last_hidden_state.requires_grad
    assert amp.state_dict().keys() == case.model.state_dict().keys()
    query = "encoder.layer.0.attention.self.query.weight"
    assert amp.get_buffer(query).dtype is torch.bfloat16  # cast once, held in bf16 only
    assert query not in dict(amp.named_parameters())
    # the word embedding is used in fp32 (embedding is not on autocast's lists): shared, not copied
    assert amp.get_parameter("embeddings.word_embeddings.weight") is case.model.embeddings.word_embeddings.weight


@pytest.mark.parametrize("update", ["optimizer.step()", "load_state_dict", "in place under no_grad", "a weight read in fp32"])
def test_an_inference_module_follows_weights_updated_in_place(update):
    # inference=True casts each low-precision weight once: an update of the model's weight was not
    # seen, and the module mixed old low-precision weights with new fp32 ones (max diff 3.25 after
    # load_state_dict), without a word.
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), inference=True)
    amp(x)
    if update == "optimizer.step()":
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    elif update == "load_state_dict":
        model.load_state_dict({k: v * 2 for k, v in _mlp().state_dict().items()})
    else:
        with torch.no_grad():
            (model[0].weight if update == "in place under no_grad" else model[3].weight).mul_(3.0)
    assert torch.equal(amp(x), _eager(model, x))


def test_inference_refresh_and_load_state_dict():
    model, x = _mlp(), torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), inference=True)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    amp.refresh()
    assert torch.equal(amp(x), _eager(model, x))
    other = _mlp()
    amp.load_state_dict(other.state_dict())  # fp32 values into bf16 buffers: the same rounding as a cast
    assert torch.equal(amp(x), _eager(other, x))
