"""Keep one cast per (value, dtype) wherever sharing it cannot change a result.

Sharing a cast changes the backward pass: autograd then sums the consumers' gradients in the
low dtype before casting up once, where separate casts sum them in fp32. So exact mode shares:

* casts of parameters that require grad, fp32 -> low: eager autocast caches exactly these
  (``cached_cast`` in autocast_mode.cpp), so it shares them too, and gradients match only if we do;
* casts of values that can never require grad (buffers, constants, integer inputs and what is
  computed from them alone, anything under ``no_grad``): their backward does not exist.

Eager's cache also covers a float32 *input* that is a leaf requiring grad (not a view). Whether an
input is one is known only at call time, so a floating input's later casts become
:func:`graphamp.runtime.autocast_cached` calls, which reuse the forward's first cast exactly when eager would.

Activations that may carry gradients keep one cast per consumer, as eager does.

With ``spec.cache_enabled`` False (``torch.autocast(cache_enabled=False)``, as PyTorch Lightning
runs it) eager caches nothing: parameters and inputs keep one cast per use, and only casts no
gradient can tell apart are shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.grad_analysis import grad_free_nodes, in_no_grad
from graphamp.passes.graph_edit import attr_of, carried_meta, cast_source, has_mutating_user, is_graphamp_cast, tensor_dtype
from graphamp.node_info import peek
from graphamp.policy import LOW_DTYPES
from graphamp.runtime import autocast_cached

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["dedupe_casts"]


def _is_cached_param_cast(gm: GraphModule, cast: Node) -> bool:
    src = cast.args[0]
    if src.op != "get_attr" or cast.kwargs["dtype"] not in LOW_DTYPES:
        return False
    attr = attr_of(gm, src.target)
    return isinstance(attr, nn.Parameter) and attr.requires_grad and attr.dtype is torch.float32


def _is_input_cast(cast: Node) -> bool:
    src = cast.args[0]
    return src.op == "placeholder" and tensor_dtype(src) is torch.float32 and cast.kwargs["dtype"] in LOW_DTYPES


def dedupe_casts(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Merge casts of one value to one dtype where eager shares them or no gradient can tell.

    ``spec.inference`` declares the module will never be differentiated, so every cast is shared.
    ``spec.cache_enabled`` False shares no cast that a gradient could tell apart, as eager's
    ``torch.autocast(cache_enabled=False)`` caches none.
    """
    cache = spec.cache_enabled
    free = grad_free_nodes(gm, no_grad=spec.inference)
    first: dict[tuple, Node] = {}
    first_input: dict[tuple, Node] = {}
    modified = False
    for node in list(gm.graph.nodes):
        # Only plain casts: cache_weights' cached casts are casts too, but of another form.
        if not is_graphamp_cast(node) or cast_source(node) is None or has_mutating_user(node):
            continue
        src = node.args[0]
        # A cast made under no_grad carries no autograd history; it must not serve a consumer outside.
        key = (src, node.kwargs["dtype"], in_no_grad(node))
        if src in free or (cache and _is_cached_param_cast(gm, node)):
            kept = first.setdefault(key, node)
            if kept is not node:
                node.replace_all_uses_with(kept)
                gm.graph.erase_node(node)
                modified = True
        elif cache and _is_input_cast(node):
            kept = first_input.setdefault(key, node)
            if kept is not node:
                with gm.graph.inserting_before(node):
                    shared = gm.graph.call_function(autocast_cached, (src, kept, node.kwargs["dtype"]))
                reason = f"{peek(node).reason}; reuses {kept.name} where eager autocast's cache would"
                shared.meta = {**carried_meta(node, reason=reason), "val": node.meta.get("val")}
                node.replace_all_uses_with(shared)
                gm.graph.erase_node(node)
                modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
