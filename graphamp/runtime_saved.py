"""What a saved AmpModule carries beside FX's own module state: the model it converts again from,
and graphamp's record of each node (casts, categories), which loading's re-trace would lose.

``AmpModule.__reduce__`` (:mod:`graphamp.emit`) writes both under the keys here, and
:func:`graphamp.runtime.rebuild_amp_module` reads them back: the saved format is the keys' values
and the record's shape, which change only with a loader shim in the runtime (see
:mod:`graphamp.runtime`). Files name no function here. Part of the runtime, so it imports torch
only.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["MODEL", "NODE_META", "node_key", "node_meta_record", "restore_node_meta"]

# Where a converted module keeps the model it converts again from for other shape classes.
MODEL = "_graphamp_model"

# Where a saved module keeps graphamp's node meta (casts, categories), which a re-trace loses.
NODE_META = "_graphamp_node_meta"


def node_key(node: torch.fx.Node) -> str:
    """A call node's op and target, the same in every process: the code of a re-traced module
    matches the saved graph's node for node exactly when these keys do. A function target is named
    by its ``__module__``, which is why the runtime's functions keep ``graphamp.runtime`` there."""
    t = node.target
    if isinstance(t, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{node.op} {t.__module__}.{t.__qualname__}"
    return f"{node.op} {t}"


def node_meta_record(graph: torch.fx.Graph, info_of: Any) -> dict[str, Any]:
    """What :func:`restore_node_meta` restores, for ``AmpModule.__reduce__``: ``info_of(node)`` for
    every call node, in order, and for every ``get_attr`` node by its target."""
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    attrs = {n.target: info_of(n) for n in graph.find_nodes(op="get_attr")}
    return {"calls": [(node_key(n), info_of(n)) for n in calls], "attrs": {k: v for k, v in attrs.items() if v}}


def restore_node_meta(graph: torch.fx.Graph, record: dict[str, Any], as_info: Any) -> None:
    """Put a :func:`node_meta_record` back on a re-traced graph's nodes, each as ``as_info(record)``."""
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    # Only where the re-trace gave the saved graph's nodes back one for one; otherwise the module
    # runs the same and only its report (cast_summary) is empty.
    if [key for key, _ in record["calls"]] == [node_key(n) for n in calls]:
        for node, (_, info) in zip(calls, record["calls"]):
            if info:
                node.meta["graphamp"] = as_info(info)
    for node in graph.find_nodes(op="get_attr"):
        if node.target in record["attrs"]:
            node.meta["graphamp"] = as_info(record["attrs"][node.target])
