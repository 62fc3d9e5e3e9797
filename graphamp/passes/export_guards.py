"""Turn graphamp's value guards into ATen runtime assertions, for a program ``graphamp.export`` deploys.

A graph torch.export captured follows the example's path where the model's Python reads a tensor
value (transformers' ``attention_mask.all()``). ``graphamp.convert`` checks such reads as it runs
(``graphamp.runtime.guard_value``) and converts again where one differs; an exported program may not
call graphamp, so there the same checks become ``aten._assert_async.msg``, which ExportedProgram and
AOTInductor both keep and raise on: an input that takes another path in eager is refused, never run
down the example's path.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from graphamp.runtime import assert_condition, guard_size, guard_value

__all__ = ["REFUSAL", "assertions_named", "guards_as_asserts"]

_ASSERT = torch.ops.aten._assert_async.msg
# Where a program graphamp exported refuses inputs, its message begins so (verify_export names it).
REFUSAL = "graphamp.export:"
# torch.export's own runtime assertions, on the sizes and values a program was fixed to.
_TORCH_ASSERTS = (torch.ops.aten._assert_scalar.default, _ASSERT)


# An ATen op's own read of a one-element tensor (``aten.item`` inside a composite's decomposition).
_ITEM_OPS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


def _condition(gm: GraphModule, read: str, values: list, expected: object) -> Node | None:
    """A bool-tensor node true where reading ``values`` as ``read`` gives ``expected``; None where
    no ATen comparison says it exactly (``runtime.assert_condition``, and a ``tolist`` of integers
    or bools compared with a constant of the example's values)."""
    if read == "op" and len(values) == 2 and values[0] in _ITEM_OPS:
        read, values = "item", values[1:]
    if len(values) != 1 or not isinstance(values[0], Node):
        return None
    value, fake = values[0], values[0].meta.get("val")
    if read in ("tolist", "numpy") and isinstance(fake, torch.Tensor) and isinstance(expected, list):
        return _equal_to_constant(gm, value, fake, expected)
    condition = assert_condition(read, fake, expected)
    if condition is None:
        return None
    op, scalar = condition
    return gm.graph.call_function(op, (value, scalar))


def _equal_to_constant(gm: GraphModule, value: Node, fake: torch.Tensor, expected: list) -> Node | None:
    """``(value == constant).all()``, the constant holding ``expected`` at ``value``'s shape and
    dtype; None unless both are integer or bool (a float list would compare -0.0 and NaN otherwise
    than Python does)."""
    if fake.is_floating_point() or fake.is_complex():
        return None
    try:
        constant = torch.tensor(expected, dtype=fake.dtype)
    except (TypeError, ValueError, RuntimeError):
        return None
    if tuple(constant.shape) != tuple(fake.shape) or constant.tolist() != expected:
        return None
    index = 0
    while hasattr(gm, name := f"_graphamp_expected_{index}"):
        index += 1
    gm.register_buffer(name, constant.to(fake.device), persistent=False)
    equal = gm.graph.call_function(torch.ops.aten.eq.Tensor, (value, gm.graph.get_attr(name)))
    return gm.graph.call_function(torch.ops.aten.all.default, (equal,))


def guards_as_asserts(gm: GraphModule) -> list[str]:
    """Replace each ``runtime.guard_value`` node with ``aten._assert_async.msg`` on the same read;
    remove those no ATen comparison expresses and return where they read (the caller warns)."""
    unexpressed = []
    for node in list(gm.graph.find_nodes(op="call_function", target=guard_value)):
        read, values, expected = node.args[:3]
        where = node.args[3] if len(node.args) > 3 else node.kwargs.get("where", "")
        with gm.graph.inserting_before(node):
            cond = _condition(gm, read, list(values), expected)
            if cond is not None:
                gm.graph.call_function(_ASSERT, (cond, (
                    f"{REFUSAL} the model's code reads a tensor value ({read}{f' at {where}' if where else ''}) "
                    f"that was {expected!r} on the example this program follows; eager runs another program for "
                    "these inputs. Way out: export with an example that takes their path, or use graphamp.convert, "
                    "which converts again for them."
                )))
        if cond is None:
            unexpressed.append(str(where or read))
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        _erase_unused(gm.graph, inputs)
    for node in list(gm.graph.find_nodes(op="call_function", target=guard_size)):
        value, size = node.args[:2]
        with gm.graph.inserting_before(node):
            for dim, expected in enumerate(size):
                read = gm.graph.call_function(torch.ops.aten.sym_size.int, (value, dim))
                gm.graph.call_function(torch._check, (gm.graph.call_function(operator.eq, (read, expected)),))
        gm.graph.erase_node(node)
    gm.recompile()
    return unexpressed


def assertions_named(gm: GraphModule, why: str) -> int:
    """Begin the message of each runtime assertion in ``gm`` and its subgraphs (torch.export's own,
    on the sizes and values the program was fixed to) with graphamp's: ``why`` it holds them, then
    torch's words and the way out, so inputs it refuses say so. Returns how many it named."""
    named = 0
    for module in gm.modules():
        if not isinstance(module, GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target not in _TORCH_ASSERTS or len(node.args) < 2:
                continue
            if isinstance(node.args[1], str) and not node.args[1].startswith(REFUSAL):
                node.args = (node.args[0], (
                    f"{REFUSAL} {why}; these inputs are not: {node.args[1]}. Way out: export with an example that "
                    "takes their path, or use graphamp.convert, which converts again for them."
                ), *node.args[2:])
                named += 1
        module.recompile()
    return named


def _erase_unused(graph: torch.fx.Graph, nodes: list[Node]) -> None:
    """Erase the guard's read ops that nothing uses any more (those it alone needed)."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node.op in ("call_function", "get_attr") and not node.users and not node.is_impure():
            todo.extend(node.all_input_nodes)
            graph.erase_node(node)
