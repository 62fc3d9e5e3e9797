"""The converted module's Python code: its parameter and buffer reads hoisted into one call.

FX writes a ``get_attr`` node as an attribute chain, ``getattr(self.blocks, "0").weight``: each
link is a Python-level ``nn.Module.__getattr__`` call, about 0.7 us, so reading 48 weights costs
~100 us a call, more than many small models spend in their ops' overhead. :func:`hoist_state_reads`
rewrites each run of consecutive ``get_attr`` lines of the generated code into one
``self._graphamp_read(...)`` (:func:`graphamp.runtime.read_state`), which walks the same module
tree through its dictionaries on every call (~16 us for those 48). The graph is unchanged, so
interpreters and passes see ``get_attr`` nodes as before, and every call reads the module's
current state: replacing a parameter, ``load_state_dict(assign=True)``, ``_apply`` and swapped
submodules are all seen.

Only the code changes, and only lines that are exactly what FX writes for a ``get_attr``; a line in
any other form (a future FX format, a type annotation) is left as FX wrote it, which is slower and
as correct. A saved module stores FX's own code (``AmpModule.__reduce__``), so files do not depend
on this rewrite.
"""

from __future__ import annotations

import re

__all__ = ["READ_METHOD", "call_overloads_directly", "eager_body", "hoist_state_reads"]

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
    import torch

    try:
        target = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return False
    return isinstance(target, torch._ops.OpOverload) and type(target).__call__ is torch._ops.OpOverload.__call__


def call_overloads_directly(body: list[str]) -> list[str]:
    """FX's body with each ``torch.ops.ns.op.overload(...)`` call made as ``...overload._op(...)``:
    the dispatcher's entry that ``OpOverload.__call__`` forwards to, without that Python frame
    (~0.7 us an op). Dynamo cannot trace ``_op``, so this is the eager-only code."""
    out = []
    for item in body:
        m = _OVERLOAD_CALL.match(item)
        if m is not None and _plain_overload(*m.groups()[1:]):
            head = m.group(0)
            item = head[:-1] + "._op(" + item[len(head):]
        out.append(item)
    return out


def eager_body(body: list[str]) -> list[str]:
    """The body AmpModule runs outside dynamo: state reads hoisted, overloads called directly."""
    return call_overloads_directly(hoist_state_reads(body))
