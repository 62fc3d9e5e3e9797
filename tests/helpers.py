"""Shared checks: graphamp against eager torch.autocast, structure first, numerics second."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import graphamp
from graphamp.spec import AmpSpec
from graphamp.verify.reference import count_casts, eager_autocast_graph, lowered_graph


def float_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(out: Any) -> torch.Tensor:
    # A fixed, position-dependent weighting so every output element gets a distinct gradient.
    total = torch.zeros(())
    for i, t in enumerate(float_leaves(out)):
        w = torch.linspace(-1, 1, t.numel(), dtype=torch.float32).reshape(t.shape) * (i + 1)
        total = total + (t.float() * w).sum()
    return total


def _run(call, model: nn.Module, *, grads: bool):
    """One forward (and backward of a fixed loss): the outputs and every parameter's grad."""
    model.zero_grad(set_to_none=True)
    out = call()
    g = None
    if grads:
        _loss(out).backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return out, g


def run_eager(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, *, grads: bool):
    def call():
        with torch.autocast("cpu", dtype=dtype):
            return model(*args, **kwargs)

    return _run(call, model, grads=grads)


def run_converted(amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, *, grads: bool):
    return _run(lambda: amp(*args, **kwargs), model, grads=grads)


def assert_same_outputs(out: Any, ref: Any) -> None:
    assert type(out) is type(ref), (type(out), type(ref))
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype, f"output {i}: dtype {a.dtype} != eager {b.dtype}"
            assert a.shape == b.shape, f"output {i}: shape {a.shape} != eager {b.shape}"
            assert torch.equal(a, b), f"output {i}: max |diff| {(a.double() - b.double()).abs().max().item()}"
        else:
            assert a == b


def assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name in want:
        assert torch.equal(got[name], want[name]), (
            f"grad of {name}: max |diff| {(got[name] - want[name]).abs().max().item()}"
        )


def assert_exact(model: nn.Module, amp: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, *, grads: bool = True) -> None:
    """Outputs, output dtypes and every parameter gradient are torch.equal to eager autocast."""
    ref, ref_g = run_eager(model, args, kwargs, dtype, grads=grads)
    out, out_g = run_converted(amp, model, args, kwargs, grads=grads)
    assert_same_outputs(out, ref)
    if grads:
        assert ref_g, "the model produced no gradients; the check would be empty"
        assert_same_grads(out_g, ref_g)


def eager_cast_count(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> int:
    """Casts eager autocast executes in one forward."""
    return count_casts(eager_autocast_graph(model, args, kwargs, device_type="cpu", dtype=dtype))


def graphamp_cast_count(amp: nn.Module, args: tuple, kwargs: dict) -> int:
    """Casts the converted module executes in one forward."""
    return count_casts(lowered_graph(amp, args, kwargs))


def captured(model: nn.Module, args: tuple, *, dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu") -> torch.fx.GraphModule:
    """A captured graph, regions inlined, ready for one pass under test."""
    from graphamp.capture import capture
    from graphamp.passes import inline_regions, record_dtypes, strip_asserts

    gm = capture(model, args, {}, device_type=device_type, dtype=dtype)
    spec = AmpSpec(device_type, dtype)
    record_dtypes(gm, spec)
    inline_regions(gm, spec)
    strip_asserts(gm, spec)
    return gm


def spec_of(policy, **fields) -> AmpSpec:
    """The spec of a built-in policy (plus spec fields such as inference=True or config=...)."""
    return AmpSpec(policy.device_type, policy.dtype, **fields)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def casts(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default]


def matmul_function(**custom_fwd_kwargs):
    """An autograd.Function computing a @ b under torch.amp.custom_fwd(**custom_fwd_kwargs)."""

    class MatMul(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", **custom_fwd_kwargs)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)

    return MatMul


class TransposedProjection(nn.Module):
    """GroupNorm over channels, then a linear over the transposed (non-contiguous) map."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.GroupNorm(4, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x.flatten(2)).transpose(1, 2))


def skip_unless_cached_cast_changes_the_kernel(model: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.float16) -> None:
    """Skip, saying why, where eager autocast under no_grad gives the same bits with and without its
    cast cache on this CPU: the cached weight cast still requires grad (the matmul folds into mm),
    the uncached one does not (bmm), and only where the CPU's kernels round those two differently
    (fp16 emulated, as on AVX2 or avx512_bf16-only CPUs) can a test tell the programs apart."""
    import pytest

    outs = []
    for cache_enabled in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
            outs.append(model(x))
    if torch.equal(*outs):
        pytest.skip(f"on this CPU eager autocast's {dtype} mm and bmm round alike here, so the cached and uncached "
                    "casts give the same bits: nothing to tell apart")
