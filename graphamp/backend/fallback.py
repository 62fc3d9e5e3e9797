"""Where torch.export refuses a model even with static sizes (a branch on a tensor's value), convert
it with dynamo: ``torch.compile(model, backend="graphamp")``, which splits the program at each such
branch into graphs that graphamp rewrites, and runs the Python between them eagerly.

The compiled model is called inside ``torch.autocast(device_type, dtype)``: the Python between
graphs (and any op dynamo leaves to it) then runs under autocast as in eager, while the backend runs
each rewritten graph with autocast off, so graphamp's casts are the only ones applied there.
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import Any

import torch
from torch import nn

from graphamp.backend import graphamp_backend
from graphamp.errors import CaptureError
from graphamp.eager import state_restored
from graphamp.spec import AmpSpec, ambient_autocast

__all__ = ["DynamoAmpModule", "dynamo_fallback", "needs_graph_breaks"]


def needs_graph_breaks(error: CaptureError) -> bool:
    """Whether ``error`` (convert's capture failing) is one that splitting the graph can get past:
    torch.export refused the program itself, not an output type, an op autocast rejects, a kept
    Function or a TorchScript module."""
    return type(error) is CaptureError and "in its outputs" not in str(error)


def dynamo_fallback(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, refused: CaptureError) -> DynamoAmpModule:
    """The model compiled with graphamp's backend, run once on the example (state restored after) so
    that what dynamo cannot run either raises here, as a CaptureError naming it and where it is."""
    if spec.keep_io_types or spec.target != "module":
        raise refused
    amp = DynamoAmpModule(model, spec, reason=str(refused))
    try:
        with state_restored(model), torch.inference_mode(False):
            amp(*args, **kwargs)
    except Exception as e:
        where = _user_frame(e)
        raise CaptureError(
            f"graphamp could not convert {type(model).__name__}: torch.export refused it ({_first_line(refused)}), "
            f"and torch.compile with graph breaks failed too, at {where}: {type(e).__name__}: {_first_line(e)}. "
            "Way out: check that the model runs eagerly under torch.autocast on these inputs; make the code "
            "at that line traceable (torch.where instead of a branch on a value, no .item() in the middle)."
        ) from e
    return amp


class DynamoAmpModule(nn.Module):
    """A model graphamp converted with dynamo (``torch.compile(backend="graphamp")``) because
    torch.export could not capture it whole: one rewritten graph per region between graph breaks.

    Its parameters and buffers are the model's own objects under the model's names, so optimizers
    and ``state_dict`` work as on the model; the model is not modified. Other input shapes are
    dynamo's business (it recompiles, within its own limits).
    """

    def __init__(self, model: nn.Module, spec: AmpSpec, *, reason: str = "") -> None:
        super().__init__()
        # The model's own tensors and submodules, in the model's order, without the model as a
        # submodule (which would prefix every state_dict key).
        self._parameters = dict(model._parameters)
        self._buffers = dict(model._buffers)
        self._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
        self._modules = dict(model._modules)
        self.__dict__["_graphamp_model"] = model
        self.__dict__["_graphamp_spec"] = spec
        self.__dict__["_graphamp_reason"] = reason
        self.__dict__["_graphamp_compiled"] = None
        self.meta: dict[str, Any] = {}
        self.training = model.training

    @property
    def graphamp_spec(self) -> AmpSpec:
        return self.__dict__["_graphamp_spec"]

    def _compiled(self) -> Any:
        compiled = self.__dict__["_graphamp_compiled"]
        if compiled is None:
            spec = self.graphamp_spec
            options = {"dtype": spec.dtype, "device_type": spec.device_type, "mode": spec.mode, "inner": "eager"}
            if not spec.config.is_default:
                options["config"] = spec.config
            backend = functools.partial(graphamp_backend, options=options)
            compiled = self.__dict__["_graphamp_compiled"] = torch.compile(self.__dict__["_graphamp_model"], backend=backend)
        return compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        spec = self.graphamp_spec
        with ambient_autocast(spec.device_type, spec.dtype):
            if spec.inference:
                with torch.no_grad():
                    return self._compiled()(*args, **kwargs)
            return self._compiled()(*args, **kwargs)

    def train(self, mode: bool = True) -> DynamoAmpModule:
        self.__dict__["_graphamp_model"].train(mode)
        return super().train(mode)

    def cast_summary(self) -> dict[str, Any]:
        """No graph to count casts in until dynamo compiles; says how the model was converted."""
        return {"fallback": "dynamo", "reason": self.__dict__["_graphamp_reason"]}

    def extra_repr(self) -> str:
        spec = self.graphamp_spec
        return f"dynamo fallback (torch.compile, backend='graphamp'), {spec.device_type} {spec.dtype}, mode={spec.mode!r}"

    def __getstate__(self) -> dict:
        raise TypeError(
            "a DynamoAmpModule (graphamp's dynamo fallback) holds a torch.compile'd model, which cannot be "
            "pickled. Way out: save the model's state_dict, and convert the model again after loading it."
        )


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


def _user_frame(e: BaseException) -> str:
    """file:line of the innermost frame outside torch and graphamp, where the model's code failed."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return "the model's code"
    last = frames[-1]
    return f"{os.path.basename(last.filename)}:{last.lineno}"
