"""The compile-time half of saving an AmpModule (``AmpModule.__reduce__``): each node's record and
the module's :class:`~graphamp.node_info.GraphInfo` as the file keeps them, and whether the model
can travel with its converted module.

The loading half, which files name, is :func:`graphamp.runtime.rebuild_amp_module`; the keys and
node record both halves share are in :mod:`graphamp.runtime_saved`.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any

import torch
from torch import nn

from graphamp.conversion_info import SelfCheck
from graphamp.node_info import GRAPHAMP, OLD_META_KEYS, GraphInfo, peek
from graphamp.passes.graph_edit import cast_source, tensor_dtype
from graphamp.runtime import cached_cast

__all__ = ["meta_from_saved", "picklable", "saved_info", "saved_meta"]

# What reports read; the rest of a NodeInfo (regions, captured dtypes) is compile-time only.
_SAVED_FIELDS = ("category", "dtype", "reason", "cast", "source_dtype", "cached", "frozen", "decomposed_from", "eager_kernel", "attention", "notes")


def saved_info(node: torch.fx.Node) -> dict[str, Any] | None:
    """A node's record as a saved module keeps it: a plain dict, with a cast's source dtype."""
    record = peek(node)
    if record is None:
        return None
    saved = {k: v for k, v in record.to_dict().items() if k in _SAVED_FIELDS}
    if record.cast:
        found = (node.args[1], None) if node.target is cached_cast else cast_source(node)
        if found is not None and tensor_dtype(found[0]) is not None:
            saved["source_dtype"] = tensor_dtype(found[0])
    return saved or None


def saved_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """A module's ``meta`` as its file keeps it: the GraphInfo as a plain dict (no graphamp class
    but the public ones), beside torch's own keys."""
    saved = {k: v for k, v in meta.items() if k != GRAPHAMP}
    record = meta.get(GRAPHAMP)
    if record is not None and record.to_dict():
        saved[GRAPHAMP] = record.to_dict()
    return saved


def meta_from_saved(meta: dict[str, Any]) -> dict[str, Any]:
    """A loaded module's ``meta`` (the runtime calls this through ``AmpModule.meta_from_saved``):
    the saved record, or a file's keys from before GraphInfo, as a GraphInfo again.

    >>> old = {"graphamp.self_check": {"ok": True, "grads": False, "seconds": 0.5}, "inline_constraints": {}}
    >>> new = meta_from_saved(old)
    >>> assert new[GRAPHAMP].self_check == SelfCheck(True, False, 0.5) and set(new) == {GRAPHAMP, "inline_constraints"}
    >>> assert meta_from_saved(saved_meta(new)) == new
    """
    loaded = {k: v for k, v in meta.items() if k != GRAPHAMP and k not in OLD_META_KEYS}
    saved = meta.get(GRAPHAMP)
    if saved is None and not any(k in meta for k in OLD_META_KEYS):
        return loaded
    record = GraphInfo.from_dict(saved or {}, meta)
    if isinstance(record.self_check, dict):
        known = {f.name for f in dataclasses.fields(SelfCheck)}
        record.self_check = SelfCheck(**{k: v for k, v in record.self_check.items() if k in known})
    loaded[GRAPHAMP] = record
    return loaded


class _TensorsAside(pickle.Pickler):
    """Pickles all but tensor data: whether a model pickles, without copying its weights."""

    def persistent_id(self, obj: Any) -> int | None:
        return id(obj) if isinstance(obj, torch.Tensor) else None


def picklable(model: nn.Module) -> bool:
    """Whether ``model`` can be saved with its converted module (a class defined in a function,
    a lambda attribute or a ScriptModule cannot).

    >>> model = nn.Linear(2, 2)
    >>> assert picklable(model)
    >>> model.scale = lambda x: x * 2  # pickle cannot find a lambda again by name
    >>> assert not picklable(model)
    """
    try:
        _TensorsAside(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(model)
    except Exception:
        return False
    return True
