"""Op signatures of lowered graphs (op, dtype history of each input, output dtypes) and their alignment.
"""

from __future__ import annotations

import difflib
import operator
from typing import Any, NamedTuple

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from graphamp.policy import short_dtype
from graphamp.node_info import NodeInfo, innermost_module, peek
from graphamp.verify.report import Divergence


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

    >>> from torch.fx.experimental.proxy_tensor import make_fx
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
            if len(g.inputs) != len(e.inputs):
                # The same op called with other arguments (an attention mask on one side only):
                # another program, not another dtype decision.
                blocks += 1
                structure = structure or _Where("structure", (g1 + k, g1 + k + 1), (e1 + k, e1 + k + 1))
                continue
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
    path, type_ = innermost_module(origin) or (None, None)
    record = (peek(origin) if origin is not None else None) or NodeInfo()
    captured = record.captured
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
        reason=record.reason,
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
