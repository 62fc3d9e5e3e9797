"""The metadata contract: graphamp's one record per node, ``node.meta["graphamp"]``, a :class:`NodeInfo`.

Passes write it; reports read it (``AmpModule.cast_summary``, ``graphamp.verify``, explanations).
No other graphamp key is written to ``node.meta``. A saved module keeps each record as a plain
dict beside its code (``NodeInfo.to_dict``/``from_dict``), so the class itself is never pickled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch.fx import Node

__all__ = ["AutocastFrame", "GRAPHAMP", "GradFrame", "NodeInfo", "info", "innermost_module", "peek", "region_of"]

GRAPHAMP = "graphamp"


class AutocastFrame(NamedTuple):
    """An autocast region written in ``forward``: ``torch.autocast(device_type, dtype, enabled)``."""

    device_type: str
    dtype: torch.dtype | None
    enabled: bool


class GradFrame(NamedTuple):
    """A grad-mode region written in ``forward`` (``torch.no_grad()``, ``torch.enable_grad()``)."""

    enabled: bool


@dataclasses.dataclass
class NodeInfo:
    """What graphamp decided for one node, and why.

    >>> from torch.fx import Graph
    >>> node = Graph().placeholder("x")
    >>> info(node).reason = "an input"
    >>> assert peek(node).reason == "an input" and NodeInfo.from_dict(peek(node).to_dict()) == peek(node)
    """

    # The autocast category applied to the op ("lower_precision_fp", "fp32", ...); None: no list.
    category: str | None = None
    # The dtype the category makes the op compute in, when it sets one.
    dtype: torch.dtype | None = None
    # Why: the list it is on, a config override, a region, a kernel path, ...
    reason: str | None = None
    # An inserted cast, and the dtype of what it casts (kept for saved modules, which have no values).
    cast: bool = False
    source_dtype: torch.dtype | None = None
    # A weight cast kept across calls (cache_weights), or a parameter frozen to low precision.
    cached: bool = False
    frozen: bool = False
    # The composite node this node came from when a pass decomposed it.
    decomposed_from: str | None = None
    # The kernel path eager takes that graphamp followed (an LSTM on oneDNN).
    eager_kernel: str | None = None
    # How follow_eager_attention changed this SDPA call.
    attention: str | None = None
    # The autocast and grad-mode regions around the node, outermost first.
    region: tuple[AutocastFrame | GradFrame, ...] = ()
    # The output dtypes eager autocast gave the node while capturing (check_dtypes compares them).
    captured: tuple | None = None
    # A grad-mode switch whose region inline_regions has already applied.
    grad_switch: bool = False
    # Further notes by pass name (for example measured timings), plain values only.
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The non-default fields, as a saved module keeps them."""
        default = NodeInfo()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> NodeInfo:
        """A record from :meth:`to_dict`; files saved before this class used "from" for source_dtype."""
        fields = dict(fields)
        if "from" in fields:
            fields["source_dtype"] = fields.pop("from")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


def info(node: Node) -> NodeInfo:
    """The node's record, created empty on first use."""
    record = node.meta.get(GRAPHAMP)
    if record is None:
        record = node.meta[GRAPHAMP] = NodeInfo()
    return record


def peek(node: Node) -> NodeInfo | None:
    """The node's record, or None if no pass wrote one (nothing is created)."""
    return node.meta.get(GRAPHAMP)


def region_of(node: Node) -> tuple[AutocastFrame | GradFrame, ...]:
    """The regions around ``node``, outermost first; () outside any."""
    record = node.meta.get(GRAPHAMP)
    return record.region if record is not None else ()


def innermost_module(node: Node | None) -> tuple[str, Any] | None:
    """``(path, type)`` of the innermost module on the node's ``nn_module_stack`` (the module whose
    code made the node; path "" is the root), or None where the node records none.

    >>> g = torch.fx.Graph()
    >>> n = g.placeholder("x")
    >>> n.meta["nn_module_stack"] = {"a": ("enc", "Encoder"), "b": ("enc.norm", "LayerNorm")}
    >>> innermost_module(n), innermost_module(g.placeholder("y"))
    (('enc.norm', 'LayerNorm'), None)
    """
    stack = node.meta.get("nn_module_stack") if node is not None else None
    return next(reversed(stack.values())) if stack else None
