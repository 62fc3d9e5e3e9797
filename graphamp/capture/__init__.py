"""Capture a model as a pre-dispatch ATen graph, the level at which autocast itself intercepts ops.

The capture runs ``torch.export.export`` (non-strict) *under the same ambient autocast* that eager
would use. Pre-dispatch tracing records each op above the autocast dispatch key, so the graph holds
no autocast casts, while Python code that reads the autocast state (``custom_fwd``, modules that
build tensors with the running dtype) takes the same branch as under eager autocast. Each node's
``meta["val"]`` therefore carries the dtype eager autocast produced, which the exact-mode drift
check compares against.

Export traces *through* a custom ``torch.autograd.Function``: the graph would hold its forward's
ops, and autograd would differentiate those instead of calling the Function's own ``backward``
(a straight-through estimator would train with zero gradients). So while exporting, each
``Function.apply`` is recorded as one opaque node: its forward runs below the tracer, on fake
tensors and under the live autocast state (which gives the node eager's output dtypes), and the
node becomes a call of :func:`graphamp.runtime.apply_function`, which applies the Function at run
time under that same autocast state, as eager does.

The package: ``export`` (torch.export with dynamic shapes, else static), ``torchscript`` (models
holding ScriptModules), ``functions`` (kept custom autograd Functions), ``dynamo`` (convert's fallback
to ``torch.compile(backend="graphamp")`` where torch.export refuses the program itself), ``values``
(the model traced on the example's values, eager's own program with guards, where the others' program
is not eager's; and the guards an export graph gets on the values eager reads).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
from torch import nn

from graphamp.shared_state import capture_lock
from graphamp.capture.export import _describe, dynamic_shapes, _export, _is_retryable, _model_conditions, _model_ranges, _unregistered_output, host_draws_refused
from graphamp.capture.functions import _bind_kept_functions
from graphamp.capture.torchscript import script_graph
from graphamp.node_info import graph_info
from graphamp.errors import BannedOpError, CaptureError, EagerPathWarning, GraphampError, PromoteTypeError
from graphamp.spec import ambient_autocast

_log = logging.getLogger("graphamp")

__all__ = ["capture", "ambient_autocast", "script_graph"]


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device_type: str,
    dtype: torch.dtype,
    grads: bool = True,
    keep_functions: bool = True,
) -> torch.fx.GraphModule:
    """Export ``model`` under autocast(device_type, dtype) and return the unlifted graph module.

    ``grads=False`` declares that no gradient will be taken through the result (inference, export).
    ``keep_functions=False`` traces each custom ``autograd.Function``'s forward through (under
    ``no_grad``, as eager runs it) instead of keeping the Function whole: for a program that never
    runs backward and may not call graphamp (``graphamp.export``).

    Parameters and buffers are attributes of the returned module (the model's own objects),
    inputs and outputs keep their pytree structure, and every dim is symbolic where the model's
    code allows it; where it cannot take symbolic sizes at all, every dim is the example's
    (``GraphInfo.captured_static``), and the converted module converts again per shape class.
    A model holding a ``torch.jit.ScriptModule`` is first traced to a plain graph (``script_graph``).
    """
    if any(isinstance(m, torch.jit.ScriptModule) for m in model.modules()):
        model = script_graph(model, args, kwargs, device_type=device_type, dtype=dtype, grads=grads)
    try:
        # A module gradients will flow through is traced with grad on, whatever the caller's mode:
        # export records the model's own no_grad regions only when grad is on, and without them a
        # tensor the model computes without grad (a position bias) requires grad at run time, which
        # can change eager's kernel (CPU SDPA takes its math path for a mask that requires grad).
        with capture_lock(), torch.enable_grad() if grads else contextlib.nullcontext():
            with host_draws_refused(model):
                try:
                    ep, keeper, static = _export_first_that_works(model, args, kwargs, device_type, dtype, keep_functions)
                except Exception as e:
                    if not _cache_pytrees_registered(model, e):
                        raise
                    ep, keeper, static = _export_first_that_works(model, args, kwargs, device_type, dtype, keep_functions)
    except GraphampError:
        raise
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
    record = graph_info(gm)
    record.ranges, record.range_reasons = _model_ranges(ep)
    record.captured_static = static
    record.size_conditions = _model_conditions(ep)
    if keeper.kept:
        _bind_kept_functions(gm, keeper.kept)
    return gm


def _cache_pytrees_registered(model: nn.Module, e: BaseException) -> bool:
    """Whether ``e`` is torch.export refusing a Hugging Face cache in the outputs and transformers'
    own pytree registration of its cache classes (the one its exporter uses) is now done, so that
    the converted module returns the cache as eager does. False where transformers has none."""
    qualified = _unregistered_output(str(e))
    if qualified is None or not qualified.startswith("transformers.") or "cache" not in qualified.lower():
        return False
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:
        return False
    register_cache_pytrees_for_model(model)
    _log.info("graphamp: registered transformers' cache classes as pytree nodes, to return %s", qualified)
    return True



def _export_first_that_works(
    model: nn.Module, args: tuple, kwargs: dict, device_type: str, dtype: torch.dtype, keep_functions: bool = True,
) -> tuple[torch.export.ExportedProgram, Any, bool]:
    """Export the eager program with symbolic sizes, else with the example's sizes, else the program
    torch.export and torch.compile see (``is_compiling()`` True), symbolic then static; with whether
    the sizes are static. The first failure is raised when every attempt fails.

    Static sizes take models whose code cannot hold a symbolic size (``is_causal`` computed from a
    length reaches an op as a SymBool; a size used as a pytree key); the converted module then
    converts again for each other shape class it is called with.
    """
    every_dim = dynamic_shapes(model, args, kwargs)
    first: Exception | None = None
    for eager_flags in (True, False):
        for shapes in (every_dim, None):
            try:
                ep, keeper = _export(model, args, kwargs, shapes, device_type, dtype, eager_flags=eager_flags, keep_functions=keep_functions)
            except GraphampError:
                raise
            except Exception as e:
                if not _is_retryable(e):
                    raise
                first = first or e
                continue
            if not eager_flags:
                _warn_compile_path(model, first)
            return ep, keeper, shapes is None
    assert first is not None
    raise first


def _warn_compile_path(model: nn.Module, e: BaseException | None) -> None:
    # The model's eager path cannot be traced (it reads tensor values where its compile path
    # does not): graphamp took the path torch.export and torch.compile take, and says so.
    warnings.warn(
        f"graphamp traced {type(model).__name__} as torch.export sees it (torch.compiler."
        "is_compiling() True), because its eager path could not be traced: "
        f"{str(e).strip().splitlines()[0][:200]}. Where the model's code takes another "
        "path when compiling, gradients (rarely values) may differ from eager autocast; "
        "graphamp.verify(model, args, grads=True) checks it.",
        EagerPathWarning,
        stacklevel=5,
    )
