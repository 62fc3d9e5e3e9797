"""passes/export_guards.py alone, on tiny graphs: each guard_value becomes an ATen assertion with
the branch's semantics, or is removed and named where no comparison says it exactly."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from graphamp.passes.export_guards import guards_as_asserts
from graphamp.runtime import guard_size, guard_value


def _guarded(read: str, expected: object, dtype: torch.dtype = torch.float32) -> GraphModule:
    """x -> x.sum() read as ``read`` (expected ``expected``) -> returns x * 2."""
    g = Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3, dtype=dtype)
    s = g.call_function(torch.ops.aten.sum.default, (x,))
    s.meta["val"] = torch.empty((), dtype=dtype)
    g.call_function(guard_value, (read, [s], expected, "model.py:7"))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (x, 2)))
    return GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize(("read", "expected", "passes", "refused"), [
    ("bool", True, torch.ones(3), torch.zeros(3)),
    ("bool", False, torch.zeros(3), torch.ones(3)),
    ("item", 3.0, torch.ones(3), torch.zeros(3)),
])
def test_a_guard_becomes_an_assertion_with_the_branchs_meaning(read, expected, passes, refused):
    gm = _guarded(read, expected)
    assert guards_as_asserts(gm) == []
    assert "_assert_async" in gm.code and "guard_value" not in gm.code
    assert torch.equal(gm(passes), passes * 2)
    with pytest.raises(RuntimeError, match=r"graphamp.export: .*\(" + read + " at model.py:7\\)"):
        gm(refused)


@pytest.mark.parametrize(("read", "expected"), [("int", 3), ("float", float("nan")), ("tolist", [1.0])])
def test_a_read_no_comparison_says_exactly_is_removed_and_named(read, expected):
    # int() truncates a float (an equality would refuse 3.5, which eager reads as 3); NaN equals
    # nothing; a list read has no one-element comparison.
    gm = _guarded(read, expected)
    assert guards_as_asserts(gm) == ["model.py:7"]
    assert "_assert_async" not in gm.code and "guard_value" not in gm.code and "sum" not in gm.code
    assert torch.equal(gm(torch.ones(3)), torch.ones(3) * 2)


def test_an_int_read_of_an_integer_tensor_is_asserted():
    gm = _guarded("int", 3, dtype=torch.int64)
    assert guards_as_asserts(gm) == []
    gm(torch.ones(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="graphamp.export"):
        gm(torch.zeros(3, dtype=torch.int64))


def _guarded_raw(read: str, values: list, expected: object) -> GraphModule:
    """x (int64, 2x3) -> guard_value(read, values(x), expected) -> returns x * 2."""
    g = Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, dtype=torch.int64)
    s = g.call_function(torch.ops.aten.sum.default, (x,))
    s.meta["val"] = torch.empty((), dtype=torch.int64)
    g.call_function(guard_value, (read, values(x, s), expected, "model.py:9"))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (x, 2)))
    return GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize(("read", "values", "expected"), [
    ("tolist", lambda x, s: [x], [[1, 2, 3], [4, 5, 6]]),  # vision towers' grid_thw.tolist()
    ("op", lambda x, s: [torch.ops.aten.item.default, s], 21),  # an ATen composite's own item()
])
def test_an_integer_list_read_and_an_ops_own_item_are_asserted(read, values, expected):
    gm = _guarded_raw(read, values, expected)
    assert guards_as_asserts(gm) == []
    example = torch.arange(1, 7).reshape(2, 3)
    assert torch.equal(gm(example), example * 2)
    other = example.clone()
    other[1, 2] = 7
    with pytest.raises(RuntimeError, match=r"graphamp.export: .*model.py:9"):
        gm(other)
    # and torch.export keeps the assertion (its constant a lifted one)
    program = torch.export.export(gm, (example,), strict=False)
    assert torch.equal(program.module()(example), example * 2)
    with pytest.raises(RuntimeError, match="graphamp.export"):
        program.module()(other)


def _size_guarded() -> GraphModule:
    """x (bool, 4) -> nonzero(x), guarded to the example's (2, 1) -> returns its rows summed."""
    g = Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, dtype=torch.bool)
    rows = g.call_function(torch.ops.aten.nonzero.default, (x,))
    rows.meta["val"] = torch.empty(2, 1, dtype=torch.int64)
    g.call_function(guard_size, (rows, (2, 1), "model.py:11"))
    g.output(g.call_function(torch.ops.aten.sum.dim_IntList, (rows, [0])))
    return GraphModule(torch.nn.Module(), g)


def test_a_size_guard_becomes_torchs_own_check_which_export_keeps():
    # guard_size (a value-dependent size: nonzero, masked rows) becomes torch._check on each size,
    # so torch.export fixes the size and asserts it at run time.
    gm = _size_guarded()
    assert guards_as_asserts(gm) == []
    assert "guard_size" not in gm.code and "_check" in gm.code
    example, same_count, other_count = (torch.tensor(v, dtype=torch.bool) for v in ([1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 1, 0]))
    assert torch.equal(gm(example), torch.tensor([2]))
    assert torch.equal(gm(same_count), torch.tensor([3]))
    with pytest.raises(RuntimeError):
        gm(other_count)
    program = torch.export.export(gm, (example,), strict=False)
    assert torch.equal(program.module()(same_count), torch.tensor([3]))
    with pytest.raises(RuntimeError):
        program.module()(other_count)
