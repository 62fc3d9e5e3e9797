"""The converted graph run node by node beside an fp32 run of the same graph.

:class:`SideBySide` is an ``fx.Interpreter`` over an :class:`~graphamp.AmpModule`. Each node runs
three times on real values:

* **low**: as converted (what the module computes);
* **ref**: the same graph with graphamp's casts to the low dtype neutralised, so every op sees
  fp32 values: the fp32 reference, node for node;
* **local**: the node's op on the *reference* inputs, each cast to the dtype the low run gave it.
  Its error is what this node alone adds, so a layer downstream of an overflow is not blamed for it.

Random ops (dropout) see the same RNG state in the three runs; buffers the graph mutates are
restored afterwards, so the user's model is left as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.fx import _pytree as fx_pytree
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from graphamp.policy import LOW_DTYPES
from graphamp.eager import RngState, rng_kept
from graphamp.node_info import NodeInfo, peek
from graphamp.runtime import cached_cast
from graphamp.verify.report import error_metrics
from graphamp.eager import fixed_loss
from graphamp.spec import autocast_off

__all__ = ["NodeNumerics", "SideBySide", "record_of", "cast_target", "run_side_by_side", "grad_underflow", "GradNumerics", "run_fp32", "buffers_restored"]



def record_of(node: Node) -> NodeInfo:
    """The node's graphamp record, or an empty one."""
    return peek(node) or NodeInfo()


def cast_target(node: Node) -> torch.dtype | None:
    """The dtype a graphamp cast node casts to (None for other nodes)."""
    if node.op != "call_function" or not record_of(node).cast:
        return None
    if node.target is cached_cast:
        return node.args[2]
    return node.kwargs.get("dtype")


@dataclasses.dataclass
class NodeNumerics:
    """One node's output against fp32: accumulated (low vs ref) and local (this node alone)."""

    numel: int
    max_abs: float | None
    max_rel: float | None  # max |low - ref| / max |ref|
    sqnr_db: float | None
    overflow: int  # values finite in fp32 and inf/nan here
    underflow: int  # values nonzero in fp32 and zero here (flushed to zero)
    local_rel: float | None  # max rel error of this node alone, on fp32 inputs
    local_overflow: int  # overflow this node makes from finite inputs


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _clone_mutated(node: Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of the tensors an in-place op writes, so the reference runs do not write twice."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return args, kwargs
    return pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))


class SideBySide(Interpreter):
    """Run an AmpModule's graph and its fp32 reference together, recording per-node numerics.

    ``numerics[node.name]`` holds a :class:`NodeNumerics` for every node with a floating tensor
    output; ``ref_outputs`` is the reference graph's output, ``first_nonfinite`` the first node
    whose output overflows (inf/nan where fp32 is finite).
    """

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.ref_env: dict[Node, Any] = {}
        self.numerics: dict[str, NodeNumerics] = {}
        self.first_nonfinite: str | None = None
        self.ref_outputs: Any = None
        self.reference_failures: dict[str, str] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # each tensor output's dtype as it ran

    def run_node(self, n: Node) -> Any:
        rng = RngState()
        low = super().run_node(n)
        if isinstance(low, torch.Tensor):
            self.dtypes[n.name] = low.dtype
        if n.op == "output":
            self.ref_outputs = map_arg(n.args[0], lambda a: self.ref_env[a])
            return low
        if n.op != "call_function":
            ref = low
        else:
            ref = self._reference(n, low, rng)
            if _floating(low) and _floating(ref) and low.shape == ref.shape:
                self._measure(n, low, ref, rng)
        self.ref_env[n] = ref
        for dead in self.user_to_last_uses.get(n, []):
            self.ref_env.pop(dead, None)
        return low

    def _reference(self, n: Node, low: Any, rng: RngState) -> Any:
        args = map_arg(n.args, lambda a: self.ref_env[a])
        kwargs = map_arg(n.kwargs, lambda a: self.ref_env[a])
        if cast_target(n) in LOW_DTYPES:
            return args[1] if n.target is cached_cast else args[0]
        args, kwargs = _clone_mutated(n, args, kwargs)
        rng.restore()
        try:
            return n.target(*args, **kwargs)
        except Exception:
            pass
        # Tensors the model's code made in the low dtype it saw while captured (an attention mask
        # built with torch.finfo(fp16).min) meet fp32 values here: bring them to fp32 too.
        upcast = lambda t: t.float() if t.dtype in LOW_DTYPES else t
        args, kwargs = pytree.tree_map_only(torch.Tensor, upcast, (args, kwargs))
        rng.restore()
        try:
            return n.target(*args, **kwargs)
        except Exception as e:
            self.reference_failures[n.name] = f"{type(e).__name__}: {e}".splitlines()[0]
            return pytree.tree_map_only(torch.Tensor, upcast, low)

    def _local(self, n: Node, rng: RngState) -> torch.Tensor | None:
        """The node's op on the reference inputs cast to the low run's input dtypes; None when those
        inputs already hold inf/nan (the overflow belongs to their producer)."""
        low_args, low_kwargs = self.fetch_args_kwargs_from_env(n)
        ref_args = map_arg(n.args, lambda a: self.ref_env[a])
        ref_kwargs = map_arg(n.kwargs, lambda a: self.ref_env[a])
        ref_flat, spec = pytree.tree_flatten((ref_args, ref_kwargs))
        low_flat = pytree.tree_leaves((low_args, low_kwargs))
        if len(ref_flat) != len(low_flat):
            return None
        inputs = []
        for r, lo in zip(ref_flat, low_flat):
            if _floating(r) and _floating(lo):
                r = r.to(lo.dtype, copy=True)
                if not torch.isfinite(r).all():
                    return None
            inputs.append(r)
        args, kwargs = pytree.tree_unflatten(inputs, spec)
        args, kwargs = _clone_mutated(n, args, kwargs)
        rng.restore()
        try:
            out = n.target(*args, **kwargs)
        except Exception:
            return None
        return out if _floating(out) else None

    def _measure(self, n: Node, low: torch.Tensor, ref: torch.Tensor, rng: RngState) -> None:
        ref_finite = torch.isfinite(ref)
        overflow = int((~torch.isfinite(low) & ref_finite).sum())
        underflow = int(((low == 0) & (ref != 0)).sum())
        abs_err, rel_err, sqnr = error_metrics(low, ref)
        lowered = low.dtype in LOW_DTYPES or any(
            _floating(v) and v.dtype in LOW_DTYPES for v in pytree.tree_leaves(self.fetch_args_kwargs_from_env(n))
        )
        local_rel, local_overflow = 0.0, 0
        if lowered:
            local = self._local(n, rng)
            if local is None or local.shape != ref.shape:
                local_rel = None
            else:
                local_rel = error_metrics(local, ref)[1]
                local_overflow = int((~torch.isfinite(local) & ref_finite).sum())
        rng.restore()
        self.numerics[n.name] = NodeNumerics(low.numel(), abs_err, rel_err, sqnr, overflow, underflow, local_rel, local_overflow)
        if overflow and self.first_nonfinite is None:
            self.first_nonfinite = n.name


@contextlib.contextmanager
def buffers_restored(model: nn.Module) -> Iterator[None]:
    """Put the model's buffers back as they were (a forward in train mode updates batch-norm
    statistics; explain and search must leave the user's model as it was)."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])


def flat_inputs(gm: GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The graph's placeholder values for a call ``gm(*args, **kwargs)``."""
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is None:
        return list(args)
    return fx_pytree.tree_flatten_spec((list(args), dict(kwargs)), in_spec)


def run_side_by_side(amp: GraphModule, model: nn.Module, args: tuple, kwargs: dict, seed: int = 0) -> tuple[SideBySide, Any]:
    """Run ``amp`` node by node beside its fp32 reference; returns the interpreter and amp's outputs.

    Runs under ``no_grad``; the model's buffers (batch-norm statistics) are restored afterwards.
    """
    interp = SideBySide(amp)
    with buffers_restored(model), torch.no_grad(), autocast_off(), rng_kept(seed):
        flat = interp.run(*flat_inputs(amp, args, kwargs), enable_io_processing=False)
    return interp, amp.graph.process_outputs(flat)


def run_fp32(model: nn.Module, args: tuple, kwargs: dict, seed: int = 0) -> Any:
    """The model's own fp32 outputs (no autocast, no grad, seeded RNG, buffers restored)."""
    with buffers_restored(model), torch.no_grad(), autocast_off(), rng_kept(seed):
        return model(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class GradNumerics:
    """One parameter's gradient in the low-precision run against fp32 (``explain(grads=True)``)."""

    name: str
    numel: int
    nonzero_fp32: int  # elements of the fp32 gradient that are not zero
    underflow: float  # fraction of those that are zero without loss scaling
    underflow_scaled: float  # ... with GradScaler's initial scale (65536) on the loss
    nonfinite_scaled: int  # inf/nan in the scaled gradient (the scale itself overflowed)
    max_rel: float | None  # max rel error of the unscaled gradient against fp32


def _grads(call: Any, params: list[nn.Parameter], scale: float, seed: int) -> list[torch.Tensor | None]:
    with rng_kept(seed):
        loss = fixed_loss(call()) * scale
    if not loss.requires_grad:
        return [None] * len(params)
    # autograd.grad, not backward(): the model's .grad fields stay untouched.
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [None if g is None else g / scale for g in grads]


def grad_underflow(model: nn.Module, amp: GraphModule, args: tuple, kwargs: dict, scale: float = 65536.0) -> tuple[GradNumerics, ...]:
    """Per parameter: the fraction of its fp32 gradient's nonzeros that are zero in the converted
    module's gradient, without and with ``scale`` on the loss (GradScaler's ``init_scale``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    with buffers_restored(model), torch.enable_grad(), autocast_off():
        ref = _grads(lambda: model(*args, **kwargs), params, 1.0, 0)
        low = _grads(lambda: amp(*args, **kwargs), params, 1.0, 0)
        scaled = _grads(lambda: amp(*args, **kwargs), params, scale, 0)
    out = []
    for (name, p), r, lo, sc in zip(named, ref, low, scaled):
        if r is None or lo is None or sc is None:
            continue
        nonzero = r != 0
        count = int(nonzero.sum())
        frac = (lambda g: float(((g == 0) & nonzero).sum()) / count if count else 0.0)
        out.append(GradNumerics(
            name, p.numel(), count, frac(lo), frac(sc), int((~torch.isfinite(sc)).sum()), error_metrics(lo, r)[1],
        ))
    return tuple(out)


def finite(value: float | None) -> float | None:
    """JSON and HTML friendly: None for nan/inf."""
    return value if value is not None and math.isfinite(value) else None
