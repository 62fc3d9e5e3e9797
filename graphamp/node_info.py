"""The metadata contract: graphamp's one record per node, ``node.meta["graphamp"]``, a :class:`NodeInfo`,
and its one record per graph or converted module, ``gm.meta["graphamp"]``, a :class:`GraphInfo`.

Passes write them; reports read them (``AmpModule.cast_summary``, ``graphamp.verify``, explanations).
No other graphamp key is written to ``node.meta`` or ``gm.meta``. A saved module keeps each record
as a plain dict (``NodeInfo.to_dict``/``from_dict``, ``GraphInfo.to_dict``/``from_dict``), so the
classes themselves are never pickled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch.fx import Node

__all__ = [
    "AutocastFrame", "GRAPHAMP", "GradFrame", "GraphInfo", "NodeInfo", "graph_info", "info", "innermost_module", "peek",
    "peek_graph_info", "region_of",
]

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
    # A guard the capture on values put in place of one of the model's value reads: which read.
    value_read: int | None = None
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


@dataclasses.dataclass
class GraphInfo:
    """What graphamp knows of a whole graph, and of the module converted from it: the capture and
    the passes write it on the graph, emit hands it to the :class:`~graphamp.emit.AmpModule`, and
    the module and the checks after conversion add to it. A
    :class:`~graphamp.compiled.CompiledAmpModule` keeps one too (its ``drift`` and ``compile_s``),
    so that every graphamp record on a module is read the same way.

    >>> from torch.fx import GraphModule
    >>> gm = GraphModule(torch.nn.Module(), torch.fx.Graph())
    >>> assert peek_graph_info(gm) is None
    >>> graph_info(gm).captured_static = True
    >>> assert GraphInfo.from_dict(peek_graph_info(gm).to_dict()) == peek_graph_info(gm)
    >>> assert GraphInfo.from_dict({}, {"graphamp_captured_static": True}).captured_static  # a file's old key
    """

    # capture: every size was captured static (the model's code could not take symbolic sizes);
    # the module converts again for other shapes.
    captured_static: bool = False
    # capture: export's ranges of the symbolic sizes (symbol -> ValueRanges), each range's reason,
    # and the model's conditions on sizes that no range expresses: the module's input guard.
    ranges: dict[Any, Any] = dataclasses.field(default_factory=dict)
    range_reasons: dict[Any, Any] | None = None
    size_conditions: list[Any] = dataclasses.field(default_factory=list)
    # capture.values: (buffer paths, random draws?) a graph changes before a guard that may refuse
    # the call, which the module puts back when it does (runtime.restored_on_refusal).
    restore_on_refusal: tuple[list[str], bool] | None = None
    # The pipeline (or the backend's observation): what eager did at each SDPA call on the example,
    # in call order (probe.SdpaCall), for follow_eager_attention.
    eager_sdpa: list[Any] | None = None
    # fuse_encoder_layers: eager's program for this graph differs without grad, so the module
    # converts again for calls without grad.
    fused_without_grad: bool = False
    # freeze_weights: parameter path -> weak reference to the model's parameter a frozen buffer was
    # cast from (emit moves them onto the module, for AmpModule.refresh; never saved).
    frozen: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The autotune pass and the checks after it: the plan (graphamp.AutotunePlan) it converted with.
    plan: Any = None
    # convert's self-check: what it compared and found (graphamp.conversion_info.SelfCheck).
    self_check: Any = None
    # integrations.fsdp: the paths of the units converted on their own (None: not unit by unit).
    fsdp_units: list[str] | None = None
    # CompiledAmpModule: seconds inductor took on the example, and the drift measured against
    # eager autocast (graphamp.compiled.Drift).
    compile_s: float | None = None
    drift: Any = None

    def to_dict(self) -> dict[str, Any]:
        """What a saved module keeps: the non-default fields the module reads after conversion, as
        plain data (the self-check as a dict of its fields; the plan is the public AutotunePlan)."""
        default = GraphInfo()
        saved = {name: getattr(self, name) for name in _SAVED_FIELDS if getattr(self, name) != getattr(default, name)}
        if dataclasses.is_dataclass(saved.get("self_check")):
            saved["self_check"] = dataclasses.asdict(saved["self_check"])
        return saved

    @classmethod
    def from_dict(cls, fields: dict[str, Any], old_meta: dict[str, Any] | None = None) -> GraphInfo:
        """A record from :meth:`to_dict`; ``old_meta`` is the module meta of a file saved before
        this class, whose keys (``OLD_META_KEYS``) are read as their fields."""
        fields = {**{field: old_meta[key] for key, field in OLD_META_KEYS.items() if key in (old_meta or {})}, **fields}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


# What a saved module keeps of its GraphInfo; the rest is compile-time only.
_SAVED_FIELDS = ("captured_static", "restore_on_refusal", "fused_without_grad", "plan", "self_check", "fsdp_units")

# The gm.meta keys of the record's fields before GraphInfo held them: files saved then carry them.
OLD_META_KEYS = {
    "graphamp_captured_static": "captured_static",
    "graphamp_restore_on_refusal": "restore_on_refusal",
    "graphamp.fused_without_grad": "fused_without_grad",
    "graphamp_autotune_plan": "plan",
    "graphamp.self_check": "self_check",
    "graphamp.fsdp": "fsdp_units",
}


def graph_info(module: Any) -> GraphInfo:
    """The record of a graph module (or of a module with a ``meta`` dict), created empty on first use."""
    record = module.meta.get(GRAPHAMP)
    if record is None:
        record = module.meta[GRAPHAMP] = GraphInfo()
    return record


def peek_graph_info(module: Any) -> GraphInfo | None:
    """The module's record, or None if nothing wrote one or it has no ``meta`` (nothing is created)."""
    meta = getattr(module, "meta", None)
    return meta.get(GRAPHAMP) if isinstance(meta, dict) else None
