"""The converted module's Python code, made cheaper to run: state reads in one call, ATen ops
called without ``OpOverload.__call__``.

FX writes a ``get_attr`` node as an attribute chain, ``getattr(self.blocks, "0").weight``: each
link is a Python-level ``nn.Module.__getattr__`` call, about 0.7 us, so reading 48 weights costs
~100 us a call, more than many small models spend in their ops' overhead. :func:`hoist_state_reads`
rewrites each run of consecutive ``get_attr`` lines of the generated code into one
``self._graphamp_read(...)`` (:func:`graphamp.runtime.read_state`), which walks the same module
tree through its dictionaries on every call (~16 us for those 48). Every call reads the module's
current state: replacing a parameter, ``load_state_dict(assign=True)``, ``_apply`` and swapped
submodules are all seen.

FX calls an op as ``torch.ops.aten.tanh.default(x)``: a Python frame (``OpOverload.__call__``) and
the boxed dispatcher call, 0.6-1.6 us more than ``torch.tanh(x)``. :func:`call_overloads_directly`
calls the Python binding where :func:`binding_for` verified it dispatches the same ATen call, else
``OpOverload._op``. Dynamo cannot trace ``_op``: ``AmpModule`` runs code without it under dynamo.

The graph is unchanged, so interpreters and passes see it as before. Only lines that are exactly
what FX writes are rewritten; a line in any other form (a future FX format, a type annotation) is
left as FX wrote it, which is slower and as correct. A saved module stores FX's own code
(``AmpModule.__reduce__``), so files do not depend on these rewrites.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.utils._python_dispatch import TorchDispatchMode

from graphamp.eager import rng_kept

__all__ = ["READ_METHOD", "binding_for", "bindings_of", "call_overloads_directly", "eager_body", "hoist_state_reads"]

READ_METHOD = "_graphamp_read"

_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) = ((?:getattr\()*self(?:\.[A-Za-z_][A-Za-z0-9_]*|, \"[^\"]*\"\))*)$")
_LINK = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|, \"([^\"]*)\"\)")


def _format_target(base: str, target: str) -> str:
    """What FX writes for the attribute path ``target`` of ``base`` (torch.fx.graph._format_target)."""
    for e in target.split("."):
        base = f"{base}.{e}" if e.isidentifier() else f'getattr({base}, "{e}")'
    return base


def _read_of(item: str) -> tuple[str, tuple[str, ...]] | None:
    """(name, path) when a body item is exactly FX's code for one ``get_attr`` of ``self``."""
    m = _LINE.match(item)
    if m is None:
        return None
    name, rhs = m.groups()
    path = tuple(a or b for a, b in _LINK.findall(rhs[rhs.index("self") + 4 :]))
    if not path or _format_target("self", ".".join(path)) != rhs:
        return None
    return name, path


def _wrap(items: list[str], width: int = 96) -> str:
    """``items`` comma-separated, on lines of at most ``width`` characters (an item is never split)."""
    lines = [items[0]]
    for item in items[1:]:
        if len(lines[-1]) + len(item) + 2 > width:
            lines[-1] += ","
            lines.append(item)
        else:
            lines[-1] += ", " + item
    return "\n    ".join(lines)


def hoist_state_reads(body: list[str]) -> list[str]:
    """FX's generated body (one item per line part, with ``# COUNTER`` markers) with every run of
    two or more consecutive ``get_attr`` reads turned into one ``self._graphamp_read`` call."""
    out: list[str] = []
    run: list[tuple[str, tuple[str, ...]]] = []
    held: list[str] = []  # the run's own items, kept in case it stays a single read

    def flush() -> None:
        if len(run) > 1:
            names = _wrap([name for name, _ in run])
            paths = _wrap([repr(path) for _, path in run])
            out.append(f"(\n    {names},\n) = self.{READ_METHOD}(\n    {paths},\n)\n")
        else:
            out.extend(held)
        run.clear()
        held.clear()

    pending: list[str] = []  # COUNTER markers after a run: the next node's, unless it is a read
    i = 0
    while i < len(body):
        item = body[i]
        if item.startswith("# COUNTER:") and run:
            pending.append(item)
            i += 1
            continue
        read = _read_of(item)
        # A read joins the run when FX ended its line with a bare newline (the value is used later).
        if read is not None and i + 1 < len(body) and body[i + 1] == "\n":
            run.append(read)
            held.extend([*pending, item, "\n"])
            pending.clear()
            i += 2
            continue
        flush()
        out.extend(pending)
        pending.clear()
        out.append(item)
        i += 1
    flush()
    out.extend(pending)
    return out


_OVERLOAD_CALL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) = torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\(")


def _plain_overload(namespace: str, op: str, overload: str) -> bool:
    """Whether ``torch.ops.<namespace>.<op>.<overload>`` is an OpOverload whose call is its ``_op``."""
    try:
        target = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return False
    return isinstance(target, torch._ops.OpOverload) and type(target).__call__ is torch._ops.OpOverload.__call__


def call_overloads_directly(body: list[str], bindings: Mapping[str, str] | None = None) -> list[str]:
    """FX's body with each ``torch.ops.ns.op.overload(...)`` call made more cheaply: through the
    Python binding ``bindings[name]`` where :func:`binding_for` verified one for the node ``name``
    (~0.6-1.6 us less than the boxed call an op), else as ``...overload._op(...)``, the dispatcher
    entry ``OpOverload.__call__`` forwards to, without that Python frame (~0.7 us). Dynamo cannot
    trace ``_op``, so this is the eager-only code."""
    bindings = bindings or {}
    out = []
    for item in body:
        m = _OVERLOAD_CALL.match(item)
        if m is not None and _plain_overload(*m.groups()[1:]):
            head, name = m.group(0), m.group(1)
            binding = bindings.get(name)
            call = f"{name} = {binding}(" if binding else head[:-1] + "._op("
            item = call + item[len(head):]
        out.append(item)
    return out


# Where torch's Python bindings of ATen ops live, as generated code names them.
_BINDING_HOMES = (
    ("torch._C._VariableFunctions", "_VariableFunctions"), ("torch._C._nn", "_nn"), ("torch._C._special", "_special"),
    ("torch._C._linalg", "_linalg"), ("torch._C._fft", "_fft"), ("torch._C.TensorBase", "TensorBase"),
)
_BINDINGS: dict[tuple, str | None] = {}  # probe results per (overload, argument kinds)
_BINDINGS_LOCK = threading.Lock()


def binding_for(node: Node) -> str | None:
    """The text of a Python binding (``torch._C._nn.linear``) that, called with ``node``'s
    arguments, dispatches exactly what its OpOverload does, or None.

    The Python argument parser picks an overload by the arguments' Python types, so a binding is
    only taken where it is verified: both are called on meta tensors shaped like the node's inputs
    under a dispatch mode, and must reach the same ATen calls with the same arguments (composite
    ops compare their decompositions). Nodes without fake values (a loaded module) get None.
    """
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or type(op).__call__ is not torch._ops.OpOverload.__call__:
        return None
    name = op._schema.name
    if not name.startswith("aten::") or op._schema.is_mutable or not _on_cpu(node):
        return None
    try:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _meta_of)
    except Exception:  # no fake value (a loaded module), or one the probe cannot rebuild
        return None
    key = (op, _kinds((args, kwargs)))
    with _BINDINGS_LOCK:
        if key in _BINDINGS:
            return _BINDINGS[key]
    found = None
    opname = name.split("::", 1)[1]
    for text, attr in _BINDING_HOMES:
        home = getattr(torch._C, attr, None)
        fn = getattr(home, opname, None)
        if fn is not None and _same_dispatch(op, fn, args, kwargs):
            found = f"{text}.{opname}"
            break
    with _BINDINGS_LOCK:
        _BINDINGS[key] = found
    return found


def _on_cpu(node: Node) -> bool:
    """Whether the node's values and devices are all CPU's. Hand-written bindings (``Tensor.contiguous``)
    take a device guard the boxed call does not, which needs the device's runtime: a CUDA graph (fake
    CUDA tensors in verify, or a real GPU, which no test here has) keeps its overload calls."""
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes), node.args, node.kwargs]
    for leaf in torch.utils._pytree.tree_leaves(values):
        device = leaf.device if isinstance(leaf, torch.Tensor) else leaf if isinstance(leaf, torch.device) else None
        if device is not None and device.type != "cpu":
            return False
    return True


class _NoMeta(Exception):
    pass


def _meta_of(arg: Node) -> Any:
    """A node's value for the probe: tensors as meta tensors of its (hinted) sizes, SymInts as ints."""
    val = arg.meta.get("val")
    if val is None:
        raise _NoMeta
    return torch.utils._pytree.tree_map(_concrete, val)


def _concrete(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        sizes = [_hint(d) for d in v.shape]
        strides = [_hint(d) for d in v.stride()] if v.layout is torch.strided else None
        if strides is None:
            raise _NoMeta
        return torch.empty_strided(sizes, strides, dtype=v.dtype, device="meta")
    return _hint(v) if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else v


def _hint(v: Any) -> Any:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = v.node.hint
        if hint is None:
            raise _NoMeta
        return hint
    return v


def _kinds(value: Any) -> tuple:
    """What the argument parser sees: Python types, and tensors' dtype and rank (shapes vary)."""
    leaves, spec = torch.utils._pytree.tree_flatten(value)
    return str(spec), tuple((t.dtype, t.dim()) if isinstance(t, torch.Tensor) else (type(t), t) for t in leaves)


class _Record(TorchDispatchMode):
    """The ATen calls made below autograd, with their arguments in a comparable form."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.inputs = {id(t): i for i, t in enumerate(inputs)}
        self.calls: list[tuple] = []

    def _form(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", self.inputs.get(id(v)), tuple(v.shape), tuple(v.stride()), v.dtype)
        return v

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append((func, torch.utils._pytree.tree_map(self._form, (args, kwargs))))
        return func(*args, **kwargs)


def _same_dispatch(op: Any, fn: Any, args: tuple, kwargs: dict) -> bool:
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # The probe runs the op: a factory (randn, dropout's bernoulli) on the CPU draws from the user's
    # generators, which are put back (a model's own draws on its next call would differ from eager's).
    try:
        with rng_kept():
            with _Record(inputs) as want:
                op(*args, **kwargs)
            with _Record(inputs) as got:
                fn(*args, **kwargs)
    except Exception:
        return False
    return bool(want.calls) and want.calls == got.calls


def eager_body(body: list[str], bindings: Mapping[str, str] | None = None) -> list[str]:
    """The body AmpModule runs outside dynamo: state reads hoisted, overloads called directly."""
    return call_overloads_directly(hoist_state_reads(body), bindings)


def bindings_of(graph: torch.fx.Graph) -> dict[str, str]:
    """Node name -> verified binding (:func:`binding_for`), for every call node that has one."""
    found = {}
    for node in graph.nodes:
        binding = binding_for(node) if node.op == "call_function" else None
        if binding is not None:
            found[node.name] = binding
    return found
