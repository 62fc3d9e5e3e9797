"""The user's random state, kept while graphamp runs their model eagerly.

graphamp runs the model at conversion and check time (capture, the self-check, the probe,
autotune's timing and accuracy check, the backend's eager check, verify, explain, search), and
seeds it so that both sides of a comparison draw the same dropout masks. Every random generator
of the process is the user's: graphamp puts each back as it found it.

"Every generator" is the CPU default generator and, for the process's accelerator (CUDA, XPU,
MPS, a PrivateUse1 device) where it is initialized, each of its devices' default generators;
and XLA's, where ``torch_xla`` is loaded. An accelerator that is present but not initialized holds
no state of the user's yet, and graphamp neither initializes it nor seeds it: not with
``torch.manual_seed``, which queues a seed on a CUDA not yet initialized that lands when the user
initializes it, and not with ``torch.random.fork_rng(devices=[])``, which keeps the CPU
generator only. graphamp code reads, seeds and restores generators only through this module
(``tests/test_eager_rng.py`` checks the source): :func:`rng_kept` around a run, and
:class:`RngState` where two runs start from the same state.

>>> before = torch.get_rng_state()
>>> with rng_kept(seed=0):
...     a = torch.rand(3)
>>> with rng_kept(seed=0) as start:
...     b = torch.rand(3)
...     start.restore()
...     c = torch.rand(3)
>>> assert torch.equal(a, b) and torch.equal(b, c)
>>> assert torch.equal(torch.get_rng_state(), before)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["RngState", "rng_kept"]


class RngState:
    """A snapshot of every generator the process holds state in (see the module's docstring):
    :meth:`restore` puts each back, :meth:`seed` seeds exactly those.

    >>> state = RngState()
    >>> a = torch.rand(3)
    >>> state.restore()
    >>> assert torch.equal(torch.rand(3), a)
    >>> state.seed(0)
    >>> b = torch.rand(3)
    >>> _ = torch.default_generator.manual_seed(0)
    >>> assert torch.equal(torch.rand(3), b)
    >>> state.restore()
    >>> assert torch.equal(torch.rand(3), a)
    """

    def __init__(self) -> None:
        self.cpu = torch.default_generator.get_state()
        self.accelerator = _initialized_accelerator()
        module = self.accelerator
        self.devices = [module.get_rng_state(i) for i in range(module.device_count())] if module is not None else []
        self.xla = _xla_model()
        self.xla_seed = self.xla.get_rng_state() if self.xla is not None else None

    def restore(self) -> None:
        """Put every generator of the snapshot back in the state it was taken in."""
        torch.default_generator.set_state(self.cpu)
        for i, state in enumerate(self.devices):
            self.accelerator.set_rng_state(state, i)
        if self.xla is not None:
            self.xla.set_rng_state(self.xla_seed)

    def seed(self, seed: int) -> None:
        """Seed every generator of the snapshot (and no other) with ``seed``: on the CPU, the
        stream ``torch.manual_seed(seed)`` starts."""
        torch.default_generator.manual_seed(seed)
        if self.devices:  # each of its devices (MPS has one, and manual_seed only)
            seed_all = getattr(self.accelerator, "manual_seed_all", None) or self.accelerator.manual_seed
            seed_all(seed)
        if self.xla is not None:
            self.xla.set_rng_state(seed)


@contextlib.contextmanager
def rng_kept(seed: int | None = None) -> Iterator[RngState]:
    """Every generator of the process restored on exit (also on an exception), and seeded with
    ``seed`` on entry unless it is None. Yields the :class:`RngState` the block starts from
    (seeded, where ``seed`` is given), whose ``restore()`` starts another run from the same state.

    >>> before = torch.get_rng_state()
    >>> try:
    ...     with rng_kept(seed=3):
    ...         _ = torch.rand(2)
    ...         raise RuntimeError("the run failed")
    ... except RuntimeError:
    ...     pass
    >>> assert torch.equal(torch.get_rng_state(), before)
    """
    kept = RngState()
    try:
        if seed is None:
            yield kept
        else:
            kept.seed(seed)
            yield RngState()
    finally:
        kept.restore()


def _initialized_accelerator() -> ModuleType | None:
    """The torch module of the process's accelerator (``torch.cuda``, ...) if it is initialized,
    else None. Availability alone does not count: a CUDA not initialized has no state of the
    user's, and reading its generators would initialize it. MPS has no lazy initialization: there
    a generator exists where the device does."""
    device = torch.accelerator.current_accelerator()
    if device is None:
        return None
    module = torch.get_device_module(device.type)
    ready = getattr(module, "is_initialized", None) or getattr(module, "is_available", None)
    return module if ready is not None and ready() else None


def _xla_model() -> Any:
    """``torch_xla.core.xla_model`` where the user's code has loaded it (graphamp never imports it)."""
    return sys.modules.get("torch_xla.core.xla_model")
