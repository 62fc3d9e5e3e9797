"""The module graphamp returns: a GraphModule with explicit casts and no runtime autocast."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.fx import GraphModule
from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src

from graphamp.capture import ambient_autocast
from graphamp.config import Config
from graphamp.errors import InputMismatchError
from graphamp.passes.cache_weights import WEIGHT_CACHE, cached_cast
from graphamp.passes.dedupe_casts import autocast_cached
from graphamp.passes._infra import attr_of, cast_source, short_dtype, tensor_dtype
from graphamp.passes.inline_regions import set_grad_enabled
from graphamp.policy import Policy
from graphamp.runtime import apply_function

__all__ = ["AmpModule", "AmpInfo", "InputGuard", "emit", "input_signature", "describe_signature"]

_GUARD = "_graphamp_guard"


@dataclass(frozen=True)
class AmpInfo:
    """What a converted module was converted for."""

    device_type: str
    dtype: torch.dtype
    mode: str
    training: bool
    config: Config
    inference: bool = False


class InputGuard(nn.Module):
    """Checks that inputs match what the graph was converted for: dtype, device, rank, sizes.

    Dims that export kept symbolic may vary within their range; other dims, and every dtype,
    are fixed, because the casts were decided for them.
    """

    def __init__(
        self, names: list[str], specs: list[tuple | None], ranges: dict[str, tuple[int, int | None]],
        reasons: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.names = names
        self.specs = specs
        self.ranges = ranges
        self.reasons = reasons or {}  # per size: the model's condition that bounds it, and where

    def forward(self, *inputs: Any) -> None:
        bound: dict[str, int] = {}
        for name, spec, value in zip(self.names, self.specs, inputs):
            if spec is None:
                continue
            dtype, device_type, dims = spec
            if not isinstance(value, torch.Tensor):
                raise InputMismatchError(f"input {name!r}: expected a tensor, got {type(value).__name__}")
            if value.dtype != dtype or value.device.type != device_type or value.dim() != len(dims):
                raise InputMismatchError(
                    f"input {name!r} is {value.dtype} on {value.device.type} with {value.dim()} dims, but the "
                    f"graph was converted for {dtype} on {device_type} with {len(dims)} dims; the casts depend "
                    "on it. Way out: call graphamp.convert again with an example input like this one."
                )
            for i, (dim, size) in enumerate(zip(dims, value.shape)):
                if isinstance(dim, int):
                    if size != dim:
                        raise InputMismatchError(
                            f"input {name!r} dim {i} is {size}, but the converted graph fixed it to {dim} "
                            "(torch.export specialized it while tracing the model's code). Way out: "
                            "convert again with an example of this shape."
                        )
                elif dim in self.ranges:
                    lo, hi = self.ranges[dim]
                    if bound.setdefault(dim, size) != size:
                        raise InputMismatchError(
                            f"input {name!r} dim {i} is {size}, but another input gave {bound[dim]} for the "
                            f"same size {dim}. Way out: pass consistent sizes."
                        )
                    if size < lo or (hi is not None and size > hi):
                        why = getattr(self, "reasons", {}).get(dim)
                        raise InputMismatchError(
                            f"input {name!r} dim {i} is {size}, outside the range [{lo}, {hi or 'inf'}] the "
                            "model's code allows for it"
                            + (f" (the graph was traced where the model's code tested {why})" if why else "")
                            + ". Way out: convert again with an example of this shape."
                        )


_TENSOR = "<tensor>"


def input_signature(args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """The inputs' structure and non-tensor values, which a converted graph fixes (tensor sizes
    and values may vary); keyword order does not matter."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    return spec, tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)


def _plain_arity(args: tuple, kwargs: dict) -> int | None:
    """n when the example was n positional tensors and nothing else: calls like it skip flattening."""
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    return len(args)


def describe_signature(signature: tuple[Any, tuple]) -> str:
    spec, constants = signature
    args, kwargs = pytree.tree_unflatten(list(constants), spec)
    return f"args={args!r} kwargs={kwargs!r}"


def _guard_from(gm: GraphModule) -> InputGuard:
    names, specs = [], []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        names.append(node.name)
        if isinstance(val, torch.Tensor):
            dims = [_dim_spec(d) for d in val.shape]
            specs.append((val.dtype, val.device.type, dims))
        else:
            specs.append(None)
    ranges = {}
    for sym, vr in gm.meta.get("range_constraints", {}).items():
        ranges[str(sym)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    return InputGuard(names, specs, ranges, gm.meta.get("range_reasons"))


def _bound(value: Any) -> int | None:
    """An integer range bound, or None for infinity (sympy's and torch's int_oo)."""
    return int(value) if getattr(value, "is_Integer", False) else None


def _dim_spec(d: int | torch.SymInt) -> int | str:
    """A static size, or the name (or expression) of a symbolic one."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    return int(expr) if expr.is_number else str(expr)


# The functions generated code calls besides torch's ops: a re-trace must record every call.
_RUNTIME_CALLS = (set_grad_enabled, cached_cast, autocast_cached, apply_function)


class _AmpTracer(torch.fx.Tracer):
    """Re-traces a saved AmpModule's code, recording every call of graphamp's runtime functions.

    FX's autowrap records a call only when an argument is traced, so ``set_grad_enabled(False)``
    (constant arguments) would run at trace time and vanish from the graph, and a ``no_grad``
    region would be lost on load. While tracing, those names in the code's globals are bound to
    functions that always record.
    """

    def trace(self, root: Any, concrete_args: Any = None) -> torch.fx.Graph:
        fn = type(root).forward if isinstance(root, nn.Module) else root
        globals_ = fn.__globals__
        bound = {name: value for name, value in globals_.items() if any(value is f for f in _RUNTIME_CALLS)}
        registry = torch.fx._symbolic_trace._wrapped_fns_to_patch
        # Files saved by older versions register these names with FX's wrap(), which would wrap
        # the recording functions again; they are recorded here instead.
        wrapped = {key: registry.pop(key) for key in list(registry) if key[0] == id(globals_) and key[1] in bound}
        for name, value in bound.items():
            globals_[name] = self._recorder(value)
        try:
            return super().trace(root, concrete_args)
        finally:
            globals_.update(bound)
            registry.update(wrapped)

    def _recorder(self, target: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            return self.create_proxy("call_function", target, args, kwargs)

        return record


def _rebuild(body: dict[str, Any], import_block: str) -> AmpModule:
    forward = _forward_from_src(import_block + (body.get("_code") or body["code"]), {})
    return _deserialize_graph_module(forward, body, graph_module_cls=AmpModule)


class AmpModule(GraphModule):
    """A model converted by :func:`graphamp.convert`.

    Its graph (``print(m.code)``) holds every cast explicitly, so it runs with no runtime autocast;
    an ambient ``torch.autocast`` around a call is switched off for the policy's device so the
    policy is never applied twice. Parameters and buffers are the original model's objects.

    >>> import graphamp
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> amp = graphamp.convert(model, (torch.randn(2, 4),))
    >>> assert amp.get_parameter("0.weight") is model[0].weight
    >>> assert amp.cast_summary()["by_dtype"] == {"fp32->bf16": 3}   # input, weight, bias
    >>> assert amp(torch.randn(5, 4)).dtype is torch.bfloat16
    """

    @property
    def graphamp_info(self) -> AmpInfo:
        return self.__dict__["_graphamp"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        info = self.__dict__.get("_graphamp")
        expected = self.__dict__.get("_graphamp_signature")
        arity = self.__dict__.get("_graphamp_arity")
        plain = arity is not None and not kwargs and len(args) == arity and all(isinstance(a, torch.Tensor) for a in args)
        if expected is not None and not plain and input_signature(args, kwargs) != expected:
            raise InputMismatchError(
                "these inputs differ in structure (positional count, keyword names, nesting) or in "
                "non-tensor values from the example the graph was converted for, which it baked in: "
                f"{describe_signature(input_signature(args, kwargs))} vs {describe_signature(expected)}. "
                "Way out: pass the same kind of arguments, or convert again with an example like these."
            )
        if info is not None and info.inference:
            with torch.no_grad():
                return self._call_without_autocast(info, args, kwargs)
        return self._call_without_autocast(info, args, kwargs)

    def _call_without_autocast(self, info: AmpInfo | None, args: tuple, kwargs: dict) -> Any:
        if info is not None and torch.is_autocast_enabled(info.device_type):
            with ambient_autocast(info.device_type, info.dtype, enabled=False):
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def refresh(self) -> None:
        """Recompute the low-precision weight copies from the model's parameters.

        Updates through a parameter itself (``optimizer.step()``, ``load_state_dict``) are seen
        automatically; call this after changing one through ``.data``, which its version counter
        does not see, or to re-cast the weights an ``inference=True`` module froze at conversion.
        """
        cache = getattr(self, WEIGHT_CACHE, None)
        if cache is not None:
            cache.clear()
        for path, source in self.__dict__.get("_graphamp_frozen", {}).items():
            param = source()
            if param is None:
                raise RuntimeError(
                    f"cannot refresh {path}: the model it was converted from is gone. Way out: keep the "
                    "model alive, or load new weights with load_state_dict(model.state_dict())"
                )
            with torch.no_grad():
                self.get_buffer(path).copy_(param)

    def train(self, mode: bool = True) -> AmpModule:
        info = self.__dict__.get("_graphamp")
        if info is not None and bool(mode) != info.training:
            captured = "training" if info.training else "eval"
            raise RuntimeError(
                f"this module was converted in {captured} mode, and dropout and batch-norm behaviour "
                f"is part of its graph. Way out: call model.{'eval' if info.training else 'train'}() "
                "on the original model and graphamp.convert it again."
            )
        return super().train(mode)

    def __reduce__(self) -> tuple:
        _, (body, import_block) = super().__reduce__()
        body["_tracer_cls"] = _AmpTracer
        body.pop("_graphamp_frozen", None)  # weak references to the source model do not travel
        return (_rebuild, (body, import_block))

    def cast_summary(self) -> dict[str, Any]:
        """Counts of graphamp's casts, by (from, to) dtype; how many are weight casts kept across
        calls; weights frozen to low precision; and op nodes by category."""
        casts: collections.Counter = collections.Counter()
        categories: collections.Counter = collections.Counter()
        cached = frozen = 0
        for node in self.graph.nodes:
            info = node.meta.get("graphamp", {})
            if info.get("cast"):
                src, dtype = (node.args[1], node.args[2]) if node.target is cached_cast else cast_source(node)
                casts[f"{short_dtype(tensor_dtype(src))}->{short_dtype(dtype)}"] += 1
                cached += node.target is cached_cast
            frozen += bool(info.get("frozen"))
            if info.get("category"):
                categories[info["category"]] += 1
        return {"casts": sum(casts.values()), "by_dtype": dict(casts), "cached_weight_casts": cached,
                "frozen_weights": frozen, "ops_by_category": dict(categories)}


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    for p in parents:
        if not hasattr(module, p):
            module.add_module(p, nn.Module())
        module = getattr(module, p)
    return module, name


def emit(
    gm: GraphModule, model: nn.Module, policy: Policy, mode: str, config: Config, *,
    inference: bool = False, example: tuple[tuple, dict] | None = None,
) -> AmpModule:
    """Wrap the rewritten graph as an AmpModule whose state is the model's own parameters and buffers."""
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    guard = _guard_from(gm)
    gm.add_submodule(_GUARD, guard)
    if placeholders:
        with graph.inserting_after(placeholders[-1]):
            graph.call_module(_GUARD, tuple(placeholders))
    root = collections.OrderedDict((n.target, attr_of(gm, n.target)) for n in graph.find_nodes(op="get_attr"))
    root[_GUARD] = guard
    amp = AmpModule(root, graph, class_name=type(model).__name__ + "Amp")
    frozen = gm.meta.pop("graphamp_frozen", {})
    amp.meta.update(gm.meta)
    state = model.state_dict(keep_vars=True)
    persistent = set(state)
    for path, buf in model.named_buffers(remove_duplicate=False):
        if path not in persistent:
            state[path] = buf
    for path, value in state.items():
        owner, name = _owner(amp, path)
        if name in owner._parameters or name in owner._buffers:
            continue
        if isinstance(value, nn.Parameter):
            owner.register_parameter(name, value)
        else:
            owner.register_buffer(name, value)
    # Constants lifted by export and non-persistent buffers stay out of state_dict, as in the model.
    for path, _ in list(amp.named_buffers(remove_duplicate=False)):
        if path not in persistent:
            owner, name = _owner(amp, path)
            owner._non_persistent_buffers_set.add(name)
    amp.__dict__["_graphamp"] = AmpInfo(policy.device_type, policy.dtype, mode, model.training, config, inference)
    amp.__dict__["_graphamp_frozen"] = frozen
    if example is not None:
        amp.__dict__["_graphamp_signature"] = input_signature(*example)
        amp.__dict__["_graphamp_arity"] = _plain_arity(*example)
    nn.Module.train(amp, model.training)
    amp.recompile()
    return amp
