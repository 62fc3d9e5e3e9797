"""Turn graphamp's value guards into ATen runtime assertions, for a program ``graphamp.export`` deploys.

A graph torch.export captured follows the example's path where the model's Python reads a tensor
value (transformers' ``attention_mask.all()``). ``graphamp.convert`` checks such reads as it runs
(``graphamp.runtime.guard_value``) and converts again where one differs; an exported program may not
call graphamp, so there the same checks become ``aten._assert_async.msg``, which ExportedProgram and
AOTInductor both keep and raise on: an input that takes another path in eager is refused, never run
down the example's path.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from graphamp.runtime import assert_condition, guard_value

__all__ = ["guards_as_asserts"]

_ASSERT = torch.ops.aten._assert_async.msg


def _condition(graph: torch.fx.Graph, read: str, value: Node, expected: object) -> Node | None:
    """A bool-tensor node true where reading ``value`` as ``read`` gives ``expected``; None where
    no ATen comparison says it exactly (``runtime.assert_condition``)."""
    condition = assert_condition(read, value.meta.get("val"), expected)
    if condition is None:
        return None
    op, scalar = condition
    return graph.call_function(op, (value, scalar))


def guards_as_asserts(gm: GraphModule) -> list[str]:
    """Replace each ``runtime.guard_value`` node with ``aten._assert_async.msg`` on the same read;
    remove those no ATen comparison expresses and return where they read (the caller warns)."""
    unexpressed = []
    for node in list(gm.graph.find_nodes(op="call_function", target=guard_value)):
        read, values, expected = node.args[:3]
        where = node.args[3] if len(node.args) > 3 else node.kwargs.get("where", "")
        with gm.graph.inserting_before(node):
            cond = _condition(gm.graph, read, values[0], expected) if len(values) == 1 else None
            if cond is not None:
                gm.graph.call_function(_ASSERT, (cond, (
                    f"graphamp.export: the model's code reads a tensor value ({read}{f' at {where}' if where else ''}) "
                    f"that was {expected!r} on the example this program follows; eager runs another program for "
                    "these inputs. Way out: export with an example that takes their path, or use graphamp.convert, "
                    "which converts again for them."
                )))
        if cond is None:
            unexpressed.append(str(where or read))
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        _erase_unused(gm.graph, inputs)
    gm.recompile()
    return unexpressed


def _erase_unused(graph: torch.fx.Graph, nodes: list[Node]) -> None:
    """Erase the guard's read ops that nothing uses any more (those it alone needed)."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node.op in ("call_function", "get_attr") and not node.users and not node.is_impure():
            todo.extend(node.all_input_nodes)
            graph.erase_node(node)
