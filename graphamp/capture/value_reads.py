"""Record each read of a tensor value by the model's code (``bool(t)``, ``t.item()``, ``torch.equal``,
...): what it gave and where, with a marker node in the graph the capture on values traces.

:mod:`graphamp.capture.values` turns each marker into a guard; ``eager_reads`` tells whether eager's
Python reads any value at all.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from graphamp.eager import state_restored
from graphamp.runtime import Slot
from graphamp.spec import ambient_autocast

__all__ = ["VALUE_READ", "Read", "ValueReads", "eager_reads"]


@torch.library.custom_op("graphamp::value_read", mutates_args=())
def _value_read(tensors: list[torch.Tensor], key: int) -> None:
    """A marker the tracer records where the model's code read tensor values (``key`` into the reads)."""


@_value_read.register_fake
def _(tensors: list[torch.Tensor], key: int) -> None:
    return None


VALUE_READ = torch.ops.graphamp.value_read.default

# The Python-level reads of tensor values model code branches on, by the name the run-time guard
# reads them with (graphamp.runtime_guards._READS).
_T = torch.Tensor
_READ_NAMES: dict[Any, str] = {
    _T.item: "item", _T.__bool__: "bool", _T.__int__: "int", _T.__float__: "float", _T.__index__: "index",
    _T.__complex__: "complex", _T.is_nonzero: "is_nonzero", torch.is_nonzero: "is_nonzero", _T.tolist: "tolist",
    _T.numpy: "numpy", _T.__array__: "numpy", _T.equal: "equal", torch.equal: "equal", _T.__contains__: "contains",
    _T.allclose: "allclose", torch.allclose: "allclose",
}


class Read:
    """One read: how, its arguments (tensors as slots), what it gave, and where in the model's code."""

    def __init__(self, name: str, template: Any, observed: Any, where: str) -> None:
        self.name, self.template, self.observed, self.where = name, template, observed, where


class ValueReads(TorchFunctionMode):
    """Records each read of a tensor value by the model's code, with a marker node in the graph."""

    def __init__(self, flip: int | None = None) -> None:
        super().__init__()
        self.reads: list[Read] = []
        self.flip = flip  # the read whose (bool) value the model's code is told the opposite of

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _READ_NAMES.get(func)
        if name is None or kwargs:
            return out
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            return out
        template = tuple(Slot(next(i for i, t in enumerate(tensors) if t is a)) if isinstance(a, torch.Tensor) else a for a in args)
        observed = out.tolist() if name == "numpy" else out
        self.reads.append(Read(name, template, observed, _model_line()))
        _value_read(tensors, len(self.reads) - 1)
        if self.flip == len(self.reads) - 1 and isinstance(out, bool):
            return not out
        return out


def _model_line() -> str:
    """file:line of the model code that made the current call (the first frame outside torch and graphamp)."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    here = __file__.rsplit("/", 2)[0]
    for frame in inspect.stack(context=0)[2:]:
        if not frame.filename.startswith((torch_dir, here)):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return ""


def eager_reads(model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype) -> list[Read]:
    """The tensor values the model's Python reads when eager autocast runs it on the example (one
    forward without grad; the model's state put back)."""
    reads = ValueReads()
    with state_restored(model), ambient_autocast(device_type, dtype), torch.no_grad(), reads:
        model(*args, **kwargs)
    return reads.reads
