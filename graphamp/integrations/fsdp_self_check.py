"""convert's self-check for a model converted unit by unit for FSDP2: the converted module and
eager autocast + FSDP, each run forward and backward through FSDP's hooks, compared bitwise on
every output and every rank's gradient shard."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphamp.eager import Outcome, autocast_call, difference, fixed_loss, fp32_interface, same_start
from graphamp.emit import SelfCheck
from graphamp.errors import PolicyDriftError, PolicyDriftWarning
from graphamp.spec import AmpSpec

__all__ = ["self_check"]


def self_check(amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, on_drift: str) -> Any:
    """``convert``'s self-check for a model converted unit by unit: the example through ``amp`` and
    through ``model`` under eager autocast, each with FSDP's hooks, from the same random state and
    buffers; every output and every rank's gradient shard of the fixed loss must be bitwise equal.

    The generic check takes gradients with ``torch.autograd.grad`` with respect to the parameters,
    which FSDP's sharded parameters are not in the autograd graph of (the gathered ones are); here
    ``backward`` runs as in training, so FSDP reduce-scatters into the shards' ``.grad`` (restored
    after). Every rank must call it together; all ranks raise (or warn) if any rank differs.
    """
    import time
    import warnings

    import torch.distributed as dist

    start = time.perf_counter()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in named]

    def run(call: Any) -> Outcome:
        for _, p in named:
            p.grad = None
        with same_start(model), torch.enable_grad():
            out = call()
            loss = fixed_loss(out)
            if loss.requires_grad:
                loss.backward()
        grads = {n: _local(p.grad) for n, p in named}
        return Outcome(pytree.tree_map_only(torch.Tensor, lambda t: _local(t.detach()), out), grads)

    amp_args, amp_kwargs = fp32_interface((args, kwargs)) if spec.keep_io_types else (args, kwargs)
    try:
        ref = run(lambda: autocast_call(model, args, kwargs, spec))
        got = run(lambda: amp(*amp_args, **amp_kwargs))
    finally:
        for (_, p), grad in zip(named, saved):
            p.grad = grad
    problem = difference(got, ref, keep_io_types=spec.keep_io_types)
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([1 if problem else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not problem:
            problem = "another rank's outputs or gradient shards differ"
    seconds = time.perf_counter() - start
    if not problem:
        return SelfCheck(ok=True, grads=bool(named), seconds=seconds)
    message = (
        f"graphamp.convert's self-check: the {type(model).__name__} converted unit by unit for FSDP differs from "
        f"eager torch.autocast({spec.device_type}, {spec.dtype}) + FSDP on the example: {problem}. Way out: report it "
        "(it is a graphamp bug); meanwhile use torch.compile(model, backend=\"graphamp\") or eager torch.autocast; "
        "self_check='warn' returns the module anyway."
    )
    if on_drift == "raise":
        raise PolicyDriftError(message)
    warnings.warn(message, PolicyDriftWarning, stacklevel=3)
    return SelfCheck(ok=False, grads=bool(named), seconds=seconds, problem=problem)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor (a sharded gradient), else the tensor."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t
