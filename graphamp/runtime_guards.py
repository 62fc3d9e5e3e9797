"""What a converted module checks as it runs: its inputs' dtypes, devices, ranks and sizes, and the
conditions the model's code imposes on sizes (:class:`InputGuard`, one call per forward), and each
tensor value the model's code read while the graph was captured (:func:`guard_value`,
:func:`guard_size`), as plain checks or, in a CompiledAmpModule's compiled code, as ATen
assertions (:func:`compiled_guards`).

A failed check raises the typed error (:class:`~graphamp.errors.InputShapeError`,
:class:`~graphamp.errors.InputValueError`, ...) on which the module converts again for the inputs.

Part of the stable runtime: :mod:`graphamp.runtime` re-exports the names here, and the ones it
lists in its ``__all__`` carry ``graphamp.runtime`` as their ``__module__`` (the end of this file),
the path FX writes into a converted module's imports and pickle into a saved file. Like the
runtime, this module imports torch and ``graphamp.errors`` only.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from graphamp.errors import InputMismatchError, InputShapeError, InputValueError

__all__ = [
    "COMPILED_REFUSAL",
    "InputGuard",
    "assert_condition",
    "compiled_guards",
    "guard_size",
    "guard_value",
    "size_condition_holds",
    "traced",
]


def traced() -> bool:
    """Whether the code calling this is being traced in this thread: by dynamo, or by torch.export
    on fake tensors.

    ``torch.compiler.is_compiling()`` alone answers for the whole process: while one thread compiles
    or exports, a converted module called for real in another thread would read True and skip its
    shape-class dispatch and parameter checks. Only that cheap flag is read when nothing compiles.

    >>> assert not traced()
    """
    if not torch.compiler.is_compiling():
        return False
    # Under dynamo the first call is a constant True, and the fake-mode lookup is never traced.
    return torch.compiler.is_dynamo_compiling() or torch._guards.detect_fake_mode() is not None


class InputGuard(nn.Module):
    """Checks that inputs match what the graph was converted for: dtype, device, rank, sizes.

    Dims that export kept symbolic may vary within their range; other dims, and every dtype,
    are fixed, because the casts were decided for them.
    """

    def __init__(
        self, names: list[str], specs: list[tuple | None], ranges: dict[str, tuple[int, int | None]],
        reasons: dict[str, str] | None = None, conditions: Sequence[tuple[str, tuple[str, ...], str]] = (),
    ) -> None:
        super().__init__()
        self.names = names
        self.specs = specs
        self.ranges = ranges
        self.reasons = reasons or {}  # per size: the model's condition that bounds it, and where
        # The model's conditions on sizes that no range says (batch != 1): (Python source over the
        # sizes, the sizes it reads, where the model tests it). Guards saved before have none.
        self.conditions = list(conditions)
        self._prepare_conditions()

    def _prepare_conditions(self) -> None:
        # Each condition as a function, made here and after loading, not while dynamo traces the
        # compiled path: dynamo traces calling it (a guard on the sizes), not making it (eval).
        fns = []
        for source, sizes, _ in self.__dict__.get("conditions", ()):
            try:
                fns.append(_condition(source, sizes))
            except Exception:  # a source that does not compile: the check says False, as below
                fns.append(None)
        self.__dict__["_condition_fns"] = fns

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_condition_fns", None)  # functions made by eval do not pickle: made again on load
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._prepare_conditions()

    def _condition_holds(self, i: int, source: str, sizes: tuple[str, ...], values: list[Any]) -> bool:
        fns = self.__dict__.get("_condition_fns") or ()
        fn = fns[i] if i < len(fns) else None
        if fn is not None and traced():
            return bool(fn(*values))
        return size_condition_holds(source, sizes, values)

    def _fast_specs(self) -> tuple | bool:
        """Per input, what the fast path checks; False when some input needs the full check."""
        counts: dict[str, int] = {}
        for spec in self.specs:
            for d in spec[2] if spec is not None else ():
                if not isinstance(d, int):
                    counts[d] = counts.get(d, 0) + 1
        fast = tuple(_fast_spec_of(spec, self.ranges, counts) for spec in self.specs)
        return False if any(f is False for f in fast) or self.__dict__.get("conditions") else fast

    def forward(self, *inputs: Any) -> None:
        # Fast path, once per call: every tensor input has the dtype, device and rank converted for
        # and its fixed sizes, and no symbolic size is bounded or shared; anything else takes the
        # full check below, which also words the error.
        fast = self.__dict__.get("_fast")
        if fast is None:
            fast = self.__dict__["_fast"] = self._fast_specs()
        if fast is not False and len(inputs) == len(fast):
            for spec, value in zip(fast, inputs):
                if spec is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    break
                dtype, device_type, rank, fixed, free = spec
                if value.dtype != dtype or value.device.type != device_type or value.dim() != rank:
                    break
                shape = value.shape
                if any(shape[i] != d for i, d in fixed) or any(shape[i] < lo for i, lo in free):
                    break
            else:
                return None
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
                        raise InputShapeError(
                            f"input {name!r} dim {i} is {size}, but the converted graph fixed it to {dim} "
                            "(torch.export specialized it while tracing the model's code)."
                        )
                elif dim in self.ranges:
                    lo, hi = self.ranges[dim]
                    if bound.setdefault(dim, size) != size:
                        raise InputShapeError(
                            f"input {name!r} dim {i} is {size}, but another input gave {bound[dim]} for the "
                            f"same size {dim}."
                        )
                    if size < lo or (hi is not None and size > hi):
                        why = getattr(self, "reasons", {}).get(dim)
                        raise InputShapeError(
                            f"input {name!r} dim {i} is {size}, outside the range [{lo}, {hi or 'inf'}] the "
                            "model's code allows for it"
                            + (f" (the graph was traced where the model's code tested {why})" if why else "")
                            + "."
                        )
        for i, (source, sizes, where) in enumerate(self.__dict__.get("conditions", ())):
            if not all(size in bound for size in sizes):
                continue
            values = [bound[size] for size in sizes]
            if not self._condition_holds(i, source, sizes, values):
                _refuse_sizes(sizes, values, where)


@torch.compiler.disable
def _refuse_sizes(sizes: tuple[str, ...], values: list[int], where: str) -> None:
    # Raised outside dynamo's trace (disable: a graph break, then this runs eagerly), so the error
    # leaves the compiled code as it is: dynamo cannot trace the raise, and falling back to eager
    # for the whole frame would run the converted module's reconversion inside the compiled call.
    given = ", ".join(f"{size}={value}" for size, value in zip(sizes, values))
    raise InputShapeError(
        f"these inputs' sizes ({given}) fail the condition the model's code tested where the graph "
        f"was traced ({where}): eager would take another branch."
    )


@functools.lru_cache(maxsize=256)
def _condition(source: str, sizes: tuple[str, ...]) -> Callable[..., bool]:
    """A size condition's source (torch's PythonPrinter over the size symbols) as a function."""
    return eval(f"lambda {', '.join(sizes)}: bool({source})", {"__builtins__": {}, "bool": bool, "math": math, "min": min, "max": max, "abs": abs})


def size_condition_holds(source: str, sizes: tuple[str, ...], values: Sequence[int]) -> bool:
    """Whether the model's size condition ``source`` holds for these sizes; False where it cannot
    be evaluated (then the input gets a conversion of its own, which is never wrong).

    >>> assert size_condition_holds("s0 != 1", ("s0",), [2]) and not size_condition_holds("s0 != 1", ("s0",), [1])
    """
    try:
        return _condition(source, sizes)(*values)
    except Exception:
        return False


def _fast_spec_of(spec: tuple | None, ranges: dict, counts: dict) -> tuple | None | bool:
    """(dtype, device, rank, ((dim, size) fixed), ((dim, lower bound) free)) for the guard's fast path;
    False for a size it cannot check alone (an upper bound, or a size shared with another dim)."""
    if spec is None:
        return None
    dtype, device_type, dims = spec
    fixed, free = [], []
    for i, d in enumerate(dims):
        if isinstance(d, int):
            fixed.append((i, d))
        elif d in ranges and ranges[d][1] is None and counts[d] == 1:
            free.append((i, ranges[d][0]))
        else:
            return False
    return (dtype, device_type, len(dims), tuple(fixed), tuple(free))


# What a graph captured by following the example's values (graphamp.capture.values) checks as it
# runs: each tensor value the model's Python read, by how it read it.
_READS: dict[str, Callable[..., Any]] = {
    "item": lambda t: t.item(),
    "bool": lambda t: bool(t),
    "int": lambda t: int(t),
    "float": lambda t: float(t),
    "index": lambda t: operator.index(t),
    "complex": lambda t: complex(t),
    "is_nonzero": lambda t: torch.is_nonzero(t),
    "tolist": lambda t: t.detach().cpu().tolist(),
    "numpy": lambda t: t.detach().cpu().tolist(),
    "equal": lambda a, b: torch.equal(a, b),
    "contains": lambda t, value: value in t,
    "allclose": lambda a, b, *rest: torch.allclose(a, b, *rest),
    "op": lambda op, *args: op(*args),  # an ATen op's own read (``aten.item`` inside a composite op)
}


def _same_value(got: Any, expected: Any) -> bool:
    """Equal as the model's branch sees it: NaN equals NaN, and lists compare element by element."""
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(map(_same_value, got, expected))
    if isinstance(expected, float) and expected != expected:
        return isinstance(got, float) and got != got
    return type(got) is type(expected) and got == expected


# Reads whose value is the tensor's own (one element), which an ATen comparison can check.
_SCALAR_READS = ("bool", "is_nonzero", "item", "int", "float", "index")


def assert_condition(read: str, value: torch.Tensor, expected: Any) -> tuple[Callable[..., Any], Any] | None:
    """``(op, scalar)`` such that ``op(value, scalar)`` is a bool tensor, true exactly where reading
    ``value`` as ``read`` gives ``expected`` (``value`` may be fake); None where no ATen comparison
    says it exactly. Shared by the compiled module's guards and graphamp.export's assertions.

    >>> assert_condition("bool", torch.ones(()), True)
    (<OpOverload(op='aten.ne', overload='Scalar')>, 0)
    >>> assert_condition("int", torch.ones(()), 1) is None  # int() truncates a float: 1.5 reads as 1 too
    True
    """
    if read not in _SCALAR_READS or not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    if read in ("bool", "is_nonzero"):
        return ((torch.ops.aten.ne.Scalar if expected else torch.ops.aten.eq.Scalar), 0) if isinstance(expected, bool) else None
    if type(expected) not in (int, float, bool) or expected != expected:  # NaN: no equality says it
        return None
    if read in ("int", "index") and value.is_floating_point():
        return None
    return torch.ops.aten.eq.Scalar, expected


# The message prefix of a guard's assertion in compiled code (CompiledAmpModule maps it back to
# InputValueError); on only while a CompiledAmpModule calls its compiled code, so that a user's own
# torch.compile of a converted module keeps the typed error (at a graph break).
COMPILED_REFUSAL = "graphamp refused the call: "


class _CompiledGuards:
    asserting = False


def _refusal(read: str, expected: Any, where: str) -> str:
    shown = repr(expected) if len(repr(expected)) < 60 else repr(expected)[:57] + "..."
    return (
        f"the model's code read a tensor value ({read}{f' at {where}' if where else ''}) that was {shown} on the "
        "example this graph follows, and differs on these inputs: eager runs another program for them."
    )


def guard_value(read: str, values: Sequence[Any], expected: Any, where: str = "") -> None:
    """Check that reading ``values`` as the model's code did (``read``: "bool", "item", "tolist",
    ...) gives what it gave on the example the graph was captured for; else raise
    :class:`graphamp.errors.InputValueError` (the module converts again for these inputs).

    In a CompiledAmpModule's compiled code a read one comparison checks is an ATen assertion
    instead of a Python ``bool`` (which would break dynamo's graph there).

    >>> guard_value("bool", [torch.ones(3).all()], True)
    >>> guard_value("item", [torch.tensor(2)], 3)
    Traceback (most recent call last):
    graphamp.errors.InputValueError: ...
    """
    if _CompiledGuards.asserting and traced() and len(values) == 1:
        condition = assert_condition(read, values[0], expected)
        if condition is not None:
            op, scalar = condition
            torch.ops.aten._assert_async.msg(op(values[0], scalar), COMPILED_REFUSAL + _refusal(read, expected, where))
            return
    got = _READS[read](*values)
    if not _same_value(got, expected):
        raise InputValueError(_refusal(read, expected, where))


@contextlib.contextmanager
def compiled_guards() -> Iterator[None]:
    """Guards as ATen assertions while tracing and running a CompiledAmpModule's code; a failed one
    is raised as :class:`InputValueError`."""
    previous, _CompiledGuards.asserting = _CompiledGuards.asserting, True
    try:
        yield
    except RuntimeError as e:
        if COMPILED_REFUSAL in str(e):
            raise InputValueError(str(e).split(COMPILED_REFUSAL, 1)[1].splitlines()[0]) from e
        raise
    finally:
        _CompiledGuards.asserting = previous


def guard_size(value: torch.Tensor, size: Sequence[int], where: str = "") -> torch.Tensor:
    """``value``, checked to have the size it had on the example (an op whose output size depends
    on values: ``nonzero``, ``masked_select``, ``unique``): the graph holds the sizes that follow."""
    if tuple(value.shape) != tuple(size):
        raise InputValueError(
            f"an op{f' at {where}' if where else ''} whose output size depends on tensor values gave {tuple(value.shape)} "
            f"where the example gave {tuple(size)}, and the graph holds the sizes that follow from it."
        )
    return value


# Dead-code elimination keeps their calls, whose results nothing reads.
torch.fx.node.has_side_effect(guard_value)
torch.fx.node.has_side_effect(guard_size)

# Named by the stable path, where generated code imports them and saved files find them.
for _stable in (InputGuard, guard_size, guard_value, size_condition_holds):
    _stable.__module__ = "graphamp.runtime"
del _stable
