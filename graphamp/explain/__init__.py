"""``graphamp.explain``: every decision of a conversion and its reason, and its numerics against fp32.

>>> import torch, graphamp
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
>>> e = graphamp.explain(model, (torch.randn(4, 8),), dtype=torch.float16)
>>> assert e.node("linear").dtype == "fp16" and e.module("").ops == e.module("0").ops + e.module("1").ops == 2
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from typing import Any

import torch
from torch import nn
from torch.fx import Node
from torch.utils import _pytree as pytree

from graphamp.config import Config
from graphamp.autotune.plan import AutotunePlan, BudgetPlan
from graphamp.convert import check_inputs, convert
from graphamp.errors import CaptureError
from graphamp.pipeline import build
from graphamp.emit import AmpModule
from graphamp.explain.html import render
from graphamp.explain.numerics import GradNumerics, NodeNumerics, cast_target, finite, grad_underflow, record_of, run_side_by_side
from graphamp.spec import AmpSpec
from graphamp.verify.report import error_metrics

from graphamp.node_info import GraphInfo, innermost_module, peek_graph_info
from graphamp.policy import LOW_DTYPES, short_dtype
from graphamp.explain.numerics import run_fp32

__all__ = ["explain", "Explanation", "NodeRecord", "ModuleRecord", "OutputNumerics", "GradNumerics", "NodeNumerics"]

# torch.export's name for nodes it could not place in a module: they belong to the root.
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """One op node of the converted graph: what it computes in, why, and (numerics) how far off."""

    name: str
    op: str  # the ATen op, e.g. "aten.linear.default"
    module: str  # innermost module path ("" is the root)
    module_type: str | None
    dtype: str | None  # output dtype, e.g. "fp16"; None for non-tensor outputs
    category: str | None  # the autocast list applied, if any
    reason: str  # graphamp's recorded reason for the dtype
    input_casts: tuple[str, ...]  # casts on its inputs: "fp32->fp16 x (lower_precision_fp input of linear)"
    kept_fp32_by: str | None  # the fp32 module the config kept it in
    numerics: NodeNumerics | None = None


@dataclasses.dataclass
class ModuleRecord:
    """A module's roll-up: its own op nodes and, in ``ops*``, its whole subtree's."""

    path: str
    type: str
    depth: int
    own_ops: int = 0
    ops: int = 0
    ops_low: int = 0
    ops_fp32: int = 0
    ops_other: int = 0  # integer, bool, fp64 or non-tensor outputs
    casts_to_low: int = 0
    casts_to_fp32: int = 0
    kept_fp32: str | None = None  # why the config keeps it in fp32
    max_rel: float | None = None  # worst accumulated relative error against fp32 in the subtree
    min_sqnr_db: float | None = None
    overflow: int = 0
    underflow: int = 0
    local_overflow: int = 0  # overflow its own ops make from finite inputs
    local_error: float = 0.0  # sum of the subtree's local relative errors: the search's descent
    own_local_overflow: int = 0  # the same two, for its own ops and input casts only
    own_local_error: float = 0.0


@dataclasses.dataclass(frozen=True)
class OutputNumerics:
    """One floating output against the fp32 model."""

    path: str
    dtype: str
    max_abs: float | None
    max_rel: float | None
    sqnr_db: float | None
    nonfinite: int


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found. ``print(e)`` summarises; ``to_json()``/``to_html(path)`` give everything."""

    model: str
    device_type: str
    dtype: str
    config: str
    nodes: tuple[NodeRecord, ...]
    modules: tuple[ModuleRecord, ...]  # every module of the model, in definition order; "" first
    casts: int
    kept_fp32: tuple[tuple[str, str], ...]  # (module path, why) for modules the config keeps in fp32
    numerics: bool
    first_nonfinite: NodeRecord | None = None
    outputs: tuple[OutputNumerics, ...] = ()
    grads: tuple[GradNumerics, ...] | None = None
    reference_failures: tuple[tuple[str, str], ...] = ()
    # mode="autotune" or "budget": the plan's summary, then one line per decision it measured.
    plan: tuple[str, ...] = ()

    def node(self, name: str) -> NodeRecord:
        """The record of the op node called ``name``."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no op node {name!r}; op nodes are listed in explanation.nodes")

    def module(self, path: str) -> ModuleRecord:
        """The roll-up of the module at ``path`` ("" is the root)."""
        for m in self.modules:
            if m.path == path:
                return m
        raise KeyError(f"no module {path!r}; see explanation.modules")

    def ranking(self) -> list[ModuleRecord]:
        """Modules (root excluded) by the error their own ops add, worst first: overflow, then local error."""
        return sorted((m for m in self.modules if m.path), key=lambda m: (-m.own_local_overflow, -m.own_local_error, m.depth))

    @property
    def ok(self) -> bool:
        """No output holds inf/nan that the fp32 model does not."""
        return all(o.nonfinite == 0 for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(dataclasses.asdict(self))

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int | None = 2) -> str:
        """Everything, as JSON; also written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """One self-contained page (no network): the module tree coloured by precision, per-module
        error bars, the overflow marked, a searchable table of the nodes. Written to ``path`` if given."""
        text = render(self)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def summary(self, top: int = 8) -> str:
        low = sum(n.dtype == self.dtype for n in self.nodes)
        fp32 = sum(n.dtype == "fp32" for n in self.nodes)
        lines = [
            f"graphamp.explain: {self.model} on {self.device_type}/{self.dtype}: {len(self.nodes)} op nodes "
            f"({low} {self.dtype}, {fp32} fp32, {len(self.nodes) - low - fp32} other), {self.casts} casts",
        ]
        if self.config != "Config()":
            lines.append(f"config: {self.config}")
        lines.extend(self.plan[:1] + tuple(f"  {line}" for line in self.plan[1:]))
        for path, why in self.kept_fp32:
            lines.append(f"kept in fp32: {path or '<root>'}: {why}")
        if self.numerics:
            f = self.first_nonfinite
            if f is None:
                lines.append(f"first inf/nan: none (no node overflows {self.dtype})")
            else:
                lines.append(
                    f"first inf/nan: node {f.name} ({f.op}) in module {f.module or '<root>'} ({f.module_type}): "
                    f"{f.numerics.overflow} of {f.numerics.numel} values overflow {f.dtype}"
                )
            for o in self.outputs:
                bad = f"{o.nonfinite} inf/nan; on the finite values: " if o.nonfinite else ""
                lines.append(
                    f"output {o.path or '[0]'} ({o.dtype}) vs fp32 model: {bad}max abs {_g(o.max_abs)}, rel {_g(o.max_rel)}, "
                    f"SQNR {_g(o.sqnr_db)} dB"
                )
            lines.append("modules by the error their own ops add (local: on fp32 inputs):")
            lines.append(f"  {'module':<44} {'type':<18} {'ops':>4} {'low':>4} {'fp32':>4} {'casts':>5} {'local err':>9} {'max rel':>8} {'overflow':>8}")
            for m in self.ranking()[:top]:
                lines.append(
                    f"  {_clip(m.path, 44):<44} {_clip(m.type, 18):<18} {m.ops:>4} {m.ops_low:>4} {m.ops_fp32:>4} "
                    f"{m.casts_to_low + m.casts_to_fp32:>5} {_g(m.own_local_error):>9} {_g(m.max_rel):>8} "
                    f"{m.overflow:>8}{'  <- overflows here' if m.own_local_overflow else ''}"
                )
        if self.grads is not None:
            lines.append("gradients (fp32 nonzeros that are zero): without scaling / with GradScaler's 65536")
            for g in sorted(self.grads, key=lambda g: -g.underflow)[:top]:
                lines.append(f"  {g.name:<44} {g.underflow:>7.1%} / {g.underflow_scaled:>7.1%}" + (f"  ({g.nonfinite_scaled} inf/nan when scaled)" if g.nonfinite_scaled else ""))
        for name, err in self.reference_failures:
            lines.append(f"note: the fp32 reference could not run {name} ({err}); its low-precision value stands in")
        return "\n".join(lines)

    __str__ = summary


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def explain(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    config: Config | None = None,
    mode: str = "exact",
    numerics: bool = True,
    grads: bool = False,
) -> Explanation:
    """Convert ``model`` and explain the result: per op node, its ATen op, module, dtype and why,
    and the casts on its inputs; per module, a roll-up.

    Args:
        model, args, kwargs, dtype, device_type, config: as for :func:`graphamp.convert`.
        mode: as for :func:`graphamp.convert`; with "autotune" or "budget" the conversion measures
            here, and the explanation lists its plan: every decision with its measured time and,
            for "budget", its error against fp32 (``explanation.plan``).
        numerics: also run the converted graph node by node beside an fp32 run of the same graph,
            recording per node the max abs and relative error, SQNR, overflow (inf/nan) and
            flush-to-zero counts, and the first node that produces inf/nan.
        grads: also report, per parameter, the fraction of its fp32 gradient's nonzeros that are
            zero in low precision, without and with GradScaler's initial scale (65536).

    The model is not modified (buffers a forward updates are restored; ``.grad`` is untouched).

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    >>> with torch.no_grad():
    ...     _ = model[1].weight.mul_(1e5)
    >>> e = explain(model, (torch.randn(4, 8),), dtype=torch.float16)
    >>> assert e.first_nonfinite.module == "1" and not e.ok
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.explain")
    if not isinstance(numerics, bool) or not isinstance(grads, bool):
        raise TypeError("numerics and grads must be True or False")
    spec = AmpSpec.resolve(model, (args, kwargs), dtype=dtype, device_type=device_type, mode=mode, config=config)
    if spec.mode == "exact":
        amp = build(model, args, kwargs, spec)
    else:  # the measured modes decide in convert (the budget search runs there)
        amp = convert(model, args, kwargs, dtype=spec.dtype, device_type=spec.device_type, mode=spec.mode, config=spec.config, self_check="off")
        if not isinstance(amp, AmpModule):
            raise CaptureError(f"graphamp.explain needs one graph; {type(model).__name__} converts only with graph breaks")
    run = run_side_by_side(amp, model, args, kwargs) if numerics else None
    return explain_converted(model, amp, args, kwargs, spec, run=run, grads=grads)


def explain_converted(model: nn.Module, amp: AmpModule, args: tuple, kwargs: dict, spec: AmpSpec, *, run: tuple[Any, Any] | None, grads: bool = False) -> Explanation:
    """The explanation of an already converted ``amp``; ``run`` is ``run_side_by_side``'s result,
    or None without numerics (search reuses its trials' conversions and runs)."""
    interp, outputs = run if run is not None else (None, None)
    stats = interp.numerics if interp is not None else {}
    modules = _module_tree(model)
    records: list[NodeRecord] = []
    cast_stats: list[tuple[str, NodeNumerics]] = []
    casts = 0
    for node in amp.graph.nodes:
        if node.op != "call_function":
            continue
        target = cast_target(node)
        path, type_ = _module_of(node, model)
        m = _module_entry(modules, path, type_)
        if record_of(node).cast:
            casts += 1
            m.casts_to_low += target in LOW_DTYPES
            m.casts_to_fp32 += target is torch.float32
            if node.name in stats:
                cast_stats.append((path, stats[node.name]))
            continue
        if node.target.__module__ == "_operator":  # getitem: part of its producer's output
            continue
        records.append(_node_record(node, path, type_, spec.config, stats.get(node.name), interp.dtypes.get(node.name) if interp else None))
        m.own_ops += 1
    _roll_up(modules, records, cast_stats, spec.dtype)
    kept = _kept(modules, spec.config, _declared(model))
    for path, why in kept:
        modules[path].kept_fp32 = why
    first = None
    if interp is not None and interp.first_nonfinite is not None:
        first = next((r for r in records if r.name == interp.first_nonfinite), None)
        if first is None:  # a cast: report it as a node of its consumer's module
            node = next(n for n in amp.graph.nodes if n.name == interp.first_nonfinite)
            path, type_ = _module_of(node, model)
            first = _node_record(node, path, type_, spec.config, stats[node.name])
    return Explanation(
        model=type(model).__name__,
        device_type=spec.device_type,
        dtype=short_dtype(spec.dtype),
        config=_config_repr(spec.config),
        nodes=tuple(records),
        modules=tuple(modules.values()),
        casts=casts,
        kept_fp32=tuple(kept),
        numerics=run is not None,
        first_nonfinite=first,
        outputs=_output_numerics(model, args, kwargs, outputs) if run is not None else (),
        grads=grad_underflow(model, amp, args, kwargs) if grads else None,
        reference_failures=tuple(interp.reference_failures.items()) if interp is not None else (),
        plan=_plan_lines((peek_graph_info(amp) or GraphInfo()).plan),
    )


def _plan_lines(plan: Any) -> tuple[str, ...]:
    """A measured mode's plan as lines: its summary, then each decision it measured."""
    if isinstance(plan, BudgetPlan):
        return (plan.summary(), *(
            f"{s.op} ({s.nodes} nodes): {'kept' if s.kept else 'not kept'}: {s.why}" for s in plan.steps
        ))
    if isinstance(plan, AutotunePlan):
        return (plan.summary(), *(
            f"{name} ({plan.ops.get(name, '?')}): {short_dtype(dtype)}"
            + (f" ({plan.times_ms[name][0]:.3g} ms low, {plan.times_ms[name][1]:.3g} ms fp32)" if name in plan.times_ms else "")
            for name, dtype in plan.decisions.items()
        ))
    return ()


def _config_repr(config: Config) -> str:
    parts = []
    if config.op_overrides:
        parts.append(f"op_overrides={dict(config.op_overrides)!r}")
    if config.fp32_modules:
        parts.append("fp32_modules=(" + ", ".join(repr(m) if isinstance(m, str) else m.__name__ for m in config.fp32_modules) + ")")
    return f"Config({', '.join(parts)})"


def _type_name(type_: object) -> str:
    name = type_ if isinstance(type_, str) else getattr(type_, "__qualname__", str(type_))
    return str(name).rsplit(".", 1)[-1]


def _module_of(node: Node, model: nn.Module) -> tuple[str, str]:
    innermost = innermost_module(node)
    if innermost is None or innermost[0] == _NO_MODULE:
        return "", type(model).__name__
    path, type_ = innermost
    return path, _type_name(type_)


def _module_tree(model: nn.Module) -> dict[str, ModuleRecord]:
    return {path: ModuleRecord(path, type(m).__name__, path.count(".") + 1 if path else 0) for path, m in model.named_modules(remove_duplicate=False)}


def _module_entry(modules: dict[str, ModuleRecord], path: str, type_: str) -> ModuleRecord:
    if path not in modules:  # a path the model's code builds at run time (a sliced ModuleList)
        modules[path] = ModuleRecord(path, type_, path.count(".") + 1 if path else 0)
    return modules[path]


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _node_record(node: Node, path: str, type_: str, config: Config, stats: NodeNumerics | None, ran: torch.dtype | None = None) -> NodeRecord:
    record = record_of(node)
    val = node.meta.get("val")
    # The dtype it ran in when numerics ran it; else the one recorded on the node's fake value.
    dtype = short_dtype(ran) if ran is not None else short_dtype(val.dtype) if isinstance(val, torch.Tensor) else None
    input_casts = []
    for arg in node.all_input_nodes:
        target = cast_target(arg)
        if target is None:
            continue
        source = arg.args[1] if arg.target.__name__ == "cached_cast" else arg.args[0]
        src_val = source.meta.get("val") if isinstance(source, Node) else None
        src = short_dtype(src_val.dtype) if isinstance(src_val, torch.Tensor) else short_dtype(record_of(arg).source_dtype)
        cached = ", weight cast kept across calls" if record_of(arg).cached else ""
        input_casts.append(f"{src}->{short_dtype(target)} {getattr(source, 'name', source)} ({record_of(arg).reason}{cached})")
    return NodeRecord(
        name=node.name,
        op=str(node.target) if not callable(node.target) or hasattr(node.target, "_schema") else f"{node.target.__module__}.{node.target.__name__}",
        module=path,
        module_type=type_,
        dtype=dtype,
        category=record.category,
        reason=record.reason or "",
        input_casts=tuple(input_casts),
        kept_fp32_by=config.keeps_fp32(node.meta.get("nn_module_stack")),
        numerics=stats,
    )


def _roll_up(modules: dict[str, ModuleRecord], records: list[NodeRecord], cast_stats: list[tuple[str, NodeNumerics]], low: torch.dtype) -> None:
    low_name = short_dtype(low)
    for r in records:
        for path in _ancestors(r.module):
            m = modules.get(path)
            if m is None:
                continue
            m.ops += 1
            if r.dtype == low_name:
                m.ops_low += 1
            elif r.dtype == "fp32":
                m.ops_fp32 += 1
            else:
                m.ops_other += 1
    # Numerics roll up from op nodes and casts alike (a cast counts in its consumer's module).
    for path0, s in [(r.module, r.numerics) for r in records if r.numerics is not None] + cast_stats:
        if path0 in modules:
            modules[path0].own_local_overflow += s.local_overflow
            modules[path0].own_local_error += finite(s.local_rel) or 0.0
        for path in _ancestors(path0):
            m = modules.get(path)
            if m is None:
                continue
            if s.max_rel is not None:
                m.max_rel = s.max_rel if m.max_rel is None else max(m.max_rel, s.max_rel)
            if s.sqnr_db is not None:
                m.min_sqnr_db = s.sqnr_db if m.min_sqnr_db is None else min(m.min_sqnr_db, s.sqnr_db)
            m.overflow += s.overflow
            m.underflow += s.underflow
            m.local_overflow += s.local_overflow
            m.local_error += finite(s.local_rel) or 0.0
    # Casts are counted in their consumer's module; roll them up the tree, deepest first.
    for path in sorted(modules, key=lambda p: -(p.count(".") + 1) if p else 0):
        if not path:
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent in modules:
            modules[parent].casts_to_low += modules[path].casts_to_low
            modules[parent].casts_to_fp32 += modules[path].casts_to_fp32


def _declared(model: nn.Module) -> dict[str, str]:
    """Module names the model declares fp32 (transformers' ``_keep_in_fp32_modules[_strict]``), with where."""
    out = {}
    for path, m in model.named_modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            for name in getattr(type(m), attr, None) or ():
                out.setdefault(name, f"{type(m).__name__}.{attr}")
    return out


def _kept(modules: dict[str, ModuleRecord], config: Config, declared: dict[str, str]) -> list[tuple[str, str]]:
    """The outermost modules the config keeps in fp32, each with its pattern and where it came from."""
    kept = []
    covered: list[str] = []
    for path, m in modules.items():
        if any(path == c or path.startswith(c + ".") for c in covered):
            continue
        for pattern in config.fp32_modules:
            if isinstance(pattern, str):
                hit = bool(path) and fnmatch.fnmatchcase(path, pattern)
                label = f"Config.fp32_modules {pattern!r}"
                name = pattern.rsplit(".", 1)[-1]
                if hit and name in declared:
                    label += f", declared by the model ({declared[name]} {name!r}, via Config.from_model)"
            else:
                hit = m.type == pattern.__name__
                label = f"Config.fp32_modules {pattern.__name__}"
            if hit:
                kept.append((path, label))
                covered.append(path)
                break
    return kept


def _output_numerics(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> tuple[OutputNumerics, ...]:
    reference = run_fp32(model, args, kwargs)
    got, _ = pytree.tree_flatten_with_path(outputs)
    want = pytree.tree_leaves(reference)
    out = []
    for (keypath, g), w in zip(got, want):
        if not (isinstance(g, torch.Tensor) and g.is_floating_point() and isinstance(w, torch.Tensor) and g.shape == w.shape):
            continue
        abs_err, rel_err, sqnr = error_metrics(g, w)
        nonfinite = int((~torch.isfinite(g) & torch.isfinite(w)).sum())
        out.append(OutputNumerics(pytree.keystr(keypath), short_dtype(g.dtype), abs_err, rel_err, sqnr, nonfinite))
    return tuple(out)
