"""The user-facing configuration of a conversion."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

import math

from graphamp.autotune.plan import AutotunePlan, BudgetPlan
from graphamp.policy import Category, op_key, resolve_dtype
from graphamp.runtime import FrozenDict

__all__ = ["Config"]


def _normalize_op(op: object) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return op_key(op)
    if isinstance(op, str):
        name = op.removeprefix("aten::").removeprefix("aten.")
        name = name.removesuffix(".default")
        packet_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None or (overload and overload not in packet.overloads()):
            raise ValueError(
                f"Config.op_overrides: {op!r} is not an ATen overload; write it as in the policy "
                "tables, e.g. 'linear', 'softmax.int', 'conv2d.padding', or pass torch.ops.aten.X.Y"
            )
        return name
    raise TypeError(
        f"Config.op_overrides keys must be str or torch.ops.aten overloads, got {type(op).__name__}"
    )


def _normalize_category(value: object) -> Category | None:
    if value is None or isinstance(value, Category):
        return value
    try:
        return Category(value)
    except ValueError:
        allowed = ", ".join(repr(c.value) for c in Category if c is not Category.BANNED)
        raise ValueError(
            f"Config.op_overrides values must be one of {allowed} or None (not autocast), got {value!r}"
        ) from None


@dataclass(frozen=True)
class Config:
    """Overrides on top of autocast's own policy.

    >>> from torch import nn
    >>> from graphamp import Category, Config
    >>> cfg = Config(op_overrides={"softmax.int": "fp32"}, fp32_modules=("encoder.layer.0.*", nn.LayerNorm))
    >>> assert cfg.op_overrides["softmax.int"] is Category.FP32
    """

    __module__ = "graphamp"  # its public path, which saved modules name

    # ATen op -> category to force ("fp32", "lower_precision_fp", ...) or None to take the op
    # off autocast's lists. Keys: "softmax.int"-style names or torch.ops.aten overloads.
    op_overrides: Mapping[str, Category | None] = field(default_factory=dict)
    # Submodules whose ops all run in float32 (eligible inputs cast up): qualified-name globs
    # such as "encoder.layer.*.attention", or nn.Module subclasses such as nn.LayerNorm.
    fp32_modules: tuple[str | type[nn.Module], ...] = ()
    # mode="autotune": a graphamp.AutotunePlan, mode="budget": a graphamp.BudgetPlan (or either's
    # to_dict() data) to replay instead of measuring; a plan made for another model, device or dtype
    # raises PlanMismatchError.
    plan: AutotunePlan | BudgetPlan | None = None
    # As torch.autocast's cache_enabled. True: one low-precision cast per fp32 weight that requires
    # grad per forward, shared by its uses, so their gradients sum in the low dtype before one cast
    # up. False: a cast per use, summed in fp32 (PyTorch Lightning's precision="bf16-mixed" runs
    # autocast this way). Outputs are the same either way; gradients of shared weights differ.
    cache_enabled: bool = True
    # mode="budget" only: the largest relative RMS error against fp32 (outputs, and gradients where
    # the conversion keeps them) allowed on the example and on a held-back batch. None: each batch's
    # cap is BUDGET_FACTOR (2) times eager autocast's own error there.
    error_budget: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cache_enabled, bool):
            raise TypeError(
                f"Config.cache_enabled must be True or False, as torch.autocast's cache_enabled, "
                f"got {type(self.cache_enabled).__name__}"
            )
        if not isinstance(self.op_overrides, Mapping):
            raise TypeError("Config.op_overrides must be a mapping from op to category")
        overrides = {_normalize_op(k): _normalize_category(v) for k, v in self.op_overrides.items()}
        object.__setattr__(self, "op_overrides", FrozenDict(overrides))
        modules = (self.fp32_modules,) if isinstance(self.fp32_modules, (str, type)) else tuple(self.fp32_modules)
        for m in modules:
            if not (isinstance(m, str) or (isinstance(m, type) and issubclass(m, nn.Module))):
                raise TypeError(
                    f"Config.fp32_modules entries must be qualified-name globs or nn.Module subclasses, got {m!r}"
                )
        object.__setattr__(self, "fp32_modules", modules)
        if isinstance(self.plan, Mapping):
            kind = BudgetPlan if self.plan.get("kind") == "budget" else AutotunePlan
            object.__setattr__(self, "plan", kind.from_dict(self.plan))
        elif self.plan is not None and not isinstance(self.plan, (AutotunePlan, BudgetPlan)):
            raise TypeError(
                f"Config.plan must be a graphamp.AutotunePlan or BudgetPlan (AutotunePlan.of(amp), BudgetPlan.of(amp), "
                f"or their load(path)), got {type(self.plan).__name__}"
            )
        if self.error_budget is not None:
            if isinstance(self.error_budget, bool) or not isinstance(self.error_budget, (int, float)) or not (
                self.error_budget > 0 and math.isfinite(self.error_budget)
            ):
                raise ValueError(
                    f"Config.error_budget is the largest relative RMS error against fp32 mode='budget' may reach, a "
                    f"positive number such as 0.01, or None for twice eager autocast's own error; got {self.error_budget!r}"
                )
            object.__setattr__(self, "error_budget", float(self.error_budget))

    @classmethod
    def from_model(cls, model: nn.Module, *, dtype: torch.dtype | str = torch.float16) -> Config:
        """The modules a model declares must stay in fp32, as ``fp32_modules``: opt-in, since eager
        autocast ignores these declarations.

        Reads transformers' ``_keep_in_fp32_modules`` (honoured for fp16, as ``from_pretrained``
        does) and ``_keep_in_fp32_modules_strict`` (fp16 and bf16) from the model and its
        submodules. Each declared name ``n`` becomes the globs ``n`` and ``*.n``: every module
        called ``n``, at any depth. ``graphamp.explain`` names the modules kept, and why.

        >>> from torch import nn
        >>> class T5Like(nn.Module):
        ...     _keep_in_fp32_modules = ["wo"]
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.wi, self.wo = nn.Linear(4, 8), nn.Linear(8, 4)
        >>> assert Config.from_model(T5Like()).fp32_modules == ("wo", "*.wo")
        >>> assert Config.from_model(T5Like(), dtype=torch.bfloat16).fp32_modules == ()
        """
        dtype = resolve_dtype(dtype, "cpu")
        attrs = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict") if dtype == torch.float16 else ("_keep_in_fp32_modules_strict",)
        names = dict.fromkeys(n for m in model.modules() for a in attrs for n in sorted(getattr(type(m), a, None) or ()))
        return cls(fp32_modules=tuple(g for n in names for g in (n, f"*.{n}")))

    @property
    def is_default(self) -> bool:
        """Nothing asked beyond eager autocast with its defaults."""
        return self.keeps_policy and self.cache_enabled

    @property
    def keeps_policy(self) -> bool:
        """Autocast's own policy: no op overridden, no module kept in fp32, so every node's dtype
        is eager's (``cache_enabled`` changes where casts are shared, not any dtype)."""
        return not self.all_overrides and not self.fp32_modules

    @property
    def all_overrides(self) -> Mapping[str, Category | None]:
        """The op overrides the policy applies: a budget plan's decisions, then ``op_overrides``
        (which the budget search never moves)."""
        if not isinstance(self.plan, BudgetPlan) or not self.plan.overrides:
            return self.op_overrides
        return {**{op: Category(c) for op, c in self.plan.overrides.items()}, **self.op_overrides}

    def keeps_fp32(self, module_stack: Mapping[str, tuple[str, object]] | None) -> str | None:
        """The first module on ``module_stack`` (a node's ``nn_module_stack``) kept in fp32, if any."""
        if not self.fp32_modules or not module_stack:
            return None
        for path, type_ in module_stack.values():
            type_name = type_ if isinstance(type_, str) else f"{type_.__module__}.{type_.__qualname__}"
            for m in self.fp32_modules:
                if isinstance(m, str):
                    if path and fnmatch.fnmatchcase(path, m):
                        return path
                elif type_name == f"{m.__module__}.{m.__qualname__}":
                    return path or "<root>"
        return None
