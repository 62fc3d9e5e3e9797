"""Replace a composite op node by the decomposition eager autocast actually runs, when that
decomposition holds ops autocast lists.

A CompositeImplicitAutograd op that autocast does not list runs its decomposition with autocast
still on, so eager casts inside it: graphamp inlines the decomposition and lets insert_casts cast
its children. ``aten::lstm`` on CPU follows the oneDNN kernel path eager takes instead
(:mod:`graphamp.passes.onednn_lstm`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from graphamp.config import Config
from graphamp.errors import EagerPathWarning
from graphamp.passes.classify import Decision, autocast_state, location
from graphamp.passes.grad_analysis import in_no_grad
from graphamp.passes.graph_edit import carried_meta, inline_subgraph, is_mutating, val_of
from graphamp.passes.onednn_lstm import onednn_lstm_applies, trace_onednn_lstm
from graphamp.policy import Policy, is_eligible, op_key
from graphamp.spec import ambient_autocast

__all__ = ["Decomposer", "is_decomposable"]

_MAX_DECOMPOSITION_DEPTH = 6


def is_decomposable(op: torch._ops.OpOverload) -> bool:
    """Whether eager runs ``op``'s decomposition with autocast still active."""
    # An op whose Autograd key has its own kernel redispatches below autocast; only pure
    # CompositeImplicitAutograd ops run their decomposition with autocast still active.
    name = op.name()
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd") and not (
        torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    )


class Decomposer:
    """Inlines, in place of a composite op node, the decomposition eager autocast sees inside it.

    ``classify`` is the caller's decision for a node (insert_casts' own, or autotune's with the ops
    it raised listed fp32): a node autocast lists is never decomposed.
    """

    def __init__(
        self,
        gm: GraphModule,
        policy: Policy,
        config: Config,
        classify: Callable[[Node], Decision | tuple],
        fake_mode: FakeTensorMode | None,
        *,
        kernel_paths: bool,
        no_grad: bool,
    ) -> None:
        self.graph = gm.graph
        self.policy = policy
        self.config = config
        self.classify = classify
        self.fake_mode = fake_mode
        self.kernel_paths = kernel_paths
        self.no_grad = no_grad
        self.not_relevant: set[tuple] = set()  # decomposition signatures known to hold no listed op

    def decompose(self, node: Node) -> list[Node] | None:
        """Replace an unlisted composite by its decomposition when that holds autocast-relevant ops;
        the inlined nodes in order, or None where ``node`` stays."""
        op = node.target
        if not is_decomposable(op):
            return None
        # AOTAutograd cannot trace mkldnn_rnn_layer's backward, so graphs it differentiates take
        # the kernel path only where the LSTM runs without grad.
        if (
            op is torch.ops.aten.lstm.input
            and (self.kernel_paths or not self.grad_enabled(node))
            and onednn_lstm_applies(node, self.policy, self.config, grad_enabled=self.grad_enabled(node))
        ):
            sub, leaves = trace_onednn_lstm(node, grad_enabled=self.grad_enabled(node))
            if sub is not None:
                return self.inline(node, sub, leaves, "oneDNN (mkldnn_rnn_layer per layer and direction)")
        category, _, _ = self.classify(node)
        enabled, _ = autocast_state(node, self.policy)
        if category is not None or not enabled or op_key(op) in self.config.all_overrides:
            return None
        if self.config.keeps_fp32(node.meta.get("nn_module_stack")) is not None:
            return None
        if not any(is_eligible(val_of(n), self.policy.device_type) for n in node.all_input_nodes):
            return None
        low = autocast_state(node, self.policy)[1]
        if op is torch.ops.aten.lstm.input:
            h, c = val_of(node.args[1])
            if h.shape[-1] != c.shape[-1]:
                warnings.warn(
                    f"nn.LSTM with proj_size at node {node.name} ({location(node)}): eager runs it on native "
                    "C++ cells, whose projection recasts its weight every step; graphamp runs torch's "
                    "decomposition of those cells, which casts it once. Outputs are bitwise equal, but the "
                    "projection weights' gradients (weight_hr_*) may differ in rounding from eager autocast. "
                    "Way out: keep the LSTM in fp32 with Config(fp32_modules=(nn.LSTM,)) if they must be exact.",
                    EagerPathWarning,
                    stacklevel=2,
                )
        key = _signature(op, low, node.args, node.kwargs)
        if key in self.not_relevant:
            return None
        sub, leaves = self.trace_decomposition(op, node.args, node.kwargs, low)
        if sub is None or not self.is_relevant(op, sub, low, 0):
            self.not_relevant.add(key)
            return None
        return self.inline(node, sub, leaves)

    def grad_enabled(self, node: Node) -> bool:
        return not (self.no_grad or in_no_grad(node))

    def trace_decomposition(self, op, args, kwargs, low: torch.dtype) -> tuple[GraphModule | None, list]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, Node)]
        inputs = [flat[i].meta.get("val") for i in positions]

        def decomposed(*vals):
            filled = list(flat)
            for i, v in zip(positions, vals):
                filled[i] = v
            a, k = pytree.tree_unflatten(filled, spec)
            # Pre-dispatch tracing's torch-function mode would re-record `op` itself; calling the
            # CompositeImplicitAutograd kernel without it records its children instead. The C++
            # kernel, as eager runs it: torch's Python decomposition of an op may differ
            # (upsample_bicubic2d.vec becomes index arithmetic in Python, while C++ calls the
            # upsample_bicubic2d kernel, which CPU autocast lists for fp32).
            with torch._C.DisableTorchFunction():
                try:
                    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *a, **k)
                except Exception:
                    return op.decompose(*a, **k)

        try:
            # Under autocast, as in eager: the decomposition's children see autocast's dtypes (a
            # mixed-dtype bmm inside einsum is legal there), while pre-dispatch tracing records
            # them above autocast, so no cast lands in the subgraph; the walk adds graphamp's own.
            with self.fake_mode, ambient_autocast(self.policy.device_type, low):
                sub = make_fx(decomposed, pre_dispatch=True)(*inputs)
        except Exception:
            return None, []
        return sub, [flat[i] for i in positions]

    def is_relevant(self, op, sub: GraphModule, low: torch.dtype, depth: int) -> bool:
        """Whether the decomposition holds a listed op, directly or inside a nested composite."""
        for child in sub.graph.nodes:
            if child.op != "call_function" or not isinstance(child.target, torch._ops.OpOverload):
                continue
            if child.target is op or is_mutating(child.target):
                continue
            if self.policy.category(op_key(child.target)) is not None:
                return True
            if depth < _MAX_DECOMPOSITION_DEPTH and is_decomposable(child.target):
                key = _signature(child.target, low, child.args, child.kwargs)
                if key in self.not_relevant:
                    continue
                inner, _ = self.trace_decomposition(child.target, child.args, child.kwargs, low)
                if inner is not None and self.is_relevant(child.target, inner, low, depth + 1):
                    return True
                self.not_relevant.add(key)
        return False

    def inline(self, node: Node, sub: GraphModule, leaves: list[Node], eager_kernel: str | None = None) -> list[Node]:
        return inline_subgraph(
            self.graph, node, sub.graph, leaves,
            lambda n: {**carried_meta(node, decomposed_from=node.name, eager_kernel=eager_kernel), "val": n.meta.get("val")},
        )


def _signature(op: torch._ops.OpOverload, low: torch.dtype, args: Any, kwargs: Any) -> tuple:
    """What a composite's decomposition can depend on: the op, the dtype, each tensor input's
    dtype/device/rank, and every constant argument (an einsum equation, a dim, a flag)."""

    def describe(leaf: Any) -> Any:
        if isinstance(leaf, Node):
            val = leaf.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("tensor", val.dtype, val.device.type, val.dim())
            return ("value", type(val).__name__)
        return ("const", repr(leaf))

    return (op, low, tuple(describe(leaf) for leaf in pytree.tree_leaves((args, kwargs))))
