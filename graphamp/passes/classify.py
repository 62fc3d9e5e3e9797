"""Decide, without editing the graph, which autocast category and low dtype each op node gets, and why.

insert_casts applies the decision (:mod:`graphamp.passes.insert_casts`) and asks it first whether a
composite is worth decomposing (:mod:`graphamp.passes.decompose`); autotune overrides it to list
the ops it raises as fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx import Node

from graphamp.config import Config
from graphamp.node_info import AutocastFrame, innermost_module, region_of
from graphamp.policy import Category, Policy, op_key

__all__ = ["Decision", "autocast_state", "classify", "location"]


class Decision(NamedTuple):
    """What autocast does to one op node: its category (None: autocast leaves the op alone), the
    low dtype autocast runs at there, and the reason recorded in the node's NodeInfo."""

    category: Category | None
    low: torch.dtype
    reason: str


def autocast_state(node: Node, policy: Policy) -> tuple[bool, torch.dtype]:
    """(enabled, low dtype) for the policy's device at ``node``, from the regions around it."""
    enabled, dtype = True, policy.dtype
    for frame in region_of(node):
        if isinstance(frame, AutocastFrame) and frame.device_type == policy.device_type:
            enabled = frame.enabled
            if frame.dtype is not None:
                dtype = frame.dtype
    return enabled, dtype


def classify(node: Node, policy: Policy, config: Config, *, kernel_paths: bool = True) -> Decision:
    """The autocast category of an op node, by precedence: a module ``config`` keeps in fp32, an
    autocast region that disables autocast, then the policy's lists (a config override first).

    With ``kernel_paths`` an ``aten::lstm`` that the policy runs whole is left unlisted: insert_casts
    decomposes it along the kernel path eager takes.

    >>> from torch.fx import Graph
    >>> from graphamp.policy import get_policy
    >>> g = Graph()
    >>> x = g.placeholder("x")
    >>> mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    >>> d = classify(mm, get_policy("cpu", torch.bfloat16), Config())
    >>> assert d == (Category.LOWER_PRECISION_FP, torch.bfloat16, "lower_precision_fp (cpu list)")
    """
    kept = config.keeps_fp32(node.meta.get("nn_module_stack"))
    if kept is not None:
        return Decision(Category.FP32, policy.dtype, f"inside {kept}, kept in fp32 by config")
    enabled, low = autocast_state(node, policy)
    if not enabled:
        return Decision(None, low, "autocast disabled by a region in forward")
    key = op_key(node.target)
    category = policy.category(key)
    if category is None:
        return Decision(None, low, "not on an autocast list")
    if key in config.op_overrides:
        source = "config override"
    elif key in config.all_overrides:
        source = config.plan.reason(key)
    elif key in policy.opaque:
        if key == "lstm.input" and kernel_paths:
            return Decision(None, low, "decomposed along the kernel path eager takes for it")
        source = f"{policy.device_type} composite, run whole"
    else:
        source = f"{policy.device_type} list"
    return Decision(category, low, f"{category.value} ({source})")


def location(node: Node) -> str:
    """Where ``node`` sits in the user's model, for messages: its innermost module, or forward."""
    innermost = innermost_module(node)
    if innermost is not None:
        path, type_ = innermost
        type_name = type_ if isinstance(type_, str) else type_.__qualname__
        return f"in module {path or '<root>'} ({type_name.rsplit('.', 1)[-1]})"
    return "at the top level of forward"
