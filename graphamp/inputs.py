"""What a converted module fixes about its inputs, and checks on every call.

* The structure and non-tensor values its graph baked in (:func:`input_signature`; tensor sizes
  and values may vary), compared before the graph runs.
* The dtypes, devices, ranks and sizes its casts were decided for, as the runtime's
  :class:`~graphamp.runtime.InputGuard` the graph calls first (:func:`input_guard`).
* The all-ones masks it may pass as None where eager autocast runs the same program without them
  (:func:`all_ones_key`, under the module's :data:`ALL_ONES_AS_NONE` and :data:`ALL_ONES_PROVEN`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.node_info import GraphInfo, peek_graph_info
from graphamp.runtime import InputGuard

__all__ = [
    "ALL_ONES_AS_NONE",
    "CACHE_WAY_OUT",
    "ALL_ONES_PROVEN",
    "MAX_ALL_ONES_PROVEN",
    "all_ones_key",
    "describe_signature",
    "input_guard",
    "input_signature",
    "is_all_ones",
    "key_value_cache",
    "plain_arity",
]

# Keyword inputs passed as None when all ones: convert found eager's program for an all-ones mask is
# the one it runs without the mask (the model drops it by value), and checked it (convert.py).
ALL_ONES_AS_NONE = "_graphamp_all_ones_as_none"
# {(training, ((name, mask shape), ...)): bool}: whether eager autocast was seen to run the same
# program for these all-ones masks as without them. The example's entry is proven by convert's
# self-check; every other is checked once, on first use, by running eager both ways.
ALL_ONES_PROVEN = "_graphamp_all_ones_proven"
MAX_ALL_ONES_PROVEN = 64  # past this many mask shapes, all-ones masks are passed as given

_TENSOR = "<tensor>"
# What a refusal of a key/value cache among the inputs adds (key_value_cache).
CACHE_WAY_OUT = (
    "The model writes each call's keys and values into the cache in place, which a converted graph "
    "cannot do (it would leave your cache as it was), so graphamp does not run the model on it. Way out: "
    "call without a cache (use_cache=False), as scoring, evaluation and training do; for generation, "
    "compile the model instead: torch.compile(model, backend=\"graphamp\", options={\"inner\": \"eager\"}) "
    "or graphamp.integrations.transformers.compile (docs/integrations.md)."
)


def input_signature(args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """The inputs' structure and non-tensor values, which a converted graph fixes (tensor sizes
    and values may vary); keyword order does not matter.

    >>> assert input_signature((torch.ones(2), 3), {}) == input_signature((torch.zeros(5), 3), {})
    """
    leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in sorted(kwargs)}))
    return spec, tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)


def describe_signature(signature: tuple[Any, tuple]) -> str:
    spec, constants = signature
    args, kwargs = pytree.tree_unflatten(list(constants), spec)
    return f"args={args!r} kwargs={kwargs!r}"


def key_value_cache(args: tuple, kwargs: dict) -> str | None:
    """Where the inputs hold a transformers key/value cache (a ``Cache``: ``DynamicCache``, ...),
    which the model writes new keys and values into in place at every call: the argument, in words;
    None where they hold none.

    >>> assert key_value_cache((torch.ones(2),), {"use_cache": False}) is None
    """
    leaves = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)), is_leaf=_is_cache)[0]
    for path, leaf in leaves:
        if _is_cache(leaf):
            where = f"{path[1].key}=" if path[0].idx == 1 else f"positional argument {path[1].idx}"
            return f"{where}{pytree.keystr(path[2:])} (a {type(leaf).__name__})"
    return None


def _is_cache(value: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def plain_arity(args: tuple, kwargs: dict) -> int | None:
    """n when the example was n positional tensors and nothing else: calls like it skip flattening."""
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    return len(args)


def is_all_ones(value: Any) -> bool:
    """Whether ``value`` is a non-empty integer or bool tensor of ones: a mask that masks nothing.

    >>> assert is_all_ones(torch.ones(2, 3, dtype=torch.long)) and not is_all_ones(torch.ones(2))
    """
    return (
        isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
        and value.numel() > 0 and bool((value == 1).all())
    )


def all_ones_key(kwargs: dict, names: tuple[str, ...], training: bool) -> tuple | None:
    """The :data:`ALL_ONES_PROVEN` key of these keyword inputs: the training mode and the shapes of
    the all-ones masks among ``names``; None where none is all ones.

    >>> all_ones_key({"attention_mask": torch.ones(2, 5, dtype=torch.long)}, ("attention_mask",), False)
    (False, (('attention_mask', (2, 5)),))
    """
    ones = tuple((k, tuple(kwargs[k].shape)) for k in names if is_all_ones(kwargs.get(k)))
    return (training, ones) if ones else None


def input_guard(gm: GraphModule) -> InputGuard:
    """The guard of ``gm``'s placeholders: each tensor's dtype, device and sizes (a symbolic size by
    its name, with export's range for it), and the model's conditions on those sizes."""
    names, specs = [], []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        names.append(node.name)
        if isinstance(val, torch.Tensor):
            dims = [_dim_spec(d) for d in val.shape]
            specs.append((val.dtype, val.device.type, dims))
        else:
            specs.append(None)
    record = peek_graph_info(gm) or GraphInfo()
    ranges = {}
    for sym, vr in record.ranges.items():
        ranges[str(sym)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    symbols = {d for spec in specs if spec is not None for d in spec[2] if isinstance(d, str)}
    conditions = [c for c in record.size_conditions if set(c[1]) <= symbols]
    return InputGuard(names, specs, ranges, record.range_reasons, conditions)


def _bound(value: Any) -> int | None:
    """An integer range bound, or None for infinity (sympy's and torch's int_oo)."""
    return int(value) if getattr(value, "is_Integer", False) else None


def _dim_spec(d: int | torch.SymInt) -> int | str:
    """A static size, or the name (or expression) of a symbolic one."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    return int(expr) if expr.is_number else str(expr)
