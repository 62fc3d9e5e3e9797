"""Keep parameters' low-precision copies across calls instead of recasting them every forward.

Eager autocast recasts every weight on every call (its cache lives for one autocast region, and
only for weights that require grad). A parameter's cast is a pure function of the parameter, so
graphamp keeps the copy and recomputes it only when the parameter changes, which an in-place
update (``optimizer.step()``, ``load_state_dict``) shows in its version counter and a ``.data``
swap shows in its data pointer. Where the cast must carry a gradient (grad mode on and the
parameter requires grad), it is recomputed each call, once per forward, as eager does.

``freeze_weights`` goes further for inference: a parameter used only through one low-precision
cast is replaced by a low-precision buffer cast once, now.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes._infra import GRAPHAMP, attr_of, is_graphamp_cast

__all__ = ["WeightCache", "cached_cast", "cache_weights", "freeze_weights", "WEIGHT_CACHE"]

WEIGHT_CACHE = "_graphamp_weights"
_LOW = (torch.float16, torch.bfloat16)


class WeightCache(nn.Module):
    """Low-precision copies of parameters, keyed by (parameter, dtype), stamped with its version."""

    def __init__(self) -> None:
        super().__init__()
        # (id(param), dtype) -> (version, data_ptr, low copy)
        self._entries: dict[tuple[int, torch.dtype], tuple[int, int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # This runs once per weight per call, so it stays lean: one dict lookup, two reads.
        key = (id(param), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0] == param._version and entry[1] == param.data_ptr():
            return entry[2]
        if isinstance(param, FakeTensor):  # no data to reuse (fake CUDA checks): cast as eager does
            return torch.ops.aten._to_copy.default(param, dtype=dtype)
        stamp = (param._version, param.data_ptr())
        # A normal tensor even under inference_mode, so a later grad-mode call may save it.
        with torch.inference_mode(False), torch.no_grad():
            low = param.detach().to(dtype)
        with self._lock:
            self._entries[key] = (*stamp, low)
        return low

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_entries"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> WeightCache:
        return WeightCache()


def cached_cast(cache: WeightCache, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``param`` cast to ``dtype``, reusing the copy of an earlier call while ``param`` is unchanged."""
    if param.requires_grad and torch.is_grad_enabled():
        return torch.ops.aten._to_copy.default(param, dtype=dtype)
    return cache.get(param, dtype)


def _param_casts(gm: GraphModule) -> list[tuple[Node, Node]]:
    found = []
    for node in gm.graph.nodes:
        if not is_graphamp_cast(node) or node.kwargs["dtype"] not in _LOW:
            continue
        src = node.args[0]
        if src.op == "get_attr" and isinstance(attr_of(gm, src.target), nn.Parameter):
            found.append((node, src))
    return found


def cache_weights(gm: GraphModule) -> PassResult:
    """Route every parameter's low-precision cast through a cache that persists across calls."""
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
        new.meta = dict(cast.meta)
        new.meta[GRAPHAMP] = {**cast.meta[GRAPHAMP], "cached": True}
        cast.replace_all_uses_with(new)
        graph.erase_node(cast)
    graph.lint()
    gm.recompile()
    return PassResult(gm, True)


def freeze_weights(gm: GraphModule) -> PassResult:
    """Replace parameters used only through one low-precision cast by buffers cast once, now."""
    graph = gm.graph
    sources: dict[str, weakref.ref] = gm.meta.setdefault("graphamp_frozen", {})
    modified = False
    for cast, src in _param_casts(gm):
        if len(src.users) != 1:
            continue  # also used in fp32 (or in another dtype): keep the model's parameter
        param = attr_of(gm, src.target)
        with torch.no_grad():
            low = param.detach().to(cast.kwargs["dtype"])
        *path, name = src.target.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        del owner._parameters[name]
        owner.register_buffer(name, low)
        sources[src.target] = weakref.ref(param)
        src.meta["val"] = cast.meta.get("val")
        src.meta[GRAPHAMP] = {"frozen": True, "reason": f"parameter cast to {cast.kwargs['dtype']} once, at conversion"}
        cast.replace_all_uses_with(src)
        graph.erase_node(cast)
        modified = True
    if modified:
        graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
