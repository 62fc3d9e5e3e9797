"""Refuse a fill value that dynamo's fp32 trace computed and the low dtype cannot hold.

Outside ``torch.autocast`` dynamo traces the model's Python in fp32, so a value the code derives
from a tensor's dtype is fp32's: DeBERTa masks scores with ``torch.finfo(scores.dtype).min``,
-3.4e38, which under autocast fills a bf16 or fp16 tensor. Eager autocast reads the low dtype and
fills its own minimum; the traced value overflows it and the compiled graph raises "value cannot
be converted ... without overflow" at its first call. Caught while compiling, it becomes an error
that names the node and the way out.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from graphamp.errors import PolicyDriftError

__all__ = ["check_fill_values"]

_LOW = (torch.bfloat16, torch.float16)


def _fills(node: Node) -> bool:
    # The ops that convert their scalar to the output dtype with an overflow check.
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and ("fill" in name or "full" in name)


def _overflowing(node: Node) -> float | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in _LOW:
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
