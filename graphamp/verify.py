"""``graphamp.verify``: check a conversion against eager autocast, output by output and op by op.

Two independent records are compared:

* **outputs**: the converted module and ``torch.autocast`` run on the same inputs; each output's
  dtype, bitwise equality, max abs and relative error and SQNR are reported;
* **ops**: both sides are lowered to post-dispatch ATen graphs with ``make_fx``, eager under
  autocast (so its casts are autocast's own) and the converted module with autocast off. The
  sequences of compute ops are aligned, and each op's signature (its name, the dtype history of
  every tensor input, its output dtypes) is compared, so the report names the *first divergent
  node* of the converted graph, with its module path and graphamp's reason for its dtype.

Casts and views are not compute ops: a cast shows up in the dtype history of the inputs it feeds
(``fp32->bf16``), so the comparison is modulo cast order (CUDA autocast casts right to left) and
modulo cast sharing, and exact round trips (``bf16->fp32->bf16``) count as no cast at all.

With ``device_type="cuda"`` on a machine without a GPU, both sides run on fake CUDA tensors: ops
and dtypes are compared, values are not (the report says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import operator
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx._pytree as fx_pytree
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphamp.capture import ambient_autocast, capture
from graphamp.config import Config
from graphamp.convert import _convert as convert_core, check_inputs
from graphamp.emit import AmpModule
from graphamp.errors import PolicyDriftError
from graphamp.passes._infra import short_dtype
from graphamp.runtime import WeightCache
from graphamp.passes.check_dtypes import CAPTURED
from graphamp.reference import trace
from graphamp.spec import AmpSpec, autocast_off

__all__ = ["verify", "Report", "OutputCheck", "GradCheck", "Divergence", "GradDivergence", "OpSignature", "op_signatures", "first_divergence"]

aten = torch.ops.aten

# Ops that move or relabel a value without computing on it: they are followed through when
# reading an input's dtype history, and are not compared as ops of their own.
_PASSTHROUGH = frozenset({
    aten._to_copy.default, aten.detach.default, aten.clone.default, aten._unsafe_view.default,
    aten.lift_fresh_copy.default, aten.contiguous.default, aten.alias.default,
    aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default, aten.unsafe_chunk.default,
})


class OpSignature(NamedTuple):
    """One compute op of a lowered graph: its ATen name, inputs' dtype histories, output dtypes."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    node: Node


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


# -- op signatures -------------------------------------------------------------------------------


def _is_passthrough(op: Any) -> bool:
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if op in _PASSTHROUGH:
        return True
    # A view returns an alias of its input that it does not write (in-place ops write theirs).
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _source(node: Node) -> Node | None:
    """The value a pass-through node relabels, or None if ``node`` computes."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent = node.args[0]
        return _source_of_op(parent) if isinstance(parent, Node) and _is_passthrough(parent.target) else None
    return _source_of_op(node) if _is_passthrough(node.target) else None


def _source_of_op(node: Node) -> Node | None:
    inputs = _tensor_inputs(node)
    return inputs[0] if inputs else None


_WIDER = {  # dtype -> the dtypes that hold every one of its values
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def _history(node: Node) -> str:
    """The dtypes a value went through since it was computed, casts and views followed back."""
    dtypes: list[torch.dtype] = []
    current: Node | None = node
    while current is not None:
        val = current.meta.get("val")
        if not isinstance(val, torch.Tensor):
            break
        if not dtypes or dtypes[-1] != val.dtype:
            dtypes.append(val.dtype)
        current = _source(current)
    dtypes.reverse()
    changed = True
    while changed:  # X -> wider -> X is exact: it computes nothing
        changed = False
        for i in range(len(dtypes) - 2):
            if dtypes[i] == dtypes[i + 2] and dtypes[i + 1] in _WIDER.get(dtypes[i], ()):
                del dtypes[i + 1 : i + 3]
                changed = True
                break
    return "->".join(short_dtype(d) for d in dtypes)


def _op_name(op: torch._ops.OpOverload) -> str:
    # In-place and out-of-place variants compute the same thing (eager's RNN cells use add_,
    # torch's Python decompositions use add); the output dtype still tells them apart.
    name = op._schema.name.split("::")[-1]
    if name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return f"{op.namespace}.{name}.{op._overloadname}"


def op_signatures(gm: GraphModule) -> list[OpSignature]:
    """The compute ops of a post-dispatch graph that touch floating tensors, with their dtypes.

    >>> gm = make_fx(lambda x: (x.to(torch.bfloat16) @ x.t().to(torch.bfloat16)).sum())(torch.randn(2, 2))
    >>> sigs = op_signatures(gm)
    >>> assert [(s.op, s.inputs) for s in sigs] == [("aten.mm.default", ("fp32->bf16", "fp32->bf16")), ("aten.sum.default", ("bf16",))]
    """
    sigs = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or _is_passthrough(node.target):
            continue
        inputs = _tensor_inputs(node)
        outputs = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        if not any(t.is_floating_point() for t in [*(i.meta["val"] for i in inputs), *outputs]):
            continue  # integer and mask bookkeeping: outside autocast's reach
        sigs.append(OpSignature(
            _op_name(node.target),
            tuple(_history(i) for i in inputs),
            tuple(short_dtype(v.dtype) for v in outputs),
            node,
        ))
    return sigs


class _Where(NamedTuple):
    kind: str
    graphamp: tuple[int, int]  # [start, end) of the divergent ops in each sequence
    eager: tuple[int, int]


class _Scan(NamedTuple):
    matched: int  # aligned ops with equal signatures
    dtype: _Where | None  # the first aligned op whose dtypes differ
    structure: _Where | None  # the first run of ops present on one side only
    structure_blocks: int


def _scan(graphamp: list[OpSignature], eager: list[OpSignature]) -> _Scan:
    matcher = difflib.SequenceMatcher(None, [s.op for s in graphamp], [s.op for s in eager], autojunk=False)
    matched, structure, blocks = 0, None, 0
    for tag, g1, g2, e1, e2 in matcher.get_opcodes():
        if tag != "equal":
            blocks += 1
            structure = structure or _Where("structure", (g1, g2), (e1, e2))
            continue
        for k in range(g2 - g1):
            g, e = graphamp[g1 + k], eager[e1 + k]
            if (g.inputs, g.outputs) != (e.inputs, e.outputs):
                return _Scan(matched, _Where("dtype", (g1 + k, g1 + k + 1), (e1 + k, e1 + k + 1)), structure, blocks)
            matched += 1
    return _Scan(matched, None, structure, blocks)


def first_divergence(graphamp: list[OpSignature], eager: list[OpSignature]) -> tuple[int, tuple[int, int] | None]:
    """Align two op sequences by op name and compare the aligned signatures.

    Returns how many aligned ops have equal signatures (up to the first dtype divergence), and
    the index in each sequence of the first divergence (None if there is none): an aligned op
    with other dtypes, or an op present on one side only.

    >>> s = lambda op, dt: OpSignature(op, (dt,), (dt,), None)
    >>> assert first_divergence([s("mm", "bf16"), s("exp", "fp32")], [s("mm", "bf16"), s("exp", "bf16")]) == (1, (1, 1))
    """
    scan = _scan(graphamp, eager)
    first = min((w for w in (scan.dtype, scan.structure) if w is not None), key=lambda w: w.graphamp[0], default=None)
    return scan.matched, None if first is None else (first.graphamp[0], first.eager[0])


def _divergence(where: _Where, graphamp: list[OpSignature], eager: list[OpSignature], amp: GraphModule) -> Divergence:
    gi, ei = where.graphamp[0], where.eager[0]
    g = graphamp[gi] if where.graphamp[1] > gi else None
    e = eager[ei] if where.eager[1] > ei else None
    # Locate the converted node: the op itself, or the next converted op if eager has extra ops here.
    anchor = g if g is not None else (graphamp[gi] if gi < len(graphamp) else None)
    origin = _origin(anchor.node, amp) if anchor is not None else None
    stack = list((origin.meta.get("nn_module_stack") or {}).values()) if origin is not None else []
    path, type_ = stack[-1] if stack else (None, None)
    info = origin.meta.get("graphamp", {}) if origin is not None else {}
    captured = origin.meta.get(CAPTURED) if origin is not None else None
    structural = where.kind == "structure"
    return Divergence(
        kind=where.kind,
        index=gi,
        node=origin.name if origin is not None else None,
        target=str(origin.target) if origin is not None else None,
        module_path=path,
        module_type=_type_name(type_) if type_ is not None else None,
        graphamp_op=g.op if g else None,
        eager_op=e.op if e else None,
        graphamp_inputs=g.inputs if g else (),
        eager_inputs=e.inputs if e else (),
        graphamp_outputs=g.outputs if g else (),
        eager_outputs=e.outputs if e else (),
        reason=info.get("reason"),
        captured_dtypes=tuple(short_dtype(d) for d in captured) if captured is not None else None,
        graphamp_only=tuple(s.op for s in graphamp[slice(*where.graphamp)][:5]) if structural else (),
        eager_only=tuple(s.op for s in eager[slice(*where.eager)][:5]) if structural else (),
    )


def _type_name(type_: object) -> str:
    name = type_ if isinstance(type_, str) else f"{type_.__module__}.{type_.__qualname__}"
    return name.rsplit(".", 1)[-1]


def _origin(lowered: Node, amp: GraphModule) -> Node | None:
    """The converted graph's node a lowered node came from (recorded by preserve_node_meta)."""
    sources = lowered.meta.get("from_node") or []
    names = {n.name: n for n in amp.graph.nodes}
    for source in sources:
        if source.name in names:
            return names[source.name]
    return None


# -- running both sides --------------------------------------------------------------------------


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> GraphModule:
    # Grad mode stays as the caller set it (on): the reference must not take no_grad fast paths.
    return trace(fn, args, kwargs, no_grad=not torch.is_grad_enabled())


def _eager_graph(model: nn.Module, args: tuple, kwargs: dict, device_type: str, dtype: torch.dtype) -> GraphModule:
    from torch._export.utils import _compiling_state_context

    def run(*a: Any, **k: Any) -> Any:
        with ambient_autocast(device_type, dtype):
            return model(*a, **k)

    # torch.compiler.is_exporting() as during capture: model code that branches on it (Hugging
    # Face mask construction) takes the captured path, so only autocast's decisions can differ.
    # The value comparison runs plain eager.
    with _compiling_state_context():
        return _trace(run, args, kwargs)


def _lowered_graph(amp: AmpModule, args: tuple, kwargs: dict) -> GraphModule:
    in_spec = amp.graph._codegen.pytree_info.in_spec
    # A warm weight cache hands out earlier casts as constants; a cold call shows every cast.
    for module in amp.modules():
        if isinstance(module, WeightCache):
            module.clear()

    def run(*a: Any, **k: Any) -> Any:
        flat = fx_pytree.tree_flatten_spec((a, k), in_spec)
        # The Interpreter runs node by node, so each lowered op records its converted node in from_node.
        return torch.fx.Interpreter(amp).run(*flat, enable_io_processing=False)

    with fx_traceback.preserve_node_meta():
        return _trace(run, args, kwargs)


def _count_casts(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._to_copy.default)


def _convert(
    model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, device_type: str, mode: str, config: Config | None
) -> tuple[AmpModule, list[str]]:
    spec = AmpSpec(device_type, dtype, mode, config=config or Config())
    try:
        return convert_core(model, args, kwargs, spec), []
    except PolicyDriftError as e:
        # Convert's own check stops at the first drifted node; rebuild without it so the report
        # can say where and how the result differs from eager.
        note = f"graphamp.convert raised PolicyDriftError: {str(e).splitlines()[0][:300]}"
        return convert_core(model, args, kwargs, spec, check=False), [note]


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
    abs_err, rel_err, sqnr = _errors(got, want)
    return OutputCheck(index, path, short_dtype(got.dtype), short_dtype(want.dtype), dtype_match, True, equal, abs_err, rel_err, sqnr)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float | None, float | None, float | None]:
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


def _uses_real_cuda(model: nn.Module, inputs: Any) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
    return any(t.device.type == "cuda" for t in tensors)


class _Sides(NamedTuple):
    amp: AmpModule
    out: Any
    ref: Any
    graphamp_graph: GraphModule
    eager_graph: GraphModule
    notes: list[str]


def _run_real(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, device_type: str, mode: str, config: Config | None) -> _Sides:
    amp, notes = _convert(model, args, kwargs, dtype, device_type, mode, config)
    devices = [torch.device(device_type, i) for i in range(torch.cuda.device_count())] if device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        # Same random stream on both sides, so dropout draws the same masks.
        state = _rng_state(device_type)
        with torch.autocast(device_type, dtype=dtype):
            ref = _detached(model(*args, **kwargs))
        _set_rng_state(device_type, state)
        out = _detached(amp(*args, **kwargs))
        _set_rng_state(device_type, state)
        eager_graph = _eager_graph(model, args, kwargs, device_type, dtype)
        _set_rng_state(device_type, state)
        graphamp_graph = _lowered_graph(amp, args, kwargs)
    return _Sides(amp, out, ref, graphamp_graph, eager_graph, notes)


def _rng_state(device_type: str) -> tuple:
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if device_type == "cuda" else None)


def _set_rng_state(device_type: str, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if device_type == "cuda":
        torch.cuda.set_rng_state_all(state[1])


def _run_fake_cuda(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, mode: str, config: Config | None) -> _Sides:
    from graphamp._fake_cuda import fake_cuda_inputs, fake_cuda_model, fake_cuda_session

    with fake_cuda_session(), warnings.catch_warnings():
        # Storage-keyed caches probe data_ptr(), which fake tensors only warn about.
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        fake_model = fake_cuda_model(model)
        fake_args, fake_kwargs = fake_cuda_inputs(args, kwargs)
        amp, notes = _convert(fake_model, fake_args, fake_kwargs, dtype, "cuda", mode, config)
        with ambient_autocast("cuda", dtype):
            ref = fake_model(*fake_args, **fake_kwargs)
        out = amp(*fake_args, **fake_kwargs)
        eager_graph = _eager_graph(fake_model, fake_args, fake_kwargs, "cuda", dtype)
        graphamp_graph = _lowered_graph(amp, fake_args, fake_kwargs)
    notes.append("values not compared: fake CUDA tensors carry no data; ops, dtypes and shapes were compared")
    return _Sides(amp, out, ref, graphamp_graph, eager_graph, notes)


# -- gradients ----------------------------------------------------------------------------------

def _loss(out: Any) -> torch.Tensor:
    """The fixed scalar both sides backpropagate: sum_i (i + 1) * (out_i.float() * linspace(-1, 1)).sum()."""
    # Position-dependent weights give every output element a distinct gradient, so a gradient
    # that lands in the wrong place, or is summed in another order, shows.
    total = torch.zeros((), dtype=torch.float32)
    floats = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for i, t in enumerate(floats):
        w = torch.linspace(-1, 1, t.numel(), dtype=torch.float32, device=t.device).reshape(t.shape) * (i + 1)
        total = total + (t.float() * w).sum()
    return total


def _grad_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    """The inputs with each floating tensor replaced by a fresh leaf copy that requires grad."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    filled, named = [], []
    for path, value in leaves:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().clone().requires_grad_(True)
            named.append((("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:]), value))
        filled.append(value)
    a, k = pytree.tree_unflatten(filled, spec)
    return a, k, named


def _writes(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


class _Record(NamedTuple):
    op: str  # as in op_signatures, so the two sides align as the forward check aligns them
    outputs: tuple[torch.Tensor | None, ...]  # None where the op's output gradient cannot be read
    versions: tuple[int, ...]
    node: Node | None  # the converted graph's node running when the op ran (converted side only)


class _OpRecorder(TorchDispatchMode):
    """Records every compute op (as :func:`op_signatures` counts them) with its output tensors.

    Below autograd, an op's output is the very tensor autograd then attaches its history to, so
    after the forward its gradient can be asked for. An output that a later in-place op writes
    (its version moves) no longer holds the op's value, and is dropped.
    """

    def __init__(self, where: Callable[[], Node | None] = lambda: None) -> None:
        super().__init__()
        self.where = where
        self.records: list[_Record] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and not _is_passthrough(func):
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if any(t.is_floating_point() for t in [*inputs, *outputs]):
                fresh = not _writes(func)
                kept = tuple(
                    t if fresh and t.is_floating_point() and not any(t is i for i in inputs) else None for t in outputs
                )
                versions = tuple(t._version if t is not None else 0 for t in kept)
                self.records.append(_Record(_op_name(func), kept, versions, self.where()))
        return out

    def observable(self) -> list[tuple[int, int, torch.Tensor]]:
        """(record, output, tensor) for every recorded output whose gradient autograd can give."""
        return [
            (r, j, t)
            for r, rec in enumerate(self.records)
            for j, (t, v) in enumerate(zip(rec.outputs, rec.versions))
            if t is not None and t.requires_grad and t._version == v
        ]


class _NodeInterpreter(torch.fx.Interpreter):
    """Runs a converted module node by node, remembering which node is running."""

    current: Node | None = None

    def run_node(self, n: Node) -> Any:
        self.current = n
        return super().run_node(n)


class _GradRun(NamedTuple):
    params: dict[str, torch.Tensor | None]
    inputs: dict[str, torch.Tensor | None]
    values: dict[tuple[int, int], torch.Tensor]  # (record, output) -> gradient of that op output
    records: list[_Record]


def _grad_run(call: Callable[[tuple, dict], Any], model: nn.Module, args: tuple, kwargs: dict, recorder: _OpRecorder | None = None) -> _GradRun:
    """One forward of ``call`` and the gradients of :func:`_loss`, leaving every ``.grad`` alone."""
    a, k, inputs = _grad_inputs(args, kwargs)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with recorder if recorder is not None else contextlib.nullcontext():
        out = call(a, k)
    loss = _loss(out)
    observed = recorder.observable() if recorder is not None else []
    wrt = [p for _, p in params] + [t for _, t in inputs] + [t for *_, t in observed]
    # autograd.grad, not backward(): the caller's .grad fields (and the model's) stay untouched.
    grads = list(torch.autograd.grad(loss, wrt, allow_unused=True)) if loss.requires_grad and wrt else [None] * len(wrt)
    n, m = len(params), len(inputs)
    return _GradRun(
        params={name: g for (name, _), g in zip(params, grads[:n])},
        inputs={name: g for (name, _), g in zip(inputs, grads[n : n + m])},
        values={(r, j): g for (r, j, _), g in zip(observed, grads[n + m :]) if g is not None},
        records=recorder.records if recorder is not None else [],
    )


def _grad_check(name: str, kind: str, got: torch.Tensor | None, want: torch.Tensor | None) -> GradCheck:
    dtype = short_dtype(got.dtype) if got is not None else None
    eager_dtype = short_dtype(want.dtype) if want is not None else None
    if got is None or want is None or got.shape != want.shape:
        return GradCheck(name, kind, dtype, eager_dtype, False, None, None, None)
    equal = got.dtype == want.dtype and (torch.equal(got, want) or _equal_nan(got, want))
    return GradCheck(name, kind, dtype, eager_dtype, equal, *_errors(got, want))


def _grad_checks(got: _GradRun, want: _GradRun) -> tuple[GradCheck, ...]:
    checks = []
    for kind, g, w in (("param", got.params, want.params), ("input", got.inputs, want.inputs)):
        for name in w:
            if g.get(name) is None and w[name] is None:
                continue  # neither side reaches it: nothing to compare
            checks.append(_grad_check(name, kind, g.get(name), w[name]))
    return tuple(checks)


def _first_divergent_gradient(got: _GradRun, want: _GradRun) -> tuple[tuple[int, int, float] | None, list[str], list[str]]:
    """The converted side's (record, output, max abs error) latest in forward order whose gradient
    differs, and the ops that ran on one side only (converted, eager)."""
    matcher = difflib.SequenceMatcher(None, [r.op for r in got.records], [r.op for r in want.records], autojunk=False)
    latest = None
    only_got: list[str] = []
    only_want: list[str] = []
    for tag, g1, g2, e1, e2 in matcher.get_opcodes():
        if tag != "equal":
            only_got += [r.op for r in got.records[g1:g2]]
            only_want += [r.op for r in want.records[e1:e2]]
            continue
        for k in range(g2 - g1):
            for j in range(len(got.records[g1 + k].outputs)):
                g, w = got.values.get((g1 + k, j)), want.values.get((e1 + k, j))
                if g is None or w is None or g.shape != w.shape:
                    continue  # not observable on both sides: no verdict either way
                if g.dtype == w.dtype and (torch.equal(g, w) or _equal_nan(g, w)):
                    continue
                if latest is None or g1 + k > latest[0]:
                    latest = (g1 + k, j, _errors(g, w)[0] or math.inf)
                break
    return latest, only_got, only_want


def _grad_divergence(got: _GradRun, want: _GradRun) -> tuple[GradDivergence, list[str]]:
    found, only_got, only_want = _first_divergent_gradient(got, want)
    notes = []
    if only_got or only_want:
        # The forward check traces eager as torch.export sees it; this run is plain eager, where
        # model code that branches on torch.compiler.is_exporting() can take another path.
        notes.append(
            f"gradient localisation: in plain eager, {len(only_got)} op(s) ran only in graphamp "
            f"({', '.join(dict.fromkeys(only_got)) or '-'}) and {len(only_want)} only in eager "
            f"({', '.join(dict.fromkeys(only_want)) or '-'}); model code may branch on torch.compiler.is_exporting()"
        )
    if found is None:
        return GradDivergence(None, None, None, None, None, None, None, None), notes
    index, _, max_abs = found
    record = got.records[index]
    node = record.node
    path, type_ = _module_of(node)
    consumers = _consumers(node) if node is not None else []
    return GradDivergence(
        node=node.name if node is not None else None,
        target=str(node.target) if node is not None else None,
        op=record.op,
        index=index,
        module_path=path,
        module_type=_type_name(type_) if type_ is not None else None,
        reason=node.meta.get("graphamp", {}).get("reason") if node is not None else None,
        max_abs=max_abs,
        consumers=tuple(c.name for c in consumers),
        consumer_modules=tuple(_module_of(c)[0] or "" for c in consumers),
    ), notes


def _module_of(node: Node | None) -> tuple[str | None, Any]:
    stack = list((node.meta.get("nn_module_stack") or {}).values()) if node is not None else []
    return stack[-1] if stack else (None, None)


def _consumers(node: Node) -> list[Node]:
    """The nodes that compute on ``node``'s value, casts, views and getitems followed through."""
    found: list[Node] = []
    seen: set[Node] = set()
    pending = list(node.users)
    while pending:
        user = pending.pop(0)
        if user in seen:
            continue
        seen.add(user)
        relabels = user.op == "call_function" and (
            user.target is operator.getitem or _is_passthrough(user.target) or user.meta.get("graphamp", {}).get("cast")
        )
        if relabels:
            pending.extend(user.users)
        else:
            found.append(user)
    return found


def _check_grads(model: nn.Module, amp: AmpModule, args: tuple, kwargs: dict, device_type: str, dtype: torch.dtype) -> tuple[tuple[GradCheck, ...], GradDivergence | None, list[str]]:
    def eager(a: tuple, k: dict) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return model(*a, **k)

    interpreter = _NodeInterpreter(amp)
    in_spec = amp.graph._codegen.pytree_info.in_spec

    def converted_by_node(a: tuple, k: dict) -> Any:
        flat = fx_pytree.tree_flatten_spec((a, k), in_spec)
        return amp.graph.process_outputs(interpreter.run(*flat, enable_io_processing=False))

    devices = [torch.device(device_type, i) for i in range(torch.cuda.device_count())] if device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        state = _rng_state(device_type)
        want = _grad_run(eager, model, args, kwargs)
        _set_rng_state(device_type, state)
        got = _grad_run(lambda a, k: amp(*a, **k), model, args, kwargs)
        checks = _grad_checks(got, want)
        if not checks:
            return checks, None, ["grads=True: no gradient to compare (no parameter requires grad, no input is a floating tensor)"]
        if all(c.ok for c in checks):
            return checks, None, []
        # Localise: again, this time recording every op's output on both sides, the converted
        # side run node by node so each op is tied to the node that ran it.
        _set_rng_state(device_type, state)
        want_recorded = _grad_run(eager, model, args, kwargs, _OpRecorder())
        _set_rng_state(device_type, state)
        got_recorded = _grad_run(converted_by_node, model, args, kwargs, _OpRecorder(lambda: interpreter.current))
    divergence, notes = _grad_divergence(got_recorded, want_recorded)
    if not (_same_grads(want_recorded, want) and _same_grads(got_recorded, got)):
        notes.append(
            "gradient localisation: the recorded runs' parameter and input gradients differ from the "
            "plain runs' (the model's code sees the recording), so the node it names may be off"
        )
    return checks, divergence, notes


def _same_grads(a: _GradRun, b: _GradRun) -> bool:
    pairs = [(a.params[n], b.params[n]) for n in b.params] + [(a.inputs[n], b.inputs[n]) for n in b.inputs]
    return all(
        (x is None and y is None)
        or (x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape and (torch.equal(x, y) or _equal_nan(x, y)))
        for x, y in pairs
    )


def verify(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    mode: str = "exact",
    config: Config | None = None,
    grads: bool = False,
) -> Report:
    """Convert ``model`` and check the result against eager ``torch.autocast`` on the same inputs.

    Arguments are those of :func:`graphamp.convert`. Both sides run with grad mode on, as in
    training (eager's fused inference fast paths under ``no_grad`` are not the reference), from
    the same random state. ``device_type="cuda"`` with a model on the CPU checks the CUDA policy
    on fake CUDA tensors, with no GPU: ops and dtypes are compared, values are not.

    ``grads=True`` also backpropagates a fixed loss (every float output weighted by
    ``linspace(-1, 1)``, summed in fp32) through both sides, from the same random state, and
    compares the gradient of every parameter that requires grad and of every floating input
    (each side gets its own leaf copy that requires grad). ``.grad`` fields are left untouched.
    When gradients differ, both sides run once more recording every op's output, and the
    report names the first node, walking back from the outputs, whose output gradient differs
    from eager's (``report.grad_divergence``). Gradients need real tensors: with fake CUDA
    (``device_type="cuda"`` without a GPU) ``grads=True`` raises ``ValueError``.

    Returns:
        A :class:`Report`: per output dtype match, bitwise equality, max abs and relative error
        and SQNR; the first divergent node of the converted graph (op, dtype histories of its
        inputs on both sides, module path, graphamp's reason); cast counts on both sides; with
        ``grads=True``, per gradient the same errors, and the first divergent backward node.

    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
    ...     def forward(self, x):
    ...         return self.norm(self.proj(x))
    >>> model, x = nn.Sequential(Block()), torch.randn(4, 8)
    >>> assert verify(model, (x,), dtype=torch.float16).ok
    >>> wrong = Config(op_overrides={"layer_norm": "lower_precision_fp"})
    >>> report = verify(model, (x,), dtype=torch.float16, config=wrong)
    >>> assert not report.ok and (report.divergence.node, report.divergence.module_path) == ("layer_norm", "0.norm")
    >>> report = verify(model, (x,), grads=True)
    >>> assert report.ok and [g.name for g in report.grads][-2:] == ["0.norm.bias", "args[0]"]
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.verify")
    if not isinstance(grads, bool):
        raise TypeError(f"grads must be True or False, got {grads!r}")
    # No device check: a CPU model under the CUDA policy is checked on fake CUDA tensors.
    spec = AmpSpec.resolve(model, (args, kwargs), dtype=dtype, device_type=device_type, mode=mode, config=config, check_devices=False)
    device_type, dtype = spec.device_type, spec.dtype
    fake = device_type == "cuda" and not _uses_real_cuda(model, (args, kwargs))
    if fake and grads:
        raise ValueError(
            "graphamp.verify(grads=True) needs real tensors, and device_type='cuda' with no GPU runs "
            "both sides on fake CUDA tensors, which carry no values and cannot require grad (autograd "
            "over them aborts the process). Way out: check gradients with device_type='cpu' (the CPU "
            "policy), or on a machine with a GPU; check the CUDA policy's ops and dtypes with grads=False."
        )
    grad_checks: tuple[GradCheck, ...] = ()
    grad_divergence, grad_notes = None, []
    with autocast_off():
        if fake:
            sides = _run_fake_cuda(model, args, kwargs, dtype, mode, config)
        else:
            sides = _run_real(model, args, kwargs, dtype, device_type, mode, config)
            if grads:
                grad_checks, grad_divergence, grad_notes = _check_grads(model, sides.amp, args, kwargs, device_type, dtype)
    graphamp_ops = op_signatures(sides.graphamp_graph)
    eager_ops = op_signatures(sides.eager_graph)
    scan = _scan(graphamp_ops, eager_ops)
    where = scan.dtype or scan.structure
    outputs, same_structure = _compare_outputs(sides.out, sides.ref, values=not fake)
    notes = list(sides.notes) + grad_notes
    if scan.dtype is None and scan.structure is not None and not fake:
        notes.append(
            f"{scan.structure_blocks} run(s) of ops appear on one side only (a composite decomposed "
            "differently, or another kernel chosen); the aligned ops agree, and the outputs decide"
        )
    return Report(
        model=type(model).__name__,
        device_type=device_type,
        dtype=short_dtype(dtype),
        mode=mode,
        values_compared=not fake,
        outputs=outputs,
        output_structure_match=same_structure,
        divergence=_divergence(where, graphamp_ops, eager_ops, sides.amp) if where is not None else None,
        structure_differences=scan.structure_blocks,
        ops={"graphamp": len(graphamp_ops), "eager": len(eager_ops), "matched": scan.matched},
        casts={"graphamp": _count_casts(sides.graphamp_graph), "eager": _count_casts(sides.eager_graph)},
        notes=tuple(notes),
        grads_compared=grads,
        grads=grad_checks,
        grad_divergence=grad_divergence,
    )

