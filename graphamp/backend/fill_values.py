"""Refuse what dynamo's fp32 trace computed where the compiled graph would fail at its first call:
a fill value the low dtype cannot hold, and a tensor of another dtype than the source an index op
writes into it.

Outside ``torch.autocast`` dynamo traces the model's Python in fp32, so a value the code derives
from a tensor's dtype is fp32's: DeBERTa masks scores with ``torch.finfo(scores.dtype).min``,
-3.4e38, which under autocast fills a bf16 or fp16 tensor. Eager autocast reads the low dtype and
fills its own minimum; the traced value overflows it and the compiled graph raises "value cannot
be converted ... without overflow" at its first call. Caught while compiling, it becomes an error
that names the node and the way out.

The same trace chooses a tensor's dtype in Python (``torch.zeros(n, d)`` on one branch,
``h.new_zeros(n, d)`` on the other), and JetMoE-style routed sums then ``index_add`` a
low-precision source into an fp32 tensor: the kernel refuses mixed dtypes ("self and source must
have the same scalar type"), but torch's fake kernels for the index ops do not check, so the graph
compiles and fails at its first call.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from graphamp.errors import PolicyDriftError
from graphamp.policy import LOW_DTYPES

__all__ = ["check_fill_values", "check_index_sources"]


def _fills(node: Node) -> bool:
    # The ops that convert their scalar to the output dtype with an overflow check.
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and ("fill" in name or "full" in name)


def _overflowing(node: Node) -> float | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in LOW_DTYPES:
        return None
    limit = torch.finfo(val.dtype).max
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, float) and math.isfinite(arg) and abs(arg) > limit:
            return arg
    return None


def check_fill_values(gm: GraphModule, *, device_type: str, dtype: torch.dtype) -> None:
    """Raise PolicyDriftError at the first fill of a low-precision tensor with a value beyond its range.

    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> x.meta["val"] = torch.empty(2, dtype=torch.bfloat16)
    >>> fill = g.call_function(torch.ops.aten.fill.Scalar, (x, -3.4028234663852886e38))
    >>> fill.meta["val"] = torch.empty(2, dtype=torch.bfloat16)
    >>> try:
    ...     check_fill_values(GraphModule(torch.nn.Module(), g), device_type="cpu", dtype=torch.bfloat16)
    ... except PolicyDriftError as e:
    ...     assert "torch.autocast('cpu', dtype=torch.bfloat16)" in str(e)
    """
    check_index_sources(gm, device_type=device_type, dtype=dtype)
    for node in gm.graph.nodes:
        value = _overflowing(node) if _fills(node) else None
        if value is None:
            continue
        low = node.meta["val"].dtype
        raise PolicyDriftError(
            f"node {node.format_node()} fills a {low} tensor with {value:g}, beyond {low}'s range: "
            "dynamo traced forward's Python without autocast, so a value the code takes from a "
            f"tensor's dtype (torch.finfo(x.dtype).min, ...) is fp32's, where eager autocast takes {low}'s. "
            f"Way out: call the compiled model inside torch.autocast({device_type!r}, dtype={dtype}); "
            "graphamp's casts stay the only ones applied."
        )


# The index ops whose kernels require the source's dtype to be the written tensor's, and which
# argument is the source. Their fake kernels accept any dtype (torch 2.13).
_SOURCE_ARG = {"index_add": 3, "index_copy": 3, "index_reduce": 3, "index_put": 2, "_index_put_impl": 2, "put": 2}


def _index_op_source(node: Node) -> Node | None:
    """The source argument of an index op that writes it into its first argument, or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    position = _SOURCE_ARG.get(node.target._schema.name.split("::")[-1].rstrip("_"))
    if position is None or len(node.args) <= position or not isinstance(node.args[position], Node):
        return None
    return node.args[position]


def _dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def check_index_sources(gm: GraphModule, *, device_type: str, dtype: torch.dtype) -> None:
    """Raise PolicyDriftError at the first index op (index_add, index_copy, index_put, put) whose
    source has another dtype than the tensor it writes into.

    >>> g = torch.fx.Graph()
    >>> out, idx, src = g.placeholder("out"), g.placeholder("idx"), g.placeholder("src")
    >>> out.meta["val"], src.meta["val"] = torch.empty(3, 4), torch.empty(2, 4, dtype=torch.bfloat16)
    >>> _ = g.call_function(torch.ops.aten.index_add.default, (out, 0, idx, src))
    >>> try:
    ...     check_index_sources(GraphModule(torch.nn.Module(), g), device_type="cpu", dtype=torch.bfloat16)
    ... except PolicyDriftError as e:
    ...     assert "index_add" in str(e) and "torch.autocast('cpu', dtype=torch.bfloat16)" in str(e)
    """
    for node in gm.graph.nodes:
        source = _index_op_source(node)
        if source is None or not isinstance(node.args[0], Node):
            continue
        written, given = _dtype(node.args[0]), _dtype(source)
        if written is None or given is None or written == given or not (written.is_floating_point and given.is_floating_point):
            continue
        raise PolicyDriftError(
            f"node {node.format_node()} writes a {given} source into a {written} tensor, which the "
            f"{node.target._schema.name} kernel refuses (self and source must have the same dtype; the "
            "graph would fail at its first call): dynamo traced forward's Python without autocast, so "
            f"the {written} tensor's dtype was chosen as in fp32 (torch.zeros(...) where eager autocast's "
            f"Python makes a {given} one). Way out: call the compiled model inside "
            f"torch.autocast({device_type!r}, dtype={dtype}); graphamp's casts stay the only ones applied."
        )
