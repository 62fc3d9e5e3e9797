"""The plans of the measured modes: which of autocast's low-precision ops ``mode="autotune"`` raised to
fp32, and which op types ``mode="budget"`` moved off autocast's dtype, and why.

``graphamp.convert(..., mode="autotune")`` measures; ``AutotunePlan.of(amp)`` is its plan;
``Config(plan=plan)`` replays it without measuring, so a deployment converts the same way on every
run. A plan is plain data (JSON through :meth:`AutotunePlan.save`/:meth:`AutotunePlan.load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphamp.errors import PlanMismatchError
from graphamp.node_info import GraphInfo, peek_graph_info
from graphamp.runtime import FrozenDict

__all__ = ["AutotunePlan", "BudgetPlan", "BudgetStep", "PlanMismatchError", "fingerprint"]

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


class _Plan:
    """What both plans share: read from a converted module, written and read as JSON."""

    _MODE = ""  # the convert mode that makes the plan

    @classmethod
    def of(cls, amp: torch.nn.Module) -> Any:
        """The plan the conversion in this mode made (``amp`` its AmpModule or CompiledAmpModule)."""
        plan = (peek_graph_info(getattr(amp, "amp", amp)) or GraphInfo()).plan
        if not isinstance(plan, cls):
            raise ValueError(
                f"this module has no {cls._MODE} plan: it was not converted with mode={cls._MODE!r}. Way out: "
                f"graphamp.convert(model, args, mode={cls._MODE!r})"
            )
        return plan

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Any:
        """Read a plan written by :meth:`save`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


@dataclasses.dataclass(frozen=True)
class AutotunePlan(_Plan):
    """The decisions of one autotune conversion, replayable through ``Config(plan=...)``.

    >>> import json, torch
    >>> plan = AutotunePlan("cpu", torch.bfloat16, "0123456789abcdef", {"linear": torch.float32, "linear_1": torch.bfloat16})
    >>> assert plan.raised == ("linear",)
    >>> assert AutotunePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    """

    __module__ = "graphamp"
    _MODE = "autotune"

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


@dataclasses.dataclass(frozen=True)
class BudgetStep:
    """One decision of ``mode="budget"``: an op type moved to another dtype in every node that has
    it, with what that measured, and whether it was kept."""

    __module__ = "graphamp"

    op: str  # the ATen op, as Config.op_overrides spells it ("layer_norm", "add.Tensor")
    nodes: int  # how many nodes of the program have it
    tried: str  # "lower_precision_fp" (moved to the low dtype) or "fp32"
    kept: bool
    # Relative RMS error against fp32 on the example and on the held-back batch (outputs, and
    # gradients where the conversion keeps them); inf where it could not be measured.
    error: float
    error_held_back: float
    # The program's time with this op moved over its time without (median of interleaved rounds);
    # None where it was not timed (the error was over the budget already).
    time_ratio: float | None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BudgetPlan(_Plan):
    """The decisions of one ``mode="budget"`` conversion, replayable through ``Config(plan=...)``.

    ``overrides`` are the op types moved off autocast's dtype, as ``Config.op_overrides`` spells
    them; ``steps`` every op type tried, in order, with its measured error and time.

    >>> import json, torch
    >>> step = BudgetStep("layer_norm", 9, "lower_precision_fp", True, 0.004, 0.005, 0.9, "0.90x the time, within the budget")
    >>> plan = BudgetPlan("cpu", torch.bfloat16, {"layer_norm": "lower_precision_fp"}, steps=(step,))
    >>> assert plan.lowered == ("layer_norm",) and plan.raised == ()
    >>> assert BudgetPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    """

    __module__ = "graphamp"
    _MODE = "budget"

    device_type: str
    dtype: torch.dtype
    # ATen op -> "lower_precision_fp" or "fp32": the op types moved off autocast's dtype.
    overrides: Mapping[str, str]
    steps: tuple[BudgetStep, ...] = ()
    # The error cap on each batch (example, held-back), and eager autocast's own error there.
    budget: tuple[float, float] = (math.inf, math.inf)
    autocast_error: tuple[float, float] = (0.0, 0.0)
    # The chosen program's error on each batch.
    error: tuple[float, float] = (0.0, 0.0)
    # What was timed: "eager" (the converted graph) or "compiled" (each program through inductor).
    timed: str = "eager"
    measure_s: float = 0.0
    machine: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str):
            raise TypeError(f"BudgetPlan.device_type must be a string, got {type(self.device_type).__name__}")
        object.__setattr__(self, "dtype", _dtype(self.dtype, "dtype"))
        if not isinstance(self.overrides, Mapping):
            raise TypeError("BudgetPlan.overrides must map ATen op names to 'lower_precision_fp' or 'fp32'")
        overrides = {}
        for op, category in self.overrides.items():
            category = getattr(category, "value", category)
            if category not in ("lower_precision_fp", "fp32"):
                raise ValueError(f"BudgetPlan override for {op!r} is {category!r}; a budget plan moves an op to 'lower_precision_fp' or 'fp32'")
            overrides[str(op)] = category
        object.__setattr__(self, "overrides", FrozenDict(overrides))
        object.__setattr__(self, "steps", tuple(s if isinstance(s, BudgetStep) else BudgetStep(**s) for s in self.steps))
        for name in ("budget", "autocast_error", "error"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    @property
    def lowered(self) -> tuple[str, ...]:
        """The op types moved to the low dtype, which autocast keeps in fp32."""
        return tuple(op for op, c in self.overrides.items() if c == "lower_precision_fp")

    @property
    def raised(self) -> tuple[str, ...]:
        """The op types moved to fp32, which autocast runs in the low dtype."""
        return tuple(op for op, c in self.overrides.items() if c == "fp32")

    def reason(self, op: str) -> str:
        """Why ``op`` has its dtype: the step that moved it."""
        step = next((s for s in self.steps if s.op == op and s.kept), None)
        return f"budget plan: {step.why}" if step is not None else "budget plan (replayed)"

    def summary(self) -> str:
        """One line: what moved, at what error, and what measuring cost."""
        low = _dtype_name(self.dtype)
        moved = ", ".join(f"{op} to {'fp32' if c == 'fp32' else low}" for op, c in self.overrides.items()) or "nothing moved"
        return (
            f"budget ({low}): {moved}; {len(self.steps)} op types tried, timed {self.timed}, in {self.measure_s:.1f} s; "
            f"relative RMS error vs fp32 {self.error[0]:.3g} on the example and {self.error[1]:.3g} on a held-back batch "
            f"(budget {self.budget[0]:.3g} and {self.budget[1]:.3g}; eager autocast's {self.autocast_error[0]:.3g} and "
            f"{self.autocast_error[1]:.3g})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (infinite errors as the string "inf")."""
        data = {
            "kind": "budget", "version": _VERSION, "device_type": self.device_type, "dtype": _dtype_name(self.dtype),
            "overrides": dict(self.overrides), "steps": [s.to_dict() for s in self.steps], "budget": list(self.budget),
            "autocast_error": list(self.autocast_error), "error": list(self.error), "timed": self.timed,
            "measure_s": self.measure_s, "machine": self.machine,
        }
        return json.loads(json.dumps(data, default=str).replace("Infinity", '"inf"'))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BudgetPlan:
        if not isinstance(data, Mapping) or data.get("kind") != "budget" or data.get("version") != _VERSION:
            raise ValueError(
                f"not a graphamp budget plan of version {_VERSION}; make one with "
                "BudgetPlan.of(graphamp.convert(..., mode='budget'))"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in fields}
        data["steps"] = tuple(
            BudgetStep(**{k: (float(v) if v == "inf" else v) for k, v in s.items()}) for s in data.get("steps", ())
        )
        for name in ("budget", "autocast_error", "error"):
            if name in data:
                data[name] = tuple(float(v) for v in data[name])
        return cls(**data)

    def check(self, device_type: str, dtype: torch.dtype) -> None:
        """Raise PlanMismatchError unless the plan was made for this device and dtype."""
        if (self.device_type, self.dtype) != (device_type, dtype):
            raise PlanMismatchError(
                f"Config(plan=...) was made for {self.device_type} {_dtype_name(self.dtype)}, but this conversion is "
                f"{device_type} {_dtype_name(dtype)}. Way out: convert with mode='budget' and no plan to measure afresh."
            )
