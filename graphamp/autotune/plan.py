"""An autotune plan: which of autocast's low-precision ops ``mode="autotune"`` raised to fp32, and why.

``graphamp.convert(..., mode="autotune")`` measures; ``AutotunePlan.of(amp)`` is its plan;
``Config(plan=plan)`` replays it without measuring, so a deployment converts the same way on every
run. A plan is plain data (JSON through :meth:`AutotunePlan.save`/:meth:`AutotunePlan.load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphamp.errors import PlanMismatchError
from graphamp.node_info import GraphInfo, peek_graph_info
from graphamp.runtime import FrozenDict

__all__ = ["AutotunePlan", "PlanMismatchError", "fingerprint"]

_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(value: object, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"AutotunePlan {what}: {value!r} is not one of {', '.join(_DTYPES)}")


def fingerprint(candidates: Sequence[tuple[str, str, str]]) -> str:
    """A short hash of the (node name, ATen op, input shapes) of the ops a plan decides."""
    return hashlib.sha256(repr(tuple(candidates)).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class AutotunePlan:
    """The decisions of one autotune conversion, replayable through ``Config(plan=...)``.

    >>> import json, torch
    >>> plan = AutotunePlan("cpu", torch.bfloat16, "0123456789abcdef", {"linear": torch.float32, "linear_1": torch.bfloat16})
    >>> assert plan.raised == ("linear",)
    >>> assert AutotunePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    """

    __module__ = "graphamp"

    # The policy's device and low dtype the plan was made for.
    device_type: str
    dtype: torch.dtype
    # fingerprint() of the ops decided, in graph order: replaying on another model is refused.
    model: str
    # Node name -> the dtype it computes in: the low dtype (as autocast) or torch.float32 (raised).
    decisions: Mapping[str, torch.dtype]
    # Node name -> (low ms, fp32 ms) as measured, each including the casts the choice implies.
    times_ms: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # The node name -> (ATen op, input shapes) decided, for error messages.
    ops: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The machine measured on (graphamp.hardware.Capability.key()).
    machine: str = ""
    # Seconds spent measuring, op signatures timed now, found in the cache, and left unmeasured
    # (kept low, as autocast) because the measuring budget ran out or the op could not be timed.
    measure_s: float = 0.0
    measured: int = 0
    cached: int = 0
    unmeasured: int = 0
    # The end-to-end check on the example (graphamp.convert): the raised program's max error against
    # fp32 beside eager autocast's, and whether the raises were undone; "" where it did not run.
    accuracy: str = ""
    check_s: float = 0.0
    # convert(compile=True): the compiled candidate programs timed whole and the one chosen
    # (graphamp.autotune.compiled); "" where none were timed.
    compiled: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str):
            raise TypeError(f"AutotunePlan.device_type must be a string, got {type(self.device_type).__name__}")
        object.__setattr__(self, "dtype", _dtype(self.dtype, "dtype"))
        if self.dtype is torch.float32:
            raise ValueError("AutotunePlan.dtype is the low dtype the plan was made for (bfloat16 or float16), not float32")
        if not isinstance(self.decisions, Mapping):
            raise TypeError("AutotunePlan.decisions must map node names to dtypes")
        decisions = {}
        for name, dtype in self.decisions.items():
            dtype = _dtype(dtype, f"decision for {name!r}")
            if dtype not in (self.dtype, torch.float32):
                raise ValueError(
                    f"AutotunePlan decision for {name!r} is {dtype}, but a {self.dtype} plan can only keep an op in "
                    f"{self.dtype} or raise it to float32"
                )
            decisions[str(name)] = dtype
        object.__setattr__(self, "decisions", FrozenDict(decisions))
        object.__setattr__(self, "times_ms", FrozenDict({str(k): tuple(map(float, v)) for k, v in self.times_ms.items()}))
        object.__setattr__(self, "ops", FrozenDict({str(k): str(v) for k, v in self.ops.items()}))

    @classmethod
    def of(cls, amp: torch.nn.Module) -> AutotunePlan:
        """The plan an ``mode="autotune"`` conversion made (``amp`` is its AmpModule)."""
        plan = (peek_graph_info(amp) or GraphInfo()).plan
        if plan is None:
            raise ValueError(
                "this module has no autotune plan: it was not converted with mode='autotune'. Way out: "
                "graphamp.convert(model, args, mode='autotune')"
            )
        return plan

    @property
    def raised(self) -> tuple[str, ...]:
        """The nodes raised to fp32, in graph order."""
        return tuple(name for name, dtype in self.decisions.items() if dtype is torch.float32)

    def summary(self) -> str:
        """One line: how many ops were raised, and what measuring cost."""
        return (
            f"autotune ({_dtype_name(self.dtype)}): {len(self.raised)} of {len(self.decisions)} low-precision ops raised "
            f"to fp32; measuring took {self.measure_s:.2f} s ({self.measured} op shapes timed, {self.cached} from the "
            f"cache, {self.unmeasured} left as autocast unmeasured: the budget was spent, or the op could not be timed alone)"
            + (f"; {self.accuracy}" if self.accuracy else "")
            + (f"; {self.compiled}" if self.compiled else "")
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return {
            "version": _VERSION,
            "device_type": self.device_type,
            "dtype": _dtype_name(self.dtype),
            "model": self.model,
            "decisions": {k: _dtype_name(v) for k, v in self.decisions.items()},
            "times_ms": {k: list(v) for k, v in self.times_ms.items()},
            "ops": dict(self.ops),
            "machine": self.machine,
            "measure_s": self.measure_s,
            "measured": self.measured,
            "cached": self.cached,
            "unmeasured": self.unmeasured,
            "accuracy": self.accuracy,
            "check_s": self.check_s,
            "compiled": self.compiled,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutotunePlan:
        """A plan from :meth:`to_dict`'s data."""
        if not isinstance(data, Mapping) or data.get("version") != _VERSION:
            raise ValueError(
                f"not a graphamp autotune plan of version {_VERSION}; make one with "
                "AutotunePlan.of(graphamp.convert(..., mode='autotune'))"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AutotunePlan:
        """Read a plan written by :meth:`save`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def check(self, device_type: str, dtype: torch.dtype, model: str, ops: Mapping[str, str]) -> None:
        """Raise PlanMismatchError unless the plan was made for this device, dtype and model."""
        way_out = "Way out: convert with mode='autotune' and no plan to measure afresh, or pass the plan made for this model."
        if (self.device_type, self.dtype) != (device_type, dtype):
            raise PlanMismatchError(
                f"Config(plan=...) was made for {self.device_type} {_dtype_name(self.dtype)}, but this conversion is "
                f"{device_type} {_dtype_name(dtype)}. {way_out}"
            )
        if self.model != model or list(self.decisions) != list(ops):
            mine, theirs = list(ops.items()), list(self.ops.items()) or [(k, "?") for k in self.decisions]
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            got = f"{mine[first][0]} = {mine[first][1]}" if first < len(mine) else "nothing"
            want = f"{theirs[first][0]} = {theirs[first][1]}" if first < len(theirs) else "nothing"
            raise PlanMismatchError(
                f"Config(plan=...) was made for another model: it decides {len(self.decisions)} low-precision ops, "
                f"this model has {len(ops)}; the first difference is op #{first}: this model has {got}, the plan "
                f"has {want}. {way_out}"
            )
