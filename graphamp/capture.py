"""Capture a model as a pre-dispatch ATen graph, the level at which autocast itself intercepts ops.

The capture runs ``torch.export.export`` (non-strict) *under the same ambient autocast* that eager
would use. Pre-dispatch tracing records each op above the autocast dispatch key, so the graph holds
no autocast casts, while Python code that reads the autocast state (``custom_fwd``, modules that
build tensors with the running dtype) takes the same branch as under eager autocast. Each node's
``meta["val"]`` therefore carries the dtype eager autocast produced, which the exact-mode drift
check compares against.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.export import Dim, ShapesCollection
from torch.utils import _pytree as pytree

from graphamp.errors import BannedOpError, CaptureError, PromoteTypeError

__all__ = ["capture", "ambient_autocast"]


@contextlib.contextmanager
def ambient_autocast(device_type: str, dtype: torch.dtype, enabled: bool = True) -> Iterator[None]:
    """Set the autocast state of ``device_type`` the way ``torch.autocast`` does, and restore it.

    ``torch.autocast("cuda")`` disables itself on a CPU-only build; the low-level switches still
    work over fake CUDA tensors, which is how the CUDA policy is exercised without a GPU.
    """
    prev_enabled = torch.is_autocast_enabled(device_type)
    prev_dtype = torch.get_autocast_dtype(device_type)
    prev_cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled(device_type, enabled)
    torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(True)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, prev_enabled)
        torch.set_autocast_dtype(device_type, prev_dtype)
        torch.set_autocast_cache_enabled(prev_cache)


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    # Every dim of every tensor input may vary; export keeps static what the model pins down.
    shapes = ShapesCollection()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            shapes[leaf] = {i: Dim.AUTO for i in range(leaf.dim())}
    return shapes.dynamic_shapes(model, args, kwargs)


def _describe(e: BaseException) -> tuple[str, str]:
    """The construct that stopped the capture, and the way out, from torch's exception."""
    text = f"{type(e).__name__}: {e}"
    first = text.strip().splitlines()[0][:300]
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered or "guardondatadependent" in lowered:
        return (
            f"data-dependent control flow or shape (a Python branch on a tensor's value): {first}",
            "make the branch independent of tensor values (torch.cond, torch.where), or use "
            "torch.compile(model, backend=\"graphamp\"), which splits the graph there",
        )
    if "constraint" in lowered or "specializ" in lowered or "dynamic" in lowered:
        return (
            f"a shape the example inputs cannot vary: {first}",
            "pass example inputs whose batch and sequence sizes are at least 2 and differ from "
            "the other dims, or use torch.compile(model, backend=\"graphamp\")",
        )
    return (
        first,
        "check that model(*args, **kwargs) runs eagerly with these example inputs; if it does, "
        "use torch.compile(model, backend=\"graphamp\"), which handles graph breaks",
    )


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device_type: str,
    dtype: torch.dtype,
) -> torch.fx.GraphModule:
    """Export ``model`` under autocast(device_type, dtype) and return the unlifted graph module.

    Parameters and buffers are attributes of the returned module (the model's own objects),
    inputs and outputs keep their pytree structure, and batch/sequence dims are symbolic.
    """
    try:
        dynamic_shapes = _dynamic_shapes(model, args, kwargs)
        # backed_size_oblivious lets a dim traced at size >= 2 also accept size 1 at run time
        # (batch 1 inference) instead of pinning the range to [2, inf).
        with (
            fx_config.patch(backed_size_oblivious=True),
            ambient_autocast(device_type, dtype),
            warnings.catch_warnings(),
        ):
            # nn.RNN* re-assign _flat_weights during tracing; export warns about it, harmlessly.
            warnings.filterwarnings("ignore", message=".*were assigned during export.*")
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:
        if "unsafe to autocast" in str(e):
            raise BannedOpError(
                f"{type(model).__name__} calls torch.nn.functional.binary_cross_entropy (or nn.BCELoss), "
                f"which {device_type} autocast bans as unsafe, as eager autocast does. Way out: use "
                "torch.nn.functional.binary_cross_entropy_with_logits or nn.BCEWithLogitsLoss, which "
                "combine the sigmoid and the loss and are safe to autocast."
            ) from e
        if "at::autocast::prioritize" in str(e):
            raise PromoteTypeError(
                f"{type(model).__name__} passes two different lower-precision dtypes to one promote-list "
                "op (cat, stack, index_copy, ...), which eager autocast rejects too ('Unexpected floating "
                "ScalarType in at::autocast::prioritize'). Way out: cast the operands to one dtype first."
            ) from e
        construct, way_out = _describe(e)
        raise CaptureError(
            f"graphamp could not capture {type(model).__name__} with torch.export: {construct}. "
            f"Way out: {way_out}."
        ) from e
    gm = ep.module(check_guards=False)
    # check_guards=False installs input checks as a forward pre-hook; graphamp emits its own.
    gm._forward_pre_hooks.clear()
    gm._forward_pre_hooks_with_kwargs.clear()
    gm.meta["range_constraints"] = dict(ep.range_constraints)
    return gm
