"""Take floating inputs in fp32 and return low-precision floating outputs in fp32 (``keep_io_types``).

A deployed mixed-precision model usually sits behind an fp32 interface: the caller's tensors are
fp32 and so should its results be (the ONNX float16 converter's and TF's option of the same name).
Autocast itself only casts what ops consume, so its outputs are often bf16/fp16. This pass makes
the interface fp32 with explicit casts at the graph's edges: an input the example gave in a low
dtype becomes an fp32 placeholder cast to that dtype inside, as ``x.to(dtype)`` would; a low
output is cast to fp32 on its way out. Values equal eager autocast's (its outputs ``.float()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.graph_edit import fake_mode_of, insert_cast
from graphamp.policy import LOW_DTYPES

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["keep_io_types"]


def _low(node: object) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val.dtype if isinstance(val, torch.Tensor) and val.dtype in LOW_DTYPES else None


def keep_io_types(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Cast low-precision floating inputs from fp32 inside the graph, and low outputs to fp32.

    >>> import graphamp
    >>> from torch import nn
    >>> amp = graphamp.convert(nn.Linear(4, 4), (torch.randn(2, 4, dtype=torch.bfloat16),), keep_io_types=True)
    >>> assert amp(torch.randn(3, 4)).dtype is torch.float32
    """
    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    modified = False
    placeholders = graph.find_nodes(op="placeholder")
    first = placeholders[-1].next if placeholders else None
    for node in placeholders:
        dtype = _low(node)
        if dtype is None:
            continue
        users = list(node.users)
        with fake_mode:
            node.meta["val"] = node.meta["val"].to(torch.float32)
        cast = insert_cast(graph, node, dtype, first, fake_mode, f"keep_io_types: the fp32 input cast to {dtype}, as the example gave it")
        for user in users:
            user.replace_input_with(node, cast)
        modified = True
    output = graph.find_nodes(op="output")[0]
    casts: dict[Node, Node] = {}

    def to_fp32(arg: Node) -> Node:
        if _low(arg) is None:
            return arg
        if arg not in casts:
            casts[arg] = insert_cast(graph, arg, torch.float32, output, fake_mode, "keep_io_types: a low-precision output returned in fp32")
        return casts[arg]

    output.args = torch.fx.node.map_arg(output.args, to_fp32)
    modified |= bool(casts)
    if modified:
        graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
