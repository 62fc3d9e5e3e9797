"""How autotune measures: the timer, the per-op measurement cache and the settings of a block.

:func:`measuring` sets, for the autotune conversions in a block, the timer, the cache, the budget,
the margin and whether the raised program's accuracy is checked; :class:`MeasurementCache` keeps
measured times per op signature and machine (this process, and a JSON file under
``$GRAPHAMP_CACHE_DIR`` or ``~/.cache/graphamp``). The pass that decides per op is
:mod:`graphamp.passes.autotune`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

__all__ = ["MeasurementCache", "SETTINGS", "Settings", "Timer", "Trial", "checks_accuracy", "default_cache", "measuring", "wall_timer"]

_log = logging.getLogger("graphamp")


class Trial(NamedTuple):
    """What one timing runs: ``op`` computing in ``dtype`` on inputs of ``shapes``, casts included;
    with ``backward``, its backward too (the gradient of every floating input, through the casts)."""

    op: str
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    device: torch.device
    backward: bool = False


# A timer takes a zero-argument callable and its trial, and returns seconds per call.
Timer = Callable[[Callable[[], Any], Trial], float]


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    return (lambda: sync(device)) if sync is not None else (lambda: None)


_SLOW_CALL_S = 0.1


def wall_timer(fn: Callable[[], Any], trial: Trial) -> float:
    """Seconds per call of ``fn``: the fastest of at least 3 calls after a warm-up call, more (at
    most 20) while under 20 ms in total; the device is synchronized after each call. The fastest
    call is the one least disturbed by other work on the machine. A call slower than 0.1 s (a low
    dtype this CPU emulates) is timed by its warm-up call alone: the rounds of ``_time_pair`` repeat
    it, and four calls a round would spend the measuring budget on one op.

    >>> t = wall_timer(lambda: torch.ones(8) * 2, Trial("mul", torch.float32, ((8,),), torch.device("cpu")))
    >>> assert 0 < t < 1
    """
    sync = _synchronizer(trial.device)
    start = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - start
    if first > _SLOW_CALL_S:
        return first  # the warm-up's own costs are noise next to such a call
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < 20 and time.perf_counter() - start < 0.02):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _default_cache_path() -> str:
    root = os.environ.get("GRAPHAMP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "graphamp"
    )
    return os.path.join(root, "autotune-v2.json")  # v1 files may hold timings that never settled


class MeasurementCache:
    """Measured (low s, fp32 s) per op signature and machine; with a ``path``, also kept on disk.

    >>> cache = MeasurementCache()
    >>> cache.put("linear|...", (1e-3, 2e-3))
    >>> assert cache.get("linear|...") == (1e-3, 2e-3) and cache.get("other") is None
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self._entries: dict[str, tuple[float, float]] | None = None
        self._lock = threading.Lock()

    def _load(self) -> dict[str, tuple[float, float]]:
        if self._entries is None:
            entries = {}
            if self.path is not None:
                try:
                    with open(self.path) as f:
                        entries = {k: (float(v[0]), float(v[1])) for k, v in json.load(f).items()}
                except (OSError, ValueError, TypeError, IndexError):
                    entries = {}  # a missing or damaged cache only costs a new measurement
            self._entries = entries
        return self._entries

    def get(self, key: str) -> tuple[float, float] | None:
        with self._lock:
            return self._load().get(key)

    def put(self, key: str, times: tuple[float, float]) -> None:
        with self._lock:
            self._load()[key] = times

    def save(self) -> None:
        """Write the entries to ``path`` (atomically; a failure to write is logged, not raised)."""
        if self.path is None:
            return
        with self._lock:
            entries = dict(self._load())
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f)
            os.replace(tmp, self.path)
        except OSError as e:
            _log.info("graphamp autotune: could not save the measurement cache to %s: %s", self.path, e)


_DEFAULT_CACHE: list[MeasurementCache] = []


def default_cache() -> MeasurementCache:
    if not _DEFAULT_CACHE:
        _DEFAULT_CACHE.append(MeasurementCache(_default_cache_path()))
    return _DEFAULT_CACHE[0]


@dataclasses.dataclass(frozen=True)
class Settings:
    timer: Timer = wall_timer
    cache: MeasurementCache | None = None
    budget_s: float = 10.0
    margin: float = 0.05
    check_accuracy: bool = True


SETTINGS: contextvars.ContextVar[Settings] = contextvars.ContextVar("graphamp_autotune", default=Settings())


@contextlib.contextmanager
def measuring(
    *, timer: Timer | None = None, cache: MeasurementCache | None = None, budget_s: float | None = None, margin: float | None = None,
    check_accuracy: bool | None = None,
) -> Iterator[None]:
    """How autotune conversions in this block measure: ``timer(fn, trial) -> seconds per call``,
    the ``cache`` of measurements, the ``budget_s`` of measuring per conversion, the ``margin``
    by which fp32 must be faster for an op to be raised, and whether ``convert`` checks the raised
    program's error on the example against eager autocast's (``check_accuracy``, on by default;
    off, the decisions are the timings' alone).

    >>> import graphamp
    >>> from torch import nn
    >>> from graphamp.autotune.plan import AutotunePlan
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    >>> fp32_faster = lambda fn, trial: 2.0 if trial.dtype is torch.bfloat16 else 1.0
    >>> with measuring(timer=fp32_faster, cache=MeasurementCache()):
    ...     amp = graphamp.convert(model, (torch.randn(4, 8),), mode="autotune")
    >>> assert AutotunePlan.of(amp).raised == ("linear",) and amp(torch.randn(4, 8)).dtype is torch.float32
    """
    current = SETTINGS.get()
    if budget_s is not None and not budget_s >= 0:
        raise ValueError(f"budget_s must be a non-negative number of seconds, got {budget_s!r}")
    if margin is not None and not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    token = SETTINGS.set(
        dataclasses.replace(
            current,
            timer=timer or current.timer,
            cache=cache if cache is not None else current.cache,
            budget_s=current.budget_s if budget_s is None else float(budget_s),
            margin=current.margin if margin is None else float(margin),
            check_accuracy=current.check_accuracy if check_accuracy is None else bool(check_accuracy),
        )
    )
    try:
        yield
    finally:
        SETTINGS.reset(token)


def checks_accuracy() -> bool:
    """Whether autotune conversions here check the raised program's error (see :func:`measuring`)."""
    return SETTINGS.get().check_accuracy
