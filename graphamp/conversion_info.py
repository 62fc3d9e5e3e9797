"""What a converted module records about its conversion: what it was converted for
(:class:`AmpInfo`, ``amp.graphamp_info``) and what convert's self-check found (:class:`SelfCheck`,
``graph_info(amp).self_check``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphamp.config import Config
from graphamp.spec import AmpSpec

__all__ = ["AmpInfo", "SelfCheck"]


@dataclass(frozen=True)
class AmpInfo:
    """What a converted module was converted for (``amp.graphamp_info``); saved with it."""

    __module__ = "graphamp"  # its public path, which saved modules name

    device_type: str
    dtype: torch.dtype
    mode: str
    training: bool
    config: Config
    inference: bool = False
    keep_io_types: bool = False  # a default: modules saved before it was recorded load with it
    no_grad: bool = False  # the graph for calls without grad of an exact module (AmpSpec.no_grad)
    capture: str = "export"  # how the graph was captured (AmpSpec.capture); other shapes capture alike

    def __setstate__(self, state: dict) -> None:
        """Load a saved module's record; files saved before ``no_grad`` was so named call it ``grad_free``.

        >>> old = AmpInfo.__new__(AmpInfo)
        >>> old.__setstate__({"device_type": "cpu", "dtype": torch.bfloat16, "mode": "exact", "training": False, "config": Config(), "grad_free": True})
        >>> assert old.no_grad and "grad_free" not in vars(old)
        """
        state = dict(state)
        if "grad_free" in state:
            state["no_grad"] = state.pop("grad_free")
        self.__dict__.update(state)

    def spec(self) -> AmpSpec:
        """The conversion's spec again, to convert the same model for another shape class."""
        return AmpSpec(
            self.device_type, self.dtype, self.mode, self.inference, self.config, "module", self.keep_io_types, self.no_grad,
            self.capture,
        )


@dataclass(frozen=True)
class SelfCheck:
    """What convert's self-check compared and found, kept in the module's ``GraphInfo.self_check``."""

    # True: every output value and dtype (and gradient, if compared) equal to eager autocast's.
    ok: bool
    # Whether parameter gradients of a fixed loss were compared too (not for inference=True).
    grads: bool
    # Seconds the check took (both runs, and on a difference the search for the divergent node).
    seconds: float
    # What differs, empty when ok.
    problem: str = ""
