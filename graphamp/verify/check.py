"""verify's check: a conversion against eager autocast, op by op, outputs and gradients.

:func:`graphamp.verify` (the frontend) converts the model with the engine and calls :func:`check`;
convert's self-check calls it on the module it already made, to name the first divergent node.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from graphamp.capture.stacks import source_lines_read_lazily
from graphamp.config import Config
from graphamp.emit import AmpModule
from graphamp.policy import short_dtype
from graphamp.spec import AmpSpec, autocast_off
from graphamp.verify.grads import _check_grads
from graphamp.verify.reference import _count_casts, _run_fake_cuda, _run_real, _uses_real_cuda
from graphamp.verify.report import GradCheck, Report, _compare_outputs
from graphamp.verify.signatures import _divergence, _scan, op_signatures

__all__ = ["check"]


@source_lines_read_lazily()
def check(
    model: nn.Module, args: tuple, kwargs: dict, *, dtype: torch.dtype | str | None, device_type: str | None, mode: str,
    config: Config | None, grads: bool, amp: AmpModule | None = None, build: Callable[..., AmpModule] | None = None,
) -> Report:
    """verify's body: ``amp``, a conversion of ``model`` already made (convert's self-check), is
    checked as it is; else ``build`` (the engine's, ``graphamp.pipeline.build``) converts it."""
    if not isinstance(grads, bool):
        raise TypeError(f"grads must be True or False, got {grads!r}")
    # No device check: a CPU model under the CUDA policy is checked on fake CUDA tensors.
    spec = AmpSpec.resolve(model, (args, kwargs), dtype=dtype, device_type=device_type, mode=mode, config=config, check_devices=False)
    device_type, dtype = spec.device_type, spec.dtype
    fake = device_type == "cuda" and not _uses_real_cuda(model, (args, kwargs))
    if fake and grads:
        raise ValueError(
            "graphamp.verify(grads=True) needs real tensors, and device_type='cuda' with no GPU runs "
            "both sides on fake CUDA tensors, which carry no values and cannot require grad (autograd "
            "over them aborts the process). Way out: check gradients with device_type='cpu' (the CPU "
            "policy), or on a machine with a GPU; check the CUDA policy's ops and dtypes with grads=False."
        )
    grad_checks: tuple[GradCheck, ...] = ()
    grad_divergence, grad_notes = None, []
    with autocast_off():
        if fake:
            sides = _run_fake_cuda(model, args, kwargs, dtype, mode, config, build=build)
        else:
            sides = _run_real(model, args, kwargs, dtype, device_type, mode, config, amp=amp, build=build)
            if grads:
                grad_checks, grad_divergence, grad_notes = _check_grads(
                    model, sides.amp, args, kwargs, device_type, dtype, cache_enabled=spec.cache_enabled
                )
    graphamp_ops = op_signatures(sides.graphamp_graph)
    eager_ops = op_signatures(sides.eager_graph)
    scan = _scan(graphamp_ops, eager_ops)
    where = scan.dtype or scan.structure
    outputs, same_structure = _compare_outputs(sides.out, sides.ref, values=not fake)
    notes = list(sides.notes) + grad_notes
    if scan.dtype is None and scan.structure is not None and not fake:
        notes.append(
            f"{scan.structure_blocks} run(s) of ops appear on one side only (a composite decomposed "
            "differently, or another kernel chosen); the aligned ops agree, and the outputs decide"
        )
    return Report(
        model=type(model).__name__,
        device_type=device_type,
        dtype=short_dtype(dtype),
        mode=mode,
        values_compared=not fake,
        outputs=outputs,
        output_structure_match=same_structure,
        divergence=_divergence(where, graphamp_ops, eager_ops, sides.amp) if where is not None else None,
        structure_differences=scan.structure_blocks,
        ops={"graphamp": len(graphamp_ops), "eager": len(eager_ops), "matched": scan.matched},
        casts={"graphamp": _count_casts(sides.graphamp_graph), "eager": _count_casts(sides.eager_graph)},
        notes=tuple(notes),
        grads_compared=grads,
        grads=grad_checks,
        grad_divergence=grad_divergence,
    )
