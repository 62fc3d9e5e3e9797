"""Gradients of a fixed loss on both sides, and the first forward node whose output gradient differs.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx._pytree as fx_pytree
from torch import nn
from torch.fx import Node
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphamp.emit import AmpModule
from graphamp.passes.graph_edit import is_graphamp_cast
from graphamp.node_info import innermost_module, peek
from graphamp.policy import short_dtype
from graphamp.eager import fixed_loss  # the fixed loss both sides backpropagate
from graphamp.verify.report import GradCheck, GradDivergence, _equal_nan, error_metrics
from graphamp.verify.signatures import _is_passthrough, _op_name, _type_name
from graphamp.eager import rng_kept


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
    """One forward of ``call`` and the gradients of :func:`fixed_loss`, leaving every ``.grad`` alone."""
    a, k, inputs = _grad_inputs(args, kwargs)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with recorder if recorder is not None else contextlib.nullcontext():
        out = call(a, k)
    loss = fixed_loss(out)
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
    return GradCheck(name, kind, dtype, eager_dtype, equal, *error_metrics(got, want))


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
                    latest = (g1 + k, j, error_metrics(g, w)[0] or math.inf)
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
        reason=_reason(node),
        max_abs=max_abs,
        consumers=tuple(c.name for c in consumers),
        consumer_modules=tuple(_module_of(c)[0] or "" for c in consumers),
    ), notes


def _reason(node: Node | None) -> str | None:
    record = peek(node) if node is not None else None
    return record.reason if record is not None else None


def _module_of(node: Node | None) -> tuple[str | None, Any]:
    return innermost_module(node) or (None, None)


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
            user.target is operator.getitem or _is_passthrough(user.target) or is_graphamp_cast(user)
        )
        if relabels:
            pending.extend(user.users)
        else:
            found.append(user)
    return found


def _check_grads(
    model: nn.Module, amp: AmpModule, args: tuple, kwargs: dict, device_type: str, dtype: torch.dtype, *, cache_enabled: bool = True,
) -> tuple[tuple[GradCheck, ...], GradDivergence | None, list[str]]:
    def eager(a: tuple, k: dict) -> Any:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled):
            return model(*a, **k)

    interpreter = _NodeInterpreter(amp)
    in_spec = amp.graph._codegen.pytree_info.in_spec

    def converted_by_node(a: tuple, k: dict) -> Any:
        flat = fx_pytree.tree_flatten_spec((a, k), in_spec)
        return amp.graph.process_outputs(interpreter.run(*flat, enable_io_processing=False))

    with rng_kept() as start, torch.enable_grad():
        want = _grad_run(eager, model, args, kwargs)
        start.restore()
        got = _grad_run(lambda a, k: amp(*a, **k), model, args, kwargs)
        checks = _grad_checks(got, want)
        if not checks:
            return checks, None, ["grads=True: no gradient to compare (no parameter requires grad, no input is a floating tensor)"]
        if all(c.ok for c in checks):
            return checks, None, []
        # Localise: again, this time recording every op's output on both sides, the converted
        # side run node by node so each op is tied to the node that ran it.
        start.restore()
        want_recorded = _grad_run(eager, model, args, kwargs, _OpRecorder())
        start.restore()
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
