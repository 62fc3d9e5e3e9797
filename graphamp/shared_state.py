"""What graphamp shares with the rest of the process, scoped: one lock for captures, compile-time
settings for the compiling thread only, and printed output held per thread.

graphamp runs inside the user's process, beside their own torch code and threads. Three kinds of
torch state it needs are process-wide:

- tracing at pre-dispatch (``torch.export``, ``make_fx(pre_dispatch=True)``, dynamo) keeps its mode
  stack in a Python global (``torch._ops._mode_stack_state_for_pre_dispatch``), so two threads
  tracing at once corrupt each other's trace ("Trying to pop empty mode stack");
- inductor's config (``freezing``) and FakeTensorMode's kernel table are module globals;
- ``sys.stdout`` and ``sys.stderr``.

:func:`capture_lock` serializes graphamp's captures with each other and with dynamo's compiles (it
is dynamo's own compile lock, re-entrant); :func:`compile_scoped` applies settings to the dynamo
compiles the current thread starts, under that lock, and nowhere else; :func:`printed_output_held`
holds what the current thread prints while other threads print as usual. (Whether the calling
thread is being traced, which ``torch.compiler.is_compiling()`` answers for the whole process, is
:func:`graphamp.runtime_guards.traced`: the runtime asks it.)
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["capture_lock", "compile_scoped", "in_capture", "printed_output_held"]

_local = threading.local()


def _dynamo_compile_lock() -> Any:
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:  # a torch without it: graphamp's own lock still serializes its captures
        return threading.RLock()
    return compile_lock


# Dynamo holds it while it traces and compiles a frame (and inductor while it compiles a backward);
# graphamp's backend runs inside it. One lock, taken in one order: a capture that falls back to
# torch.compile, or a backend compile that traces again, re-enters it instead of waiting on a
# second lock that another thread holds. Re-entrant: a capture runs the model, which may reach
# another capture (a converted module re-converting for a new shape class while being checked).
_CAPTURE_LOCK = _dynamo_compile_lock()


@contextlib.contextmanager
def capture_lock() -> Iterator[None]:
    """Hold the process-wide capture lock: no other thread traces (graphamp or dynamo) meanwhile.

    >>> with capture_lock():
    ...     with capture_lock():  # re-entrant
    ...         assert in_capture()
    >>> assert not in_capture()
    """
    with _CAPTURE_LOCK:
        depth = getattr(_local, "capture_depth", 0)
        _local.capture_depth = depth + 1
        try:
            yield
        finally:
            _local.capture_depth = depth


def in_capture() -> bool:
    """Whether this thread is inside :func:`capture_lock`."""
    return getattr(_local, "capture_depth", 0) > 0


_REGISTER_LOCK = threading.Lock()


def _on_compile_start(args: Any) -> None:
    factories = getattr(_local, "compile_settings", None)
    if not factories or getattr(_local, "compile_stack", None) is not None:
        return
    stack = contextlib.ExitStack()
    try:
        for factory in factories:
            stack.enter_context(factory())
    except BaseException:
        stack.close()
        raise
    _local.compile_stack = stack


def _on_compile_end(args: Any) -> None:
    stack = getattr(_local, "compile_stack", None)
    if stack is not None:
        _local.compile_stack = None
        stack.close()


def _callbacks_registered() -> None:
    # torch._dynamo.reset() clears every registered callback: checked again on each use.
    from torch._dynamo.callback import callback_handler

    if _on_compile_start in callback_handler.start_callbacks and _on_compile_end in callback_handler.end_callbacks:
        return
    with _REGISTER_LOCK:
        if _on_compile_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_compile_start)
        if _on_compile_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(_on_compile_end)


@contextlib.contextmanager
def compile_scoped(*settings: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """While the block runs, every dynamo compile this thread starts (at its start, before dynamo
    traces, until inductor has compiled) runs inside each of ``settings()``; nothing else sees them.

    Dynamo holds its compile lock from the start of a compile to its end, so no other thread's
    compile runs meanwhile; calls that do not compile (the common case) change nothing at all.
    Such a setting is ``torch._inductor.config.patch(freezing=True)``: dynamo reads the flag when it
    traces, to make parameters constants inductor may fold, so a per-compile ``options=`` dict is
    too late for it.

    >>> import torch
    >>> import torch._inductor.config as inductor_config
    >>> seen = []
    >>> def backend(gm, example_inputs):  # runs inside the compile
    ...     seen.append(inductor_config.freezing)
    ...     return gm
    >>> with compile_scoped(lambda: inductor_config.patch(freezing=True)):
    ...     _ = torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
    >>> assert seen == [True] and inductor_config.freezing is False
    """
    _callbacks_registered()
    outer = getattr(_local, "compile_settings", ())
    _local.compile_settings = (*outer, *settings)
    try:
        yield
    finally:
        _local.compile_settings = outer




class _HeldOutput:
    """A stand-in for sys.stdout/sys.stderr: what its thread writes is kept, in order, until the
    capture ends; what other threads write goes straight through. Once its capture ends it passes
    everything through, so a stream another thread installed over it meanwhile keeps working."""

    def __init__(self, stream: Any, held: list[tuple[Any, str]]) -> None:
        self._stream = stream
        self._held = held
        self._thread = threading.get_ident()
        self._open = True

    def write(self, text: str) -> int:
        if self._open and threading.get_ident() == self._thread:
            self._held.append((self._stream, text))
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        if not (self._open and threading.get_ident() == self._thread):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def printed_output_held(drop: Callable[[BaseException | None], set[str]]) -> Iterator[None]:
    """Hold what this thread prints during the block; at its end write it out but for the texts
    ``drop(failure)`` names (and the newline after each). Other threads print meanwhile as usual.

    Taken under :func:`capture_lock`, so that only one thread holds at a time; a stream replaced
    meanwhile by someone else is left as they set it.
    """
    held: list[tuple[Any, str]] = []
    with capture_lock():
        out, err = sys.stdout, sys.stderr
        held_out, held_err = _HeldOutput(out, held), _HeldOutput(err, held)
        sys.stdout, sys.stderr = held_out, held_err
        failure: BaseException | None = None
        try:
            yield
        except BaseException as e:
            failure = e
            raise
        finally:
            held_out._open = held_err._open = False
            if sys.stdout is held_out:
                sys.stdout = out
            if sys.stderr is held_err:
                sys.stderr = err
            dumps = drop(failure)
            after_dump = False
            for stream, text in held:
                if text in dumps or (after_dump and text == "\n"):
                    after_dump = text in dumps
                    continue
                after_dump = False
                stream.write(text)
