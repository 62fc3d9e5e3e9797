"""Inductor as graphamp's compiled paths call it: config patches, the backend, and scoped freezing.

The backend's inductor hand-off, ``convert(..., compile=True)`` (:mod:`graphamp.compiled`) and the
bench's compiled alternatives all compile through these, so every compiled program gets the same
joint-graph pass and the same freezing semantics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from graphamp.passes.recompute_masks import RecomputeMasks
from graphamp.shared_state import compile_scoped

__all__ = ["Inductor", "freezing_patch", "inductor_freezing", "inductor_patches"]


def inductor_patches(**patches: Any) -> dict[str, Any]:
    """Inductor config patches for graphamp's compiled graphs: ``patches`` plus the joint-graph pass
    that keeps boolean masks out of saved activations (:mod:`graphamp.passes.recompute_masks`)."""
    return {"joint_custom_pre_pass": RecomputeMasks(), **patches}


class Inductor:
    """Inductor with these config patches, as a backend of its own: ``torch.compile`` caches
    compiled code per backend, so a recompile (``refresh``) never reuses frozen constants.

    AOTAutograd compiles the backward with the forward, not at the first ``backward()``: a backward
    inductor cannot compile then fails inside the module's call, where :class:`CompiledAmpModule`
    falls back to the uncompiled graph (and ``convert(compile=True)`` raises ``CompileError``),
    instead of raising from ``loss.backward()`` in the user's loop."""

    def __init__(self, patches: dict[str, Any]) -> None:
        self.patches = dict(patches)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        import torch._functorch.config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return compile_fx(gm, example_inputs, config_patches=self.patches)


def inductor_freezing() -> contextlib.AbstractContextManager:
    """Inductor's ``freezing`` for the dynamo compiles this thread starts inside the block, and for
    nothing else (:func:`graphamp.shared_state.compile_scoped`).

    ``torch.compile(..., options={"freezing": True})`` is not enough: dynamo reads the global flag
    (``torch._dynamo.utils.is_parameter_freezing``) when it traces, to make parameters and buffers
    static inputs that inductor may fold; without it inductor gets them as graph inputs and folds
    nothing (no low-precision weights constant-folded, no oneDNN prepacking). The flag is set from
    the start of such a compile to its end, under dynamo's compile lock, so no other compile sees
    it; a call that does not compile changes nothing.
    """
    return compile_scoped(freezing_patch)


def freezing_patch() -> contextlib.AbstractContextManager:
    """Inductor's global ``freezing`` flag set, for one compile (see :func:`inductor_freezing`)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True)
