"""Keep parameters' low-precision copies across calls instead of recasting them every forward.

Eager autocast recasts every weight on every call (its cache lives for one autocast region, and
only for weights that require grad). A parameter's cast is a pure function of the parameter, so
graphamp keeps the copy and recomputes it only when the parameter changes, which an in-place
update (``optimizer.step()``, ``load_state_dict``) shows in its version counter and a ``.data``
swap shows in its data pointer. Where the cast must carry a gradient (grad mode on and the
parameter requires grad), it is recomputed each call, once per forward, as eager does.

``freeze_weights`` goes further for inference: a parameter used only through one low-precision
cast is replaced by a low-precision buffer cast once, now.

With ``spec.cache_enabled`` False the copies follow eager's ``torch.autocast(cache_enabled=False)``,
whose casts under ``no_grad`` do not require grad: matmul then takes another kernel (bmm rather
than a folded mm) that rounds fp16 differently. ``WeightCache`` keeps the cached cast's flag, so
``cache_weights`` leaves such a graph's casts as they are (eager recasts every call too), and
``freeze_weights`` freezes buffers that do not require grad.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import weakref

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.graph_edit import attr_of, is_graphamp_cast
from graphamp.node_info import NodeInfo, graph_info, peek
from graphamp.policy import LOW_DTYPES
from graphamp.runtime import WeightCache, cached_cast

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["cache_weights", "freeze_weights", "WEIGHT_CACHE"]

WEIGHT_CACHE = "_graphamp_weights"


def _param_casts(gm: GraphModule) -> list[tuple[Node, Node]]:
    found = []
    for node in gm.graph.nodes:
        if not is_graphamp_cast(node) or node.kwargs["dtype"] not in LOW_DTYPES:
            continue
        src = node.args[0]
        if src.op == "get_attr" and isinstance(attr_of(gm, src.target), nn.Parameter):
            found.append((node, src))
    return found


def cache_weights(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Route every parameter's low-precision cast through a cache that persists across calls."""
    if not spec.cache_enabled:
        return PassResult(gm, False)
    casts = _param_casts(gm)
    if not casts:
        return PassResult(gm, False)
    if not hasattr(gm, WEIGHT_CACHE):
        gm.add_submodule(WEIGHT_CACHE, WeightCache())
    graph = gm.graph
    with graph.inserting_before(casts[0][0]):
        cache = graph.get_attr(WEIGHT_CACHE)
    for cast, src in casts:
        with graph.inserting_before(cast):
            new = graph.create_node("call_function", cached_cast, (cache, src, cast.kwargs["dtype"]), name=cast.name + "_cached")
        new.meta = {**cast.meta, "graphamp": dataclasses.replace(peek(cast), cached=True)}
        cast.replace_all_uses_with(new)
        graph.erase_node(cast)
    graph.lint()
    gm.recompile()
    return PassResult(gm, True)


def freeze_weights(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Replace parameters used only through one low-precision cast by buffers cast once, now."""
    graph = gm.graph
    sources: dict[str, weakref.ref] = graph_info(gm).frozen
    modified = False
    for cast, src in _param_casts(gm):
        if len(src.users) != 1:
            continue  # also used in fp32 (or in another dtype): keep the model's parameter
        param = attr_of(gm, src.target)
        with torch.no_grad():
            low = param.detach().to(cast.kwargs["dtype"])
        # As eager autocast's cached cast under no_grad: it requires grad where the weight does,
        # and matmul picks its kernel by that flag (see runtime.WeightCache.get); an uncached cast
        # (cache_enabled=False) does not.
        low.requires_grad_(param.requires_grad and spec.cache_enabled)
        *path, name = src.target.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        delattr(owner, name)
        owner.register_buffer(name, low)
        sources[src.target] = weakref.ref(param)
        src.meta["val"] = cast.meta.get("val")
        src.meta["graphamp"] = NodeInfo(frozen=True, reason=f"parameter cast to {cast.kwargs['dtype']} once, at conversion")
        cast.replace_all_uses_with(src)
        graph.erase_node(cast)
        modified = True
    if modified:
        graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
