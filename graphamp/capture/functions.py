"""Kept custom autograd Functions: each ``Function.apply`` recorded as one node that runs it whole."""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._ops import _get_dispatch_mode_pre_dispatch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode, track_tensor_tree
from torch.utils import _pytree as pytree

from graphamp.errors import GraphampError, UnsupportedFunctionError
from graphamp.node_info import NodeInfo
from graphamp.runtime import KeptFunction, PartialTemplate, Slot, apply_function, current_autocast_state, qualified_name


# The node a kept Function call is recorded as while exporting: a callable export's verifier
# allows (torch's own stand-in for custom Functions in pre-dispatch graphs), whose first argument
# here is graphamp's key for the call. capture() rebinds every such node before returning.
_RECORDED = torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_PATCH_LOCK = threading.Lock()
_patch_users = 0
_active = threading.local()


class _FunctionKeeper:
    """While exporting in this thread, records every custom ``autograd.Function`` call as one node.

    ``Function.apply`` is patched for the duration (torch 2.13 offers no hook for it other than
    decorating each Function class); calls from other threads, from inside a kept Function's
    forward, or outside export's tracer go to the original. ``keep=False`` (a program for
    ``graphamp.export``, which never runs backward and may not call graphamp) keeps none: each
    Function's forward is traced through under ``no_grad``, as eager runs it.
    """

    def __init__(self, keep: bool = True) -> None:
        self.kept: dict[str, KeptFunction] = {}
        self.busy = False
        self.keep = keep

    def __enter__(self) -> _FunctionKeeper:
        global _patch_users
        with _PATCH_LOCK:
            if _patch_users == 0:
                torch.autograd.Function.apply = classmethod(_recording_apply)
            _patch_users += 1
        self.outer = getattr(_active, "keeper", None)
        _active.keeper = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _patch_users
        _active.keeper = self.outer
        with _PATCH_LOCK:
            _patch_users -= 1
            if _patch_users == 0:
                torch.autograd.Function.apply = _ORIGINAL_APPLY

    def record(self, cls: type, apply: Callable[..., Any], tracer: Any, args: tuple, kwargs: dict) -> Any:
        name = qualified_name(cls)
        template, values = _split((args, kwargs))
        if not values or not self.keep:
            # No tensor in, so no gradient out (or no backward will run): eager's outputs do not
            # require grad, and its forward's ops are all there is to reproduce. Traced through
            # under no_grad, as eager runs a Function's forward, they get graphamp's casts like any other ops.
            with torch.no_grad():
                return apply(*args, **kwargs)
        hidden = [h for v in _constants(template) for h in _hidden_tensors(v)]
        if hidden:
            raise UnsupportedFunctionError(
                f"graphamp cannot keep the custom autograd.Function {name} with its own backward: an "
                f"argument of {cls.__name__}.apply hides tensors computed in forward ({'; '.join(hidden)}), "
                "whose values the converted graph could not pass in. Way out: pass those tensors as "
                f"arguments of {cls.__name__}.apply (for checkpoint: checkpoint(fn, *tensors))."
            )
        states, cache_enabled = current_autocast_state()
        self.busy = True
        try:
            with below_tracer():
                out = apply(*args, **kwargs)
        except GraphampError:
            raise
        except Exception as e:
            if "unsafe to autocast" in str(e) or "at::autocast::prioritize" in str(e):
                raise  # capture() turns these into BannedOpError / PromoteTypeError, as for any op
            cause = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
            raise UnsupportedFunctionError(
                f"graphamp keeps the custom autograd.Function {name} whole, so that autograd calls "
                "its own backward, and needs its forward to run on fake tensors (shapes and dtypes "
                f"only) to do so; it failed there: {cause}. Way out: keep tensor values out of the "
                "forward's Python (no .item(), .tolist(), numpy or branches on values), or call the "
                "Function outside the converted module."
            ) from e
        finally:
            self.busy = False
        _check_outputs(out, name)
        key = f"{name}#{len(self.kept)}"
        self.kept[key] = KeptFunction(cls, template, states, cache_enabled)
        proxy = tracer.create_proxy("call_function", _RECORDED, (key, *(tracer.unwrap_proxy(v) for v in values)), {})
        track_tensor_tree(out, proxy, constant=None, tracer=tracer)
        return out


def _recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    apply = _ORIGINAL_APPLY.__get__(None, cls)
    keeper = getattr(_active, "keeper", None)
    if keeper is None or keeper.busy:
        return apply(*args, **kwargs)
    mode = _get_dispatch_mode_pre_dispatch(torch._C._TorchDispatchModeKey.PROXY)
    if mode is None or not mode.pre_dispatch:
        return apply(*args, **kwargs)
    return keeper.record(cls, apply, mode.tracer, args, kwargs)


@contextlib.contextmanager
def below_tracer() -> Iterator[None]:
    """Run code below export's pre-dispatch tracer: ops reach autocast and fake tensors, unrecorded.

    The same dispatch-key switch as torch._export.wrappers.allow_in_pre_dispatch_graph; the
    tracer's torch-function mode is lifted too, or the Function's own ``torch.autocast`` and
    ``no_grad`` regions (custom_fwd, checkpoint) would leave markers in the graph.
    """
    include = torch._C._dispatch_tls_local_include_set().remove(torch._C.DispatchKey.PreDispatch)
    exclude = torch._C._dispatch_tls_local_exclude_set() | torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)
    stack = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    kept = [m for m in stack if not isinstance(m, PreDispatchTorchFunctionMode)]
    for mode in kept:
        torch._C._push_on_torch_function_stack(mode)
    try:
        with torch._C._ForceDispatchKeyGuard(include, exclude):
            yield
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for mode in stack:
            torch._C._push_on_torch_function_stack(mode)


def _is_graph_value(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))


def _split(value: Any) -> tuple[Any, list[Any]]:
    """``value`` with a :class:`~graphamp.runtime.Slot` for every tensor or symbolic size, and
    those values in order. Tuples, lists, dicts and ``functools.partial`` are looked into."""
    values: list[Any] = []

    def walk(obj: Any) -> Any:
        if _is_graph_value(obj):
            values.append(obj)
            return Slot(len(values) - 1)
        if isinstance(obj, tuple):
            parts = [walk(o) for o in obj]
            return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
        if type(obj) is list:
            return [walk(o) for o in obj]
        if type(obj) is dict:
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, functools.partial):
            return PartialTemplate(type(obj), walk(obj.func), walk(obj.args), walk(obj.keywords))
        return obj

    return walk(value), values


def _constants(template: Any) -> Iterator[Any]:
    if isinstance(template, (tuple, list)) and not isinstance(template, Slot):
        for t in template:
            yield from _constants(t)
    elif isinstance(template, dict):
        for t in template.values():
            yield from _constants(t)
    elif not isinstance(template, Slot):
        yield template


def _hidden_tensors(obj: Any) -> list[str]:
    """Tensors inside a constant argument, which the graph could not pass in at run time: in a
    container graphamp does not look into, or in a function's closure."""
    if isinstance(obj, (nn.Module, type)):
        return []  # a module's parameters and buffers are the model's own, live at run time
    func = getattr(obj, "__func__", obj)
    if isinstance(func, types.FunctionType):
        found = []
        for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(contents)):
                found.append(f"{func.__qualname__} closes over {name!r}")
        return found
    if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(obj)):
        return [f"a {type(obj).__name__} holds tensors"]
    return []


def _check_outputs(out: Any, name: str) -> None:
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    for leaf in leaves:
        if not (isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (bool, int, float, str, torch.SymInt, torch.SymFloat, torch.SymBool))):
            raise UnsupportedFunctionError(
                f"graphamp cannot keep the custom autograd.Function {name} whole: its forward returns "
                f"a {type(leaf).__name__}, and a kept Function's outputs must be tensors (or plain "
                "numbers) in a tuple. Way out: return the tensors as a flat tuple."
            )


def _bind_kept_functions(gm: GraphModule, kept: dict[str, KeptFunction]) -> None:
    """Turn each recorded Function node into ``apply_function(<KeptFunction attribute>, ...)``.

    A call inside a region written in forward (``torch.autocast``, ``no_grad``) sits in the region's
    subgraph; the KeptFunction reaches it as one more operand of the region, level by level.
    """
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    attrs: dict[str, Node] = {}

    def top_level(key: str) -> Node:
        if key not in attrs:
            function = kept[key].function
            base = "_graphamp_" + _snake(function.__name__)
            name = base
            for i in range(1, 1 << 20):
                if not hasattr(gm, name):
                    break
                name = f"{base}_{i}"
            gm.add_submodule(name, kept[key])
            with gm.graph.inserting_before(first):
                attrs[key] = gm.graph.get_attr(name)
            attrs[key].meta["val"] = kept[key]
        return attrs[key]

    _bind_in(gm, kept, top_level)
    gm.graph.lint()
    gm.recompile()


def _snake(name: str) -> str:
    """``MatMul`` -> ``mat_mul``, ``STE`` -> ``ste``: names for a kept Function's nodes."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _recorded_keys(gm: GraphModule, kept: dict[str, KeptFunction]) -> list[str]:
    keys = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _RECORDED and node.args and node.args[0] in kept:
            keys.append(node.args[0])
        for sub in _subgraphs(gm, node):
            keys.extend(k for k in _recorded_keys(sub, kept) if k not in keys)
    return keys


def _subgraphs(gm: GraphModule, node: Node) -> list[GraphModule]:
    return [
        getattr(gm, a.target) for a in node.args
        if isinstance(a, Node) and a.op == "get_attr" and isinstance(getattr(gm, a.target, None), GraphModule)
    ]


_REGION_OPS = (torch.ops.higher_order.wrap_with_autocast, torch.ops.higher_order.wrap_with_set_grad_enabled)


def _bind_in(gm: GraphModule, kept: dict[str, KeptFunction], source: Callable[[str], Node]) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _RECORDED and node.args and node.args[0] in kept:
            key = node.args[0]
            with gm.graph.inserting_before(node):
                call = gm.graph.create_node(
                    "call_function", apply_function, (source(key), *node.args[1:]), {}, name=_snake(kept[key].function.__name__)
                )
            call.meta = node.meta
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            states = ", ".join(f"{s.device_type} {s.dtype}" for s in kept[key].autocast if s.enabled) or "off"
            call.meta["graphamp"] = NodeInfo(
                reason=f"custom autograd.Function {qualified_name(kept[key].function)}, run whole with "
                f"its own backward under eager's autocast state there ({states})",
            )
            continue
        subs = _subgraphs(gm, node)
        keys = [k for sub in subs for k in _recorded_keys(sub, kept)]
        if not keys:
            continue
        if node.target not in _REGION_OPS or len(subs) != 1:
            name = qualified_name(kept[keys[0]].function)
            raise UnsupportedFunctionError(
                f"graphamp cannot keep the custom autograd.Function {name}: it is called inside "
                f"{node.format_node()}, a higher-order op graphamp does not rewrite. Way out: call it "
                "outside that construct."
            )
        sub = subs[0]
        last = ([n for n in sub.graph.nodes if n.op == "placeholder"] or [None])[-1]
        inner: dict[str, Node] = {}
        for key in dict.fromkeys(keys):
            where = sub.graph.inserting_after(last) if last is not None else sub.graph.inserting_before(next(iter(sub.graph.nodes)))
            with where:
                last = inner[key] = sub.graph.placeholder(f"kept_{len(inner)}")
            inner[key].meta["val"] = kept[key]
            node.args = (*node.args, source(key))
        _bind_in(sub, kept, inner.__getitem__)
        sub.graph.lint()
        sub.recompile()

