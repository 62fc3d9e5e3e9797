"""The same node stack traces for less: while tracing, frames' source lines are read only for the frames kept.

torch.fx records the Python stack of every node it creates (``CapturedTraceback.extract().summary()``)
and keeps the frames from the first ``forward`` on. ``summary()`` builds a ``FrameSummary`` for every
frame of the stack with its source line read at once; under pytest, FSDP and export a stack is about
130 frames, of which a handful are kept. On a 2-layer Llama in an FSDP TrainStep that reading was
20 of 43 s of the conversion. ``FrameSummary(..., lookup_line=False)`` reads the line when ``.line``
is first asked for (formatting does), so every trace, and every message built from one, is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator

import torch.utils._traceback as _torch_traceback

_ORIGINAL = getattr(_torch_traceback, "_extract_symbolized_tb", None)
_lock = threading.Lock()
_depth = 0


def _extract_symbolized_tb_lazily(tb: list[dict], skip: int) -> traceback.StackSummary:
    """torch's ``_extract_symbolized_tb`` with each frame's source line read on first use."""
    stack = traceback.StackSummary()
    for f in reversed(tb[skip:]):
        stack.append(traceback.FrameSummary(f["filename"], f["line"], f["name"], lookup_line=False))
    return stack


@contextlib.contextmanager
def source_lines_read_lazily() -> Iterator[None]:
    """Within: torch's captured tracebacks read a frame's source line only when it is formatted.
    Re-entrant and thread-safe (the first to enter installs it, the last to leave restores torch's);
    where torch no longer has the function, nothing changes."""
    global _depth
    if _ORIGINAL is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _torch_traceback._extract_symbolized_tb = _extract_symbolized_tb_lazily
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _torch_traceback._extract_symbolized_tb = _ORIGINAL
