"""Call SDPA with grouped key/value heads where eager did, instead of the traced head repetition.

Some model code runs a different attention program when traced than in eager. transformers'
SDPA integration is the common case: in eager, with no padding mask, it calls
``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` on the grouped key and
value heads; while traced (torch.export, torch.compile) it materialises the mask and repeats the
heads itself (``repeat_kv``: unsqueeze, expand, reshape). Both give bitwise the same forward, but
not the same gradients: SDPA's grouped backward sums a group's key/value gradients once, in its
accumulator, where the repeated heads' gradients are rounded to the low dtype first and summed
after. Eager autocast is the reference, so where eager called SDPA with ``enable_gqa`` on the
example (observed by :func:`graphamp.probe.eager_sdpa_calls`), the matching traced call is given
the grouped heads and ``enable_gqa=True``. The forward is unchanged (same values, any mask), so no
input can make the rewrite wrong; it only restores eager's gradient rounding. Which call eager makes
depends on the mask's values it reads; convert guards that read (``capture.values.guard_eager_reads``),
so a mask that takes the other path gets a graph of its own, following eager's call for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.graph_edit import carried_meta, fake_mode_of, recompute_val, val_of
from graphamp.node_info import GraphInfo, info, peek_graph_info

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["follow_eager_attention", "repeated_heads"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def repeated_heads(node: Node) -> tuple[Node, int] | None:
    """(grouped tensor, repeats) if ``node`` is ``x[:, :, None].expand(..., n, ...).reshape(...)``
    over a (..., heads, 1, seq, dim) tensor, the repeat_kv idiom; else None."""
    if node.op != "call_function" or node.target not in (aten.reshape.default, aten.view.default):
        return None
    expand = node.args[0]
    if not isinstance(expand, Node) or expand.target is not aten.expand.default:
        return None
    grouped = expand.args[0]
    val, out, expanded = val_of(grouped), val_of(node), val_of(expand)
    if not all(isinstance(t, torch.Tensor) for t in (val, out, expanded)):
        return None
    if val.dim() != 5 or out.dim() != 4 or val.shape[2] != 1:
        return None
    heads, repeats = val.shape[1], expanded.shape[2]
    if out.shape[1] != heads * repeats or out.shape[2:] != val.shape[3:] or out.shape[0] != val.shape[0]:
        return None
    return grouped, int(repeats)


def _erase_if_dead(gm: GraphModule, node: Node) -> None:
    """Erase the now unused repetition (reshape, expand), leaving what else still uses its input."""
    while node.op == "call_function" and node.target in (aten.reshape.default, aten.view.default, aten.expand.default) and not node.users:
        source = node.args[0]
        gm.graph.erase_node(node)
        node = source


def follow_eager_attention(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Give each SDPA call the grouped key/value heads and ``enable_gqa`` where eager did."""
    eager = (peek_graph_info(gm) or GraphInfo()).eager_sdpa
    nodes = list(gm.graph.find_nodes(op="call_function", target=SDPA))
    if not eager or len(eager) != len(nodes):
        return PassResult(gm, False)
    fake_mode = fake_mode_of(gm)
    modified = False
    for node, call in zip(nodes, eager):
        key, value = repeated_heads(node.args[1]), repeated_heads(node.args[2])
        if not call.enable_gqa or node.kwargs.get("enable_gqa"):
            continue
        if key is None or value is None or key[1] != value[1] or val_of(key[0]).shape[1] != call.kv_heads:
            continue
        with gm.graph.inserting_before(node):
            grouped = [gm.graph.call_function(aten.squeeze.dim, (src, 2)) for src, _ in (key, value)]
        for new in grouped:
            new.meta = carried_meta(node)
            new.meta["val"] = recompute_val(new, fake_mode)
        repeated = node.args[1:3]
        node.args = (node.args[0], *grouped, *node.args[3:])
        for old in repeated:
            _erase_if_dead(gm, old)
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        info(node).attention = (
            f"grouped key/value heads with enable_gqa=True, as eager called it (traced code repeated them {key[1]}x)"
        )
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
