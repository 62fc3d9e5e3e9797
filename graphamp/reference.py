"""Eager-autocast reference graphs, recorded with ``make_fx``, to compare graphamp against.

Tracing below autocast (post-dispatch ``make_fx``) records every cast eager autocast makes as an
``aten._to_copy``; lowering a converted module the same way (autocast off) gives a comparable graph.
These graphs are for checking only: graphamp itself inserts casts from its own tables.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from graphamp.capture import ambient_autocast

__all__ = ["eager_autocast_graph", "lowered_graph", "count_casts", "trace"]


def count_casts(gm: torch.fx.GraphModule) -> int:
    """Number of ``aten._to_copy`` nodes, the op every autocast cast lowers to."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default)


def trace(fn: Any, args: tuple, kwargs: dict, *, no_grad: bool = True) -> torch.fx.GraphModule:
    """The post-dispatch graph of ``fn(*args, **kwargs)``, its tensor inputs as placeholders."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def flat_fn(*vals: torch.Tensor) -> list:
        filled = list(flat)
        for i, v in zip(tensors, vals):
            filled[i] = v
        a, k = pytree.tree_unflatten(filled, spec)
        return pytree.tree_leaves(fn(*a, **k))

    with torch.set_grad_enabled(not no_grad):
        # Real tensors: data-dependent Python branches (mask checks in HF models) read real values.
        return make_fx(flat_fn, _error_on_data_dependent_ops=False)(*[flat[i] for i in tensors])


def eager_autocast_graph(model: nn.Module, args: tuple, kwargs: dict | None, *, device_type: str, dtype: torch.dtype) -> torch.fx.GraphModule:
    """The post-dispatch graph of ``model`` run under eager autocast: its casts are autocast's."""

    def run(*a: Any, **k: Any) -> Any:
        with ambient_autocast(device_type, dtype):
            return model(*a, **k)

    return trace(run, args, kwargs or {})


def lowered_graph(module: nn.Module, args: tuple, kwargs: dict | None) -> torch.fx.GraphModule:
    """The post-dispatch graph of a converted module, with autocast off."""
    return trace(module, args, kwargs or {})

