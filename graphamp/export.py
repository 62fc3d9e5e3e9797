"""``graphamp.export``: mixed precision as a ``torch.export.ExportedProgram`` that needs no graphamp.

Deployment's classic recipe, ``model.half()`` with half inputs, also runs norms, softmax and
reductions in half, and ``torch.autocast`` itself does not export cleanly. graphamp already holds
an explicit-cast graph equal to autocast: this module runs the inference pipeline on it (weights
used only in low precision frozen low, casts shared) and hands the graph to ``torch.export``. The
program holds plain ATen ops, no autocast region and no graphamp function, so ``torch.export.load``
runs it in a process without graphamp, and AOTInductor (``torch._inductor.aoti_compile_and_package``)
compiles it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.capture.export import dynamic_shapes
from graphamp.capture.kernels import eager_kernel_metas
from graphamp.capture.stacks import source_lines_read_lazily
from graphamp.config import Config
from graphamp.convert import check_inputs
from graphamp.pipeline import rewrite
from graphamp.backend.fallback import needs_graph_breaks
from graphamp.errors import CaptureError, ExportError, GraphampError, InputValueError, PolicyDriftWarning
from graphamp.passes.export_guards import REFUSAL, assertions_named, guards_as_asserts
from graphamp.node_info import peek_graph_info
from graphamp.policy import LOW_DTYPES
from graphamp.runtime import set_grad_enabled
from graphamp.self_check import check_self_check
from graphamp.eager import autocast_call, difference, holds_values, outcome
from graphamp.shared_state import capture_lock
from graphamp.spec import AmpSpec, autocast_off

__all__ = ["export", "check_portable", "verify_export"]

_AUTOCAST_HOPS = (torch.ops.higher_order.wrap_with_autocast,)


@source_lines_read_lazily()
def export(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    config: Config | None = None,
    keep_io_types: bool = False,
    dynamic: bool = True,
    self_check: str | bool = "raise",
) -> torch.export.ExportedProgram:
    """Export ``model`` in mixed precision: an ExportedProgram equal to eager autocast, no graphamp needed.

    Inference semantics (as ``graphamp.convert(..., inference=True)``): every weight used only in
    low precision is stored in low precision, so the program's state is about half of fp32's;
    weights autocast runs in fp32 (norms, embeddings) stay fp32. On CPU the program's outputs are
    bitwise equal to the model's under ``torch.autocast``.

    Args:
        model: the module to export (an ``nn.Module`` or a ``torch.jit.ScriptModule``); not modified.
        args, kwargs: example inputs, as for ``torch.export.export``.
        dtype: ``torch.bfloat16`` or ``torch.float16``; None takes autocast's default for the device.
        device_type: "cpu" or "cuda"; None takes the device of the model's parameters.
        config: a :class:`graphamp.Config` with op overrides and modules kept in fp32.
        keep_io_types: an fp32 interface: floating inputs given in bf16/fp16 are taken in fp32 and
            cast inside, and bf16/fp16 floating outputs are returned in fp32.
        dynamic: every input dim may vary where the model allows (``Dim.AUTO``); False fixes
            every size to the example's. Code torch.export cannot trace (a branch on a tensor's
            value) is captured on the example's values, as convert does, with fixed sizes.
        self_check: with autocast's own policy, the program and the model under eager autocast
            run the example once more without grad, and every output value and dtype must be
            bitwise equal (:func:`verify_export`). Where they differ, the model is captured on the
            example's values (the tensor values eager's Python reads become assertions in the
            program) and checked again; "raise" (default) raises :class:`graphamp.ExportError`
            if that differs too, "warn" warns :class:`graphamp.PolicyDriftWarning` and returns the
            first program, "off" skips it.

    Raises:
        graphamp.CaptureError: the model cannot be captured as one graph, by torch.export or on values.
        graphamp.ExportError: the graph would need graphamp at run time, or the program differs
            from eager autocast on the example (``self_check``). A custom ``autograd.Function``
            is traced through: its forward, as eager autocast runs it (no backward is exported).

    >>> import graphamp
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4), nn.LayerNorm(4))
    >>> x = torch.randn(8, 16)
    >>> ep = graphamp.export(model, (x,), dtype=torch.float16)
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     expected = model(x)
    >>> assert torch.equal(ep.module()(x), expected)
    >>> assert ep.state_dict["0.weight"].dtype is torch.float16   # stored low
    >>> assert graphamp.export(model, (x,), keep_io_types=True).module()(x).dtype is torch.float32
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.export")
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be True or False, got {type(dynamic).__name__}")
    on_drift = check_self_check(self_check)
    spec = AmpSpec.resolve(
        model, (args, kwargs), dtype=dtype, device_type=device_type, inference=True, config=config,
        keep_io_types=keep_io_types, target="export",
    )
    try:
        ep = _export(model, args, kwargs, spec, dynamic)
    except CaptureError as refused:  # data-dependent code torch.export cannot trace: as convert, on the example's values
        if not needs_graph_breaks(refused):
            raise
        spec = dataclasses.replace(spec, capture="values")
        try:
            ep = _export(model, args, kwargs, spec, dynamic=False)
        except CaptureError as failed:  # torch.export's refusal is the one to show; the capture's reason beside it
            raise type(refused)(
                f"{refused}\nThe capture on the example's values, which graphamp.export tries where torch.export cannot "
                f"trace the code, failed too: {type(failed).__name__}: {(str(failed).splitlines() or [''])[0][:200]}"
            ) from failed
    if on_drift == "off" or not spec.check or not holds_values(model, args, kwargs):
        return ep
    problem = verify_export(ep, model, args, kwargs, dtype=spec.dtype, device_type=spec.device_type, keep_io_types=keep_io_types)
    if not problem:
        return ep
    if spec.capture == "values":
        again = "it was captured on them already (torch.export cannot trace its code)"
    else:
        # Where eager's program depends on values the example holds (a mask eager drops by value),
        # the capture on values follows eager's program and turns what it read into assertions.
        try:
            by_values = _export(model, args, kwargs, dataclasses.replace(spec, capture="values"), dynamic=False)
            again = verify_export(by_values, model, args, kwargs, dtype=spec.dtype, device_type=spec.device_type, keep_io_types=keep_io_types)
        except GraphampError as e:
            again = f"the capture on values failed too ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        if not again:
            return by_values
    message = (
        f"graphamp.export's self-check: the exported program of {type(model).__name__} differs from eager "
        f"torch.autocast({spec.device_type}, {spec.dtype}) on the example: {problem}; captured on the example's "
        f"values: {again}. Way out: graphamp.convert(model, args, inference=True), which checks itself and converts "
        "again where eager's program changes; or self_check='warn' to take this program, which differs."
    )
    if on_drift == "raise":
        raise ExportError(message)
    warnings.warn(message, PolicyDriftWarning, stacklevel=2)
    return ep


def verify_export(
    program: torch.export.ExportedProgram,
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    keep_io_types: bool = False,
) -> str:
    """The first difference, in words, between ``program`` (from :func:`export`, or
    ``torch.export.load``) and ``model`` under eager ``torch.autocast`` on these inputs, both run
    without grad from the same random state and buffers; "" where every output value and dtype is
    bitwise equal (with ``keep_io_types``, eager's low-precision outputs compared in fp32).

    Raises :class:`graphamp.InputValueError` where the program refuses these inputs (an assertion of
    a program exported on the example's values: they take another path through the model's code).

    >>> import graphamp
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval()
    >>> x = torch.randn(4, 8)
    >>> ep = graphamp.export(model, (x,))
    >>> assert graphamp.verify_export(ep, model, (torch.randn(3, 8),)) == ""
    >>> other = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval()   # other weights
    >>> assert "differs" in graphamp.verify_export(ep, other, (x,))
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.verify_export")
    spec = AmpSpec.resolve(model, (args, kwargs), dtype=dtype, device_type=device_type, inference=True, keep_io_types=keep_io_types)
    run_args, run_kwargs = pytree.tree_map_only(torch.Tensor, _as_fp32, (args, kwargs)) if keep_io_types else (args, kwargs)
    module = program.module()
    ref = outcome(lambda: autocast_call(model, args, kwargs, spec), model, grads=False, no_grad=True, inputs=(args, kwargs))
    try:
        got = outcome(lambda: module(*run_args, **run_kwargs), model, grads=False, no_grad=True, inputs=(run_args, run_kwargs))
    except RuntimeError as e:  # an assertion of the program (export's guards): no result to compare, a refusal
        if not str(e).startswith(REFUSAL):
            raise
        raise InputValueError(f"graphamp.verify_export: the program refuses these inputs. {e}") from e
    return difference(got, ref, keep_io_types=keep_io_types)


def _export(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, dynamic: bool) -> torch.export.ExportedProgram:
    """The rewritten graph of ``model`` under ``spec``, exported by torch.export and checked portable."""
    gm = rewrite(model, args, kwargs, spec)
    # The capture on values checks what the model's code read as it runs (runtime.guard_value); a
    # program may not call graphamp, so those checks become ATen assertions, or the export is refused.
    unexpressed = guards_as_asserts(gm)
    if unexpressed:
        raise ExportError(
            f"{type(model).__name__}'s code reads tensor values to choose its program ({', '.join(unexpressed[:3])}) "
            "in a way no ATen assertion can check, so an exported program could not refuse inputs that take another "
            "path in eager. Way out: graphamp.convert(model, args, inference=True), which checks them as it runs."
        )
    # graphamp's grad-mode switches are traced through by torch.export; a kept Function is not.
    check_portable(gm, stage="the converted graph", allow=(set_grad_enabled,))
    # Weak references to the model's parameters (for AmpModule.refresh) have no place in a program.
    if (record := peek_graph_info(gm)) is not None:
        record.frozen = {}
    if spec.keep_io_types:
        args, kwargs = pytree.tree_map_only(torch.Tensor, _as_fp32, (args, kwargs))
    with (
        capture_lock(), autocast_off(), fx_config.patch(backed_size_oblivious=True), warnings.catch_warnings(),
        eager_kernel_metas(),  # fake kernels that refuse what the CPU kernel takes (fp32 _grouped_mm), as in capture
    ):
        warnings.filterwarnings("ignore", message=".*were assigned during export.*")
        try:
            ep = torch.export.export(
                gm, args, kwargs, dynamic_shapes=dynamic_shapes(gm, args, kwargs) if dynamic else None, strict=False,
            )
        except Exception as e:
            raise ExportError(
                f"torch.export could not export the mixed-precision graph of {type(model).__name__}: "
                f"{f'{type(e).__name__}: {e}'.strip().splitlines()[0][:300]}. Way out: graphamp.convert(model, "
                "args, inference=True) gives the same graph as a module; try dynamic=False if sizes are the problem."
            ) from e
    check_portable(ep.graph_module, stage="the exported program")
    if spec.capture == "values":  # torch's assertions on what the example gave: inputs they refuse read why
        assertions_named(ep.graph_module, "this program follows the example's values through the model's code "
                         "(torch.export could not trace it on any values) and holds the sizes and values they gave")
    return ep


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in LOW_DTYPES else t


def check_portable(gm: GraphModule, *, stage: str = "the graph", allow: tuple = ()) -> None:
    """Raise ExportError if ``gm`` (or a subgraph) calls graphamp or holds an autocast region.

    A program that names graphamp does not load where graphamp is not installed, and an autocast
    region would apply the policy a second time, or be dropped by exporters that inline it.

    >>> gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    >>> check_portable(gm)
    """
    for module in gm.modules():
        if not isinstance(module, GraphModule):
            continue
        for node in module.graph.nodes:
            target = node.target
            if node.op == "call_function" and target in _AUTOCAST_HOPS:
                raise ExportError(
                    f"{stage} still holds an autocast region ({node.format_node()}), which exporters "
                    "drop or reject. Way out: report it to graphamp with the model; graphamp.convert(model, "
                    "args, inference=True) runs it as a module meanwhile."
                )
            if node.op == "call_function" and getattr(target, "__module__", "").startswith("graphamp") and target not in allow:
                what = getattr(target, "__qualname__", str(target))
                raise ExportError(
                    f"{stage} calls graphamp.{getattr(target, '__module__', '').removeprefix('graphamp.')}.{what} "
                    f"at node {node.name!r}, so it would not load without graphamp: it comes from graphamp's "
                    "runtime. Way out: deploy graphamp.convert(model, args, inference=True) with graphamp installed."
                )
