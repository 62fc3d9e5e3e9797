"""``recompute_masks``: boolean masks stay out of a compiled forward's saved tensors, values unchanged.

The pass runs on AOTAutograd's joint graph before the min-cut partition. The unit tests partition
small functions with and without it (eager graphs, no inductor) and read the forward's saved
tensors; the end-to-end test compiles a real ``nn.TransformerEncoderLayer`` through inductor.
"""

import pytest
import torch
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
from torch import nn
from torch._inductor.decomposition import select_decomp_table

import graphamp
from graphamp.backend.inductor import Inductor, inductor_patches
from graphamp.compiled import CompiledAmpModule
from graphamp.passes import recompute_masks as recompute_masks_module
from graphamp.passes.recompute_masks import RecomputeMasks, recompute_masks

BF16 = torch.bfloat16


def _eager(gm, _inputs):
    return make_boxed_func(gm)


def _partitioned(fn, *, with_pass: bool):
    """``fn`` through AOTAutograd with inductor's decompositions and eager graphs; returns the
    compiled function, a list that receives the forward graph's saved tensors (as fake tensors)
    and one that receives how many masks the pass rewrote."""
    saved: list[list[torch.Tensor]] = []
    marked: list[int] = []

    def partition(joint, inputs, **kwargs):
        if with_pass:
            marked.append(recompute_masks(joint.graph))
            joint.recompile()
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        saved.append([o.meta["val"] for o in outputs[kwargs["num_fwd_outputs"]:] if isinstance(o.meta.get("val"), torch.Tensor)])
        return fw, bw

    compiled = aot_function(fn, fw_compiler=_eager, bw_compiler=_eager, partition_fn=partition, decompositions=select_decomp_table())
    return compiled, saved, marked


def _relu_mlp(x, w1, w2):
    # Scaled after the relu (as dropout's scale does): the relu's output itself is not saved for
    # the second matmul, so the partitioner saves its mask.
    return (torch.relu(x @ w1) * 2.0) @ w2


def _dropout_mlp(x, w1, w2):
    return torch.nn.functional.dropout(torch.relu(x @ w1), 0.25, training=True) @ w2


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(8, 16, dtype=dtype, requires_grad=True), torch.randn(16, 32, dtype=dtype, requires_grad=True),
            torch.randn(32, 4, dtype=dtype, requires_grad=True)]


def _dtypes(saved):
    return [t.dtype for t in saved]


def _bytes(saved):
    return sum(t.numel() * t.element_size() for t in saved)


def _grads(fn, inputs, seed=1):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("fn", [_relu_mlp, _dropout_mlp], ids=["relu", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_no_bool_is_saved_and_values_are_unchanged(fn, dtype):
    inputs = _inputs(dtype)
    plain, plain_saved, _ = _partitioned(fn, with_pass=False)
    masked, masked_saved, marked = _partitioned(fn, with_pass=True)
    want_out, want_grads = _grads(plain, inputs)
    got_out, got_grads = _grads(masked, inputs)
    assert torch.bool in _dtypes(plain_saved[0])  # what the pass is for: the partitioner saves the mask
    assert marked[0] >= 1 and torch.bool not in _dtypes(masked_saved[0])
    # Saved as uint8, a byte per element as the bool was: no more memory.
    assert torch.uint8 in _dtypes(masked_saved[0]) and _bytes(masked_saved[0]) <= _bytes(plain_saved[0])
    # The same random draws (eager graphs, same seed): the same values, bit for bit.
    assert torch.equal(got_out, want_out) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


def test_a_mask_the_backward_does_not_read_is_not_saved():
    def f(x, w):
        y = x @ w
        return y * (y > 0).float().mean()  # the backward reads the mean, not the mask

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    plain, plain_saved, _ = _partitioned(f, with_pass=False)
    compiled, saved, _ = _partitioned(f, with_pass=True)
    plain(x, w).sum().backward()
    compiled(x, w).sum().backward()
    assert _dtypes(saved[0]) == _dtypes(plain_saved[0]) and torch.uint8 not in _dtypes(saved[0])


def test_a_view_of_a_mask_is_read_through_not_saved_at_its_size():
    def f(x, w, keep):
        big = (keep > 0).expand(8, 16, 32)  # a view of an (8, 1, 32) mask
        return torch.where(big, x @ w, 0.0) * 2.0

    x, w, keep = torch.randn(8, 16, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True), torch.randn(8, 1, 32)
    plain, plain_saved, _ = _partitioned(f, with_pass=False)
    compiled, saved, marked = _partitioned(f, with_pass=True)
    want, got = plain(x, w, keep), compiled(x, w, keep)
    assert torch.equal(got, want)
    got.sum().backward()
    assert marked == [1] and torch.bool not in _dtypes(saved[0]) and _bytes(saved[0]) == _bytes(plain_saved[0])


def test_inductor_gets_the_pass_with_a_stable_uuid():
    patches = inductor_patches(freezing=True)
    assert isinstance(patches["joint_custom_pre_pass"], RecomputeMasks) and patches["freezing"] is True
    assert RecomputeMasks().uuid() == RecomputeMasks().uuid() is not None


def test_a_compiled_encoder_layer_trains_as_without_the_pass(monkeypatch):
    """A real module through inductor, with and without the pass: the pass changes which tensors
    are saved, not what is computed (a tolerance: the kernels inductor groups may differ)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).train()
    x = torch.randn(2, 8, 32)
    amp = graphamp.convert(model, (x,), dtype=BF16)
    # Compiled afresh: a cache hit (inductor's FX graph cache, AOTAutograd's) would skip the pass.
    # (The configs' own patch(): monkeypatch's undo deletes a config module's entry.)
    marked = []
    monkeypatch.setattr(recompute_masks_module, "recompute_masks", lambda graph: marked.append(recompute_masks(graph)))
    results = []
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for with_pass in (True, False):
            if not with_pass:
                init = Inductor.__init__
                monkeypatch.setattr(Inductor, "__init__", lambda self, p: init(self, {k: v for k, v in p.items() if k != "joint_custom_pre_pass"}))
            cm = CompiledAmpModule(amp, freezing=False)
            model.zero_grad()
            out = cm(x)
            out.float().square().mean().backward()
            results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_a, grads_a), (out_b, grads_b) = results
    assert marked and marked[0] >= 1 and len(marked) == 1  # the relu's mask, in the first run only
    assert out_a.dtype == out_b.dtype
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0.02)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0.05)
