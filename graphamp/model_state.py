"""What a converted module's model held at conversion, and the per-call check that it still does.

A converted graph reads the parameters and buffers the model held when it was converted (or, for
weights frozen to low precision, was cast from them). A tensor replaced in the model afterwards
(``model.fc.weight = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``, a submodule
swapped, FSDP's ``fully_shard`` applied to inner modules) is one the graph never reads: it would
compute with, and train, tensors the user no longer holds. :class:`ModelState` notices each of
these at the next call (and the converted module follows a buffer replaced by one of the same kind:
``graphamp.model_binding.follow_replaced_buffers``).

Per call it compares the model's module classes (a list compare) and a process-wide count of
parameter, buffer and submodule registrations, kept by torch's global registration hooks while a
converted module lives; only when either moved are the tensors compared by name, once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from graphamp.errors import GraphampError, ModelChangedError

__all__ = ["ModelState", "Versions"]

# Registrations of a parameter, buffer or submodule on any module of the process, counted while
# at least one ModelState lives (an int in a list: the hooks add to it without a lock; two threads
# racing may count one registration instead of two, which still moves it).
_registrations = [0]
_watchers = 0
_handles: list[torch.utils.hooks.RemovableHandle] = []
_watch_lock = threading.Lock()


def _count(module: nn.Module, name: str, value: object) -> None:
    _registrations[0] += 1


def _watch() -> None:
    global _watchers
    with _watch_lock:
        if _watchers == 0:
            _handles[:] = [
                register_module_parameter_registration_hook(_count),
                register_module_buffer_registration_hook(_count),
                register_module_module_registration_hook(_count),
            ]
        _watchers += 1


def _unwatch() -> None:
    global _watchers
    with _watch_lock:
        _watchers -= 1
        if _watchers == 0:
            for handle in _handles:
                handle.remove()
            _handles.clear()


class ModelState:
    """The model's modules and their classes, and each parameter and buffer by name, as they are
    now; :meth:`unchanged` says cheaply whether that may still hold, :meth:`replaced` names what
    does not.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> state = ModelState(model)
    >>> assert state.unchanged() and state.replaced(model) == []
    >>> model[1].weight = nn.Parameter(torch.zeros(2, 2))
    >>> assert not state.unchanged() and state.replaced(model) == ["1.weight"]
    """

    def __init__(self, model: nn.Module, reads: dict[str, torch.Tensor] | None = None) -> None:
        _watch()
        weakref.finalize(self, _unwatch)
        self.tensors = _held(model)
        # The names under which the converted module holds the model's own object: those may be
        # replaced on both sides alike. The others (a weight frozen to a low-precision copy) must
        # stay what they were.
        self.shared = {name for name, tensor in (reads or {}).items() if self.tensors.get(name) is tensor}
        self.kinds = {name: (tensor.dtype, tensor.device) for name, tensor in self.tensors.items()}
        self.accept(model)

    def accept(self, model: nn.Module) -> None:
        """Take the model's modules and classes as they are now (its tensors were found unchanged)."""
        self.generation = _registrations[0]
        self.modules = list(model.modules())
        self.classes = list(map(type, self.modules))

    def unchanged(self) -> bool:
        """True if no module anywhere registered a parameter, buffer or submodule since the last
        look and no module of the model changed class: then no tensor of the model was replaced
        (but through its modules' private dictionaries)."""
        return self.generation == _registrations[0] and list(map(type, self.modules)) == self.classes

    def replaced(self, model: nn.Module, reads: dict[str, torch.Tensor] | None = None) -> list[str]:
        """The names under which the model no longer holds what the converted module reads: for a
        name it shared at conversion, the object ``reads`` holds now (so a tensor replaced in both
        is fine, and in one only is not); for the others, the object held at conversion."""
        reads, now = reads or {}, _held(model)
        return [
            name for name, tensor in self.tensors.items()
            if now.get(name) is not (reads.get(name) if name in self.shared else tensor)
        ]

    def refusal(self, model: nn.Module, replaced: list[str]) -> ModelChangedError | None:
        """The error to raise where the model no longer holds the ``replaced`` tensors, or was
        sharded by FSDP after conversion; else None."""
        theirs = [p for _, p in model.named_parameters(remove_duplicate=False)]
        sharded = type(model).__name__.startswith("FSDP") or any(
            type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor" for p in theirs
        )
        names = ", ".join(replaced[:3]) + (" ..." if len(replaced) > 3 else "")
        if sharded:
            return ModelChangedError(
                f"{type(model).__name__} was sharded (FSDP fully_shard) after graphamp converted it: the converted "
                f"graph reads the parameters from before sharding ({names}), so it would train nothing and reduce "
                "no gradient. Way out: shard first, then convert (graphamp.TrainStep / graphamp.convert on the "
                "sharded model), or torch.compile(model, backend=\"graphamp\")."
            )
        if not replaced:
            return None
        return ModelChangedError(
            f"{type(model).__name__}'s parameters or buffers were replaced after graphamp converted it ({len(replaced)} "
            f"of {len(self.tensors)}: {names}): the converted graph reads the old tensors, which the model and its "
            "optimizer no longer see. Way out: update them in place (load_state_dict without assign=True, optimizer "
            "steps, param.data.copy_), or graphamp.convert the model again."
        )

    def retyped(self, model: nn.Module) -> list[str]:
        """The names whose tensor in the model has another dtype or device than at conversion
        (``model.half()``, ``model.to(...)``, an assigned ``.data``), which the graph's casts were not
        chosen for.

        >>> model = nn.Linear(2, 2)
        >>> state = ModelState(model)
        >>> assert state.retyped(model.half()) == ["weight", "bias"]
        """
        now = _held(model)
        return [name for name, kind in self.kinds.items() if name in now and (now[name].dtype, now[name].device) != kind]

    def retyped_refusal(self, model: nn.Module | None, error: RuntimeError) -> ModelChangedError | None:
        """The error to raise instead of ``error``, which the converted graph raised, where the
        model's tensors changed dtype or device since conversion; else None."""
        retyped = [] if model is None or isinstance(error, GraphampError) else self.retyped(model)
        if not retyped:
            return None
        names = ", ".join(retyped[:3]) + (" ..." if len(retyped) > 3 else "")
        return ModelChangedError(
            f"{type(model).__name__}'s parameters or buffers changed dtype or device after graphamp converted it "
            f"({len(retyped)} of {len(self.kinds)}: {names}; model.half() or model.to(...)), and the converted graph, "
            f"whose casts were chosen for the old ones, failed: {error} Way out: change the model's dtype or device "
            "before converting, or graphamp.convert it again."
        )


def _held(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name, as it holds them now."""
    held = dict(model.named_parameters(remove_duplicate=False))
    held.update(model.named_buffers(remove_duplicate=False))
    return held


class Versions:
    """The version counters and data pointers of some tensors, held weakly, and whether any moved
    since they were taken: an update in place (``optimizer.step()``, ``load_state_dict``, an
    in-place op under ``no_grad``) moves the version, a swapped ``.data`` the pointer; a tensor gone
    (its model deleted) can no longer move. An edit through ``.data`` in place moves neither.

    >>> w = nn.Parameter(torch.zeros(2))
    >>> versions = Versions([w])
    >>> assert not versions.moved()
    >>> with torch.no_grad():
    ...     _ = w.add_(1)
    >>> assert versions.moved()
    >>> versions.take([w])
    >>> assert not versions.moved()
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.take(tensors)

    def take(self, tensors: Iterable[torch.Tensor]) -> None:
        self.entries = [(weakref.ref(t), t._version, t.data_ptr()) for t in tensors]

    def moved(self) -> bool:
        # A plain loop: a compiled module asks on every call (a generator of method calls costs twice).
        for ref, version, pointer in self.entries:
            t = ref()
            if t is not None and (t._version != version or t.data_ptr() != pointer):
                return True
        return False

    def unmoved(self) -> Versions:
        """These versions without the tensors that moved since they were taken (a program that
        writes a buffer in place, batch norm's running statistics in training)."""
        kept = Versions(())
        kept.entries = [entry for entry in self.entries if not self._moved(entry)]
        return kept

    @staticmethod
    def _moved(entry: tuple) -> bool:
        ref, version, pointer = entry
        t = ref()
        return t is not None and (t._version != version or t.data_ptr() != pointer)
