"""The verify report: per-output and per-gradient checks, the divergences, text and JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import torch
from torch.utils import _pytree as pytree

from graphamp.policy import short_dtype


@dataclasses.dataclass(frozen=True)
class OutputCheck:
    """One output leaf, converted module against eager autocast."""

    index: int
    path: str  # the leaf's place in the output pytree, e.g. "['last_hidden_state']"
    dtype: str | None  # None for non-tensor leaves
    eager_dtype: str | None
    dtype_match: bool
    shape_match: bool
    bitwise_equal: bool | None  # None when values are not compared (fake CUDA)
    max_abs_error: float | None
    max_rel_error: float | None  # max |got - eager| / max |eager|
    sqnr_db: float | None  # 10 log10(sum eager^2 / sum (got - eager)^2); inf when equal

    @property
    def ok(self) -> bool:
        return self.dtype_match and self.shape_match and self.bitwise_equal is not False


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first op where the converted graph and eager autocast disagree."""

    kind: str  # "dtype": same op, other dtypes; "structure": ops present on one side only
    index: int  # position in the converted side's sequence of compute ops
    node: str | None  # the converted graph's node that produced the op
    target: str | None  # that node's op, e.g. "aten.layer_norm.default"
    module_path: str | None  # innermost module of the node's nn_module_stack ("" is the root)
    module_type: str | None
    graphamp_op: str | None  # the lowered ATen op on each side
    eager_op: str | None
    graphamp_inputs: tuple[str, ...]  # dtype history of each tensor input, e.g. "fp32->bf16"
    eager_inputs: tuple[str, ...]
    graphamp_outputs: tuple[str, ...]
    eager_outputs: tuple[str, ...]
    reason: str | None  # graphamp's recorded decision for the node
    captured_dtypes: tuple[str, ...] | None  # the node's dtypes as eager autocast produced them at capture
    graphamp_only: tuple[str, ...] = ()  # for "structure": the unmatched ops on each side (first few)
    eager_only: tuple[str, ...] = ()

    def describe(self) -> str:
        where = f"node {self.node} ({self.target})" if self.node else "an op with no converted node"
        if self.module_path is not None:
            where += f" in module {self.module_path or '<root>'} ({self.module_type})"
        lines = [f"first divergence ({self.kind}) at compute op #{self.index}: {where}"]
        lines.append(f"  graphamp: {_call(self.graphamp_op, self.graphamp_inputs, self.graphamp_outputs)}")
        lines.append(f"  eager:    {_call(self.eager_op, self.eager_inputs, self.eager_outputs)}")
        if self.kind == "structure":
            lines.append(f"  ops only in graphamp: {', '.join(self.graphamp_only) or '-'}; only in eager: {', '.join(self.eager_only) or '-'}")
        if self.reason:
            lines.append(f"  graphamp's decision: {self.reason}")
        return "\n".join(lines)


def _call(op: str | None, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> str:
    if op is None:
        return "(no op here)"
    return f"{op}({', '.join(inputs)}) -> {', '.join(outputs) or '()'}"


@dataclasses.dataclass(frozen=True)
class GradCheck:
    """One gradient with ``grads=True``: a parameter's or a floating input's, converted against eager."""

    name: str  # the parameter's qualified name, or the input's place: "args[0]", "kwargs['pixel_values']"
    kind: str  # "param" or "input"
    dtype: str | None  # None when the converted side produced no gradient
    eager_dtype: str | None
    bitwise_equal: bool
    max_abs: float | None  # None when one side has no gradient or the shapes differ
    max_rel: float | None  # max |got - eager| / max |eager|
    sqnr_db: float | None

    @property
    def ok(self) -> bool:
        return self.bitwise_equal


@dataclasses.dataclass(frozen=True)
class GradDivergence:
    """Where the backward first departs from eager's, walking from the outputs toward the inputs.

    ``node`` is the converted graph's node whose output gradient is the first (in backward order)
    to differ from eager's gradient of the same value. Its own backward has not run yet at that
    point: the difference comes from the backward of one of its ``consumers``.
    """

    node: str | None  # None when the differing gradients could not be tied to an aligned op
    target: str | None  # the node's op, e.g. "aten.linear.default"
    op: str | None  # the lowered ATen op whose output gradient differs
    index: int | None  # position of that op in the converted side's sequence of compute ops
    module_path: str | None
    module_type: str | None
    reason: str | None  # graphamp's recorded decision for the node's dtype
    max_abs: float | None  # max |grad - eager grad| of that output
    consumers: tuple[str, ...] = ()  # compute nodes reading the value (casts and views followed)
    consumer_modules: tuple[str, ...] = ()  # their module paths, in the same order

    def describe(self) -> str:
        if self.node is None:
            return "gradients differ, but no aligned forward op has a differing output gradient (see the gradient lines)"
        where = f"node {self.node} ({self.target})"
        if self.module_path is not None:
            where += f" in module {self.module_path or '<root>'} ({self.module_type})"
        lines = [f"first divergent gradient in backward order: output of {where}, op #{self.index} {self.op}, max|err| {self.max_abs:.3g}"]
        if self.consumers:
            read_by = ", ".join(f"{c} ({m or '<root>'})" for c, m in zip(self.consumers, self.consumer_modules))
            lines.append(f"  its gradient comes from the backward of: {read_by}")
        if self.reason:
            lines.append(f"  graphamp's decision: {self.reason}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`verify` found. ``ok`` means equivalent; ``str(report)`` is a readable summary.

    >>> from torch import nn
    >>> from graphamp import verify
    >>> report = verify(nn.Linear(4, 4), (torch.randn(2, 4),))
    >>> assert report.ok and json.loads(report.to_json())["ok"] is True
    """

    model: str
    device_type: str
    dtype: str
    mode: str
    values_compared: bool  # False on fake CUDA: outputs are compared by dtype and shape only
    outputs: tuple[OutputCheck, ...]
    output_structure_match: bool
    # The first aligned op whose dtypes differ; if there is none, the first op present on one
    # side only (a composite decomposed differently, or another kernel chosen).
    divergence: Divergence | None
    # Runs of ops present on one side only. With values compared and every output bitwise
    # equal they do not fail the check; without values (fake CUDA) they do.
    structure_differences: int
    ops: dict[str, int]  # compute ops on each side, and how many aligned with equal signatures
    casts: dict[str, int]  # casts executed in one forward, on each side
    notes: tuple[str, ...] = ()
    # With grads=True: every parameter's and floating input's gradient of a fixed loss, and
    # where the backward first diverges (None when the gradients agree).
    grads_compared: bool = False
    grads: tuple[GradCheck, ...] = ()
    grad_divergence: GradDivergence | None = None
    # With compile=True: the compiled module's (convert(..., compile=True)) difference from eager
    # autocast, a graphamp.Drift. Not part of ok: inductor is not bitwise, and says so.
    compiled_drift: Any = None

    @property
    def ok(self) -> bool:
        if not (self.output_structure_match and all(o.ok for o in self.outputs)):
            return False
        if not all(g.ok for g in self.grads):
            return False
        if self.divergence is None:
            return True
        return self.divergence.kind == "structure" and self.values_compared and all(o.bitwise_equal is not False for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ok"] = self.ok
        return _json_safe(data)

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int = 2) -> str:
        """The report as JSON (non-finite floats as strings); written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def summary(self) -> str:
        status = "OK" if self.ok else "DIVERGES"
        lines = [f"graphamp.verify {self.model} {self.device_type}/{self.dtype} mode={self.mode}: {status}"]
        compared = "dtypes, shapes and values (bitwise)" if self.values_compared else "dtypes and shapes only; values not compared (fake CUDA tensors hold no data)"
        lines.append(f"  outputs: {len(self.outputs)} compared by {compared}")
        if not self.output_structure_match:
            lines.append("  output pytrees differ in structure")
        for o in self.outputs:
            lines.append("    " + _output_line(o))
        lines.append(
            f"  compute ops: graphamp {self.ops['graphamp']}, eager {self.ops['eager']}, "
            f"{self.ops['matched']} aligned with equal (op, input dtypes, output dtypes)"
        )
        lines.append(f"  casts per forward: graphamp {self.casts['graphamp']}, eager autocast {self.casts['eager']}")
        if self.divergence is not None:
            lines.extend("  " + line for line in self.divergence.describe().splitlines())
        if self.structure_differences:
            lines.append(f"  runs of ops present on one side only: {self.structure_differences}")
        if self.grads_compared:
            lines.extend(self._grad_lines())
        if self.compiled_drift is not None:
            lines.append(f"  compiled (convert(..., compile=True), inductor, not bitwise): {self.compiled_drift.line()}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    __str__ = summary

    def _grad_lines(self) -> list[str]:
        params = sum(g.kind == "param" for g in self.grads)
        differ = [g for g in self.grads if not g.ok]
        verdict = f"{len(differ)} NOT bitwise equal" if differ else ("all bitwise equal" if self.grads else "nothing to compare")
        lines = [
            f"  gradients: {len(self.grads)} compared ({params} parameters, {len(self.grads) - params} floating inputs) "
            f"of a fixed loss (each float output weighted by linspace(-1, 1), summed in fp32): {verdict}"
        ]
        lines.extend("    " + _grad_line(g) for g in differ)
        if self.grad_divergence is not None:
            lines.extend("  " + line for line in self.grad_divergence.describe().splitlines())
        return lines


def _output_line(o: OutputCheck) -> str:
    head = f"[{o.index}] {o.path or '<output>'}: {o.dtype or '(not a tensor)'}"
    if not o.dtype_match:
        head += f" (eager {o.eager_dtype})"
    if not o.shape_match:
        head += " shape differs"
    if o.bitwise_equal is None:
        return head + (" ok" if o.ok else "")
    verdict = ("bitwise equal" if o.dtype else "equal") if o.bitwise_equal else "NOT equal"
    if o.max_abs_error is not None:
        verdict += f", max|err| {o.max_abs_error:.3g}, rel {o.max_rel_error:.3g}, SQNR {o.sqnr_db:.1f} dB"
    return f"{head} {verdict}"


def _grad_line(g: GradCheck) -> str:
    head = f"{g.kind} {g.name}: {g.dtype or '(no gradient)'}"
    if g.dtype != g.eager_dtype:
        head += f" (eager {g.eager_dtype or 'no gradient'})"
    if g.bitwise_equal:
        return f"{head} bitwise equal"
    if g.max_abs is None:
        return f"{head} NOT equal"
    return f"{head} NOT equal, max|err| {g.max_abs:.3g}, rel {g.max_rel:.3g}, SQNR {g.sqnr_db:.1f} dB"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _compare_outputs(out: Any, ref: Any, values: bool) -> tuple[tuple[OutputCheck, ...], bool]:
    got, got_spec = pytree.tree_flatten(out)
    with_paths, want_spec = pytree.tree_flatten_with_path(ref)
    checks = []
    for i, ((path, want), have) in enumerate(zip(with_paths, got)):
        checks.append(_compare_leaf(i, pytree.keystr(path), have, want, values))
    return tuple(checks), got_spec == want_spec


def _compare_leaf(index: int, path: str, got: Any, want: Any, values: bool) -> OutputCheck:
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        same = type(got) is type(want) and (not values or got == want)
        return OutputCheck(index, path, None, None, same, True, same if values else None, None, None, None)
    dtype_match = got.dtype == want.dtype
    shape_match = tuple(got.shape) == tuple(want.shape)
    if not values:
        return OutputCheck(index, path, short_dtype(got.dtype), short_dtype(want.dtype), dtype_match, shape_match, None, None, None, None)
    got, want = got.detach(), want.detach()
    if not shape_match:
        return OutputCheck(index, path, short_dtype(got.dtype), short_dtype(want.dtype), dtype_match, False, False, None, None, None)
    equal = dtype_match and (torch.equal(got, want) or _equal_nan(got, want))
    abs_err, rel_err, sqnr = error_metrics(got, want)
    return OutputCheck(index, path, short_dtype(got.dtype), short_dtype(want.dtype), dtype_match, True, equal, abs_err, rel_err, sqnr)


def error_metrics(got: torch.Tensor, want: torch.Tensor) -> tuple[float | None, float | None, float | None]:
    """Max abs error, max abs error relative to max |want|, and SQNR in dB, over finite elements."""
    if got.dtype == torch.bool or got.is_complex() or want.is_complex():
        return None, None, None
    a, b = got.double(), want.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    diff = (a - b)[finite].abs()
    abs_err = diff.max().item() if diff.numel() else 0.0
    scale = b[finite].abs().max().item() if diff.numel() else 0.0
    rel_err = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else math.inf)
    noise = diff.square().sum().item()
    signal = b[finite].square().sum().item()
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return abs_err, rel_err, sqnr


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


def _detached(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), tree)
