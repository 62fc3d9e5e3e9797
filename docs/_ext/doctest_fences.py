"""A griffe extension for the API reference (mkdocs.yml). graphamp's docstrings carry ``>>>``
examples in plain text, which Markdown would render as nested block quotes (and read ``x[a][b]`` in
them as a link): each run of doctest lines becomes a fenced Python block. Sphinx roles
(``:class:`graphamp.Config```) become code spans."""

from __future__ import annotations

import re
from typing import Any

try:
    from griffe import Extension
except ImportError:  # imported by pytest's --doctest-modules without the docs extra
    Extension = object  # type: ignore[assignment,misc]

_PROMPT = re.compile(r"^(\s*)>>>( |$)")
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """Wrap each doctest example (prompt lines, continuation lines and expected output up to a
    blank line) in a fenced code block.

    >>> prompt = ">" * 3
    >>> fence_doctests(f"Intro.\\n\\n{prompt} 1 + 1\\n2\\n\\nAfter.").splitlines()[2:6]
    ['```python', '>>> 1 + 1', '2', '```']
    """
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _PROMPT.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent = m.group(1)
        out.append(f"{indent}```python")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


def plain_roles(text: str) -> str:
    """Sphinx cross-reference roles as Markdown code spans.

    >>> plain_roles("a :class:`graphamp.Config` and :func:`~graphamp.convert`")
    'a `graphamp.Config` and `graphamp.convert`'
    """
    return _ROLE.sub(r"`\1`", text)


class DoctestFences(Extension):  # type: ignore[misc]
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if getattr(obj, "docstring", None) is not None:
            obj.docstring.value = plain_roles(fence_doctests(obj.docstring.value))
