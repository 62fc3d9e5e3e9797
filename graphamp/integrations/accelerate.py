"""Hugging Face accelerate: ``Accelerator(dynamo_plugin=GraphampDynamoPlugin())`` compiles with graphamp's backend.

accelerate accepts only the dynamo backends of its own ``DynamoBackend`` enum, so
``Accelerator(dynamo_backend="graphamp")``, ``TorchDynamoPlugin(backend="graphamp")``,
``ACCELERATE_DYNAMO_BACKEND=graphamp`` and ``TrainingArguments(torch_compile_backend="graphamp")``
all stop in accelerate with ``ValueError: 'GRAPHAMP' is not a valid DynamoBackend`` (graphamp cannot
catch it, and does not patch accelerate's enum). The supported route is accelerate's own plugin
argument, with this subclass of its ``TorchDynamoPlugin``: ``Accelerator.prepare`` then calls
``torch.compile(model, backend="graphamp", options=...)`` last, as it does for its own backends,
around the model it has wrapped (DDP, and the forward it runs under ``torch.autocast`` for
``mixed_precision="bf16"``/``"fp16"``). graphamp's compiled code switches that autocast off, so its
casts are the only ones applied. accelerate keeps one state per process and a later Accelerator keeps
the first one's dynamo plugin, silently; the plugin raises :class:`graphamp.OptionError` when it
would be ignored so.

For ``transformers.Trainer``, which builds its Accelerator itself, see
:mod:`graphamp.integrations.transformers` (``compile`` and ``prepare``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from graphamp.backend.options import BackendOptions
from graphamp.errors import OptionError

try:
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin
except ImportError as e:  # pragma: no cover - exercised only without the optional dependency
    raise ImportError("graphamp.integrations.accelerate needs accelerate: pip install accelerate") from e

__all__ = ["BACKEND", "GraphampDynamoPlugin", "check_backend_name"]

BACKEND = "graphamp"  # the torch._dynamo backend name graphamp registers (entry point torch_dynamo_backends)


class _GraphampBackend(str):
    """The backend value the plugin holds: compares unequal to ``DynamoBackend.NO`` (so accelerate
    compiles) and has the ``.value`` accelerate lower-cases into ``torch.compile(backend=...)``."""

    @property
    def value(self) -> str:
        return BACKEND.upper()


@dataclasses.dataclass
class GraphampDynamoPlugin(TorchDynamoPlugin):
    """accelerate's ``TorchDynamoPlugin`` for ``torch.compile(backend="graphamp")``.

    ``options`` are graphamp's backend options (:class:`graphamp.backend.BackendOptions`: ``dtype``,
    ``device_type``, ``mode``, ``config``, ``inner``, ...), checked here; ``mode``, ``fullgraph``,
    ``dynamic`` and ``use_regional_compilation`` are accelerate's and mean what they mean there.
    With ``options={"inner": "eager"}`` training is bitwise equal to accelerate's own
    ``mixed_precision`` run without compilation; behind inductor (the default) it matches to rounding.

    >>> plugin = GraphampDynamoPlugin(options={"inner": "eager"})
    >>> plugin.to_kwargs()["backend"], plugin.to_kwargs()["options"]
    ('graphamp', {'inner': 'eager'})
    """

    backend: Any = BACKEND

    def __post_init__(self) -> None:
        check_backend_name(self.backend, where="GraphampDynamoPlugin(backend=...)")
        self.backend = _GraphampBackend(BACKEND)
        if self.options is not None:
            if not isinstance(self.options, Mapping):
                raise OptionError(
                    f"GraphampDynamoPlugin(options=...) takes graphamp's backend options as a dict such as "
                    f"{{'inner': 'eager'}}, got {type(self.options).__name__}"
                )
            BackendOptions.parse(self.options)  # an unknown name or a bad value raises OptionError now, not at the first step
            self.options = dict(self.options)
        # accelerate's defaults for the rest (mode, fullgraph, regional compilation), from the same
        # ACCELERATE_DYNAMO_* variables; the backend variable is ours to ignore.
        saved = os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
        try:
            backend, self.backend = self.backend, "no"
            super().__post_init__()
        finally:
            self.backend = backend
            if saved is not None:
                os.environ["ACCELERATE_DYNAMO_BACKEND"] = saved
        _check_not_ignored(self)

    def to_dict(self) -> dict[str, Any]:
        config = {k: v for k, v in self.__dict__.items() if k != "backend"}
        return {**config, "backend": BACKEND}

    def to_kwargs(self) -> dict[str, Any]:
        # accelerate passes only the fields that differ from a default plugin; graphamp's default
        # backend would then be dropped, and torch.compile would use inductor.
        defaults = TorchDynamoPlugin.__new__(TorchDynamoPlugin)
        defaults.__dict__.update(mode="default", fullgraph=False, dynamic=None, options=None, disable=False)
        kwargs = {k: v for k, v in self.to_dict().items() if k in defaults.__dict__ and defaults.__dict__[k] != v}
        return {"backend": BACKEND, **kwargs}


def _check_not_ignored(plugin: GraphampDynamoPlugin) -> None:
    """accelerate keeps one state per process, and an Accelerator made after the first (a Trainer
    makes one) keeps the first one's dynamo plugin without a word: this one would compile nothing."""
    if not is_initialized():
        return
    current = AcceleratorState().dynamo_plugin
    if isinstance(current, GraphampDynamoPlugin) and current.to_kwargs() == plugin.to_kwargs():
        return
    raise OptionError(
        "an Accelerator (or a transformers Trainer) has already set up accelerate's state in this process, "
        f"with dynamo plugin {current!r}; accelerate keeps that state, so an Accelerator made with this "
        "GraphampDynamoPlugin would ignore it and compile nothing. Way out: pass the plugin to the process's "
        "first Accelerator, or compile the model yourself before accelerator.prepare(...) (accelerate does "
        "not compile a compiled module): torch.compile(model, backend='graphamp', options=...), or for a "
        "transformers model graphamp.integrations.transformers.compile(model, options=...)"
    )


def check_backend_name(backend: object, *, where: str) -> None:
    """Raise :class:`graphamp.OptionError` unless ``backend`` names graphamp's backend.

    >>> check_backend_name("graphamp", where="here")
    >>> try:
    ...     check_backend_name("inductor", where="here")
    ... except OptionError as e:
    ...     assert "TorchDynamoPlugin(backend='inductor')" in str(e)
    """
    name = backend.value if isinstance(backend, DynamoBackend) else backend
    if isinstance(name, str) and name.lower() == BACKEND:
        return
    raise OptionError(
        f"{where} got backend={backend!r}; this plugin compiles with graphamp's backend only. Way out: "
        f"omit backend= (GraphampDynamoPlugin() is backend='graphamp'), or use accelerate's own "
        f"TorchDynamoPlugin(backend={str(name).lower()!r}) for another backend"
    )
