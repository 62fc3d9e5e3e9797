"""``graphamp.verify``: check a conversion against eager autocast, output by output and op by op.

Two independent records are compared:

* **outputs**: the converted module and ``torch.autocast`` run on the same inputs; each output's
  dtype, bitwise equality, max abs and relative error and SQNR are reported;
* **ops**: both sides are lowered to post-dispatch ATen graphs with ``make_fx``, eager under
  autocast (so its casts are autocast's own) and the converted module with autocast off. The
  sequences of compute ops are aligned, and each op's signature (its name, the dtype history of
  every tensor input, its output dtypes) is compared, so the report names the *first divergent
  node* of the converted graph, with its module path and graphamp's reason for its dtype.

Casts and views are not compute ops: a cast shows up in the dtype history of the inputs it feeds
(``fp32->bf16``), so the comparison is modulo cast order (CUDA autocast casts right to left) and
modulo cast sharing, and exact round trips (``bf16->fp32->bf16``) count as no cast at all.

With ``device_type="cuda"`` on a machine without a GPU, both sides run on fake CUDA tensors: ops
and dtypes are compared, values are not (the report says so).
"""

from __future__ import annotations

import dataclasses

from typing import Any

import torch
from torch import nn

from graphamp.config import Config
from graphamp.capture.stacks import source_lines_read_lazily
from graphamp.convert import check_inputs
from graphamp.emit import AmpModule
from graphamp.policy import short_dtype
from graphamp.spec import AmpSpec, autocast_off
from graphamp.verify.report import Divergence, GradCheck, GradDivergence, OutputCheck, Report, _compare_outputs
from graphamp.verify.signatures import OpSignature, _divergence, _scan, first_divergence, op_signatures
from graphamp.verify.reference import _count_casts, _run_fake_cuda, _run_real, _uses_real_cuda
from graphamp.verify.grads import _check_grads


__all__ = ["verify", "Report", "OutputCheck", "GradCheck", "Divergence", "GradDivergence", "OpSignature", "op_signatures", "first_divergence"]


def verify(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    mode: str = "exact",
    config: Config | None = None,
    grads: bool = False,
    compile: bool = False,
) -> Report:
    """Convert ``model`` and check the result against eager ``torch.autocast`` on the same inputs.

    Arguments are those of :func:`graphamp.convert`. Both sides run with grad mode on, as in
    training (eager's fused inference fast paths under ``no_grad`` are not the reference), from
    the same random state. ``device_type="cuda"`` with a model on the CPU checks the CUDA policy
    on fake CUDA tensors, with no GPU: ops and dtypes are compared, values are not.

    ``grads=True`` also backpropagates a fixed loss (every float output weighted by
    ``linspace(-1, 1)``, summed in fp32) through both sides, from the same random state, and
    compares the gradient of every parameter that requires grad and of every floating input
    (each side gets its own leaf copy that requires grad). ``.grad`` fields are left untouched.
    When gradients differ, both sides run once more recording every op's output, and the
    report names the first node, walking back from the outputs, whose output gradient differs
    from eager's (``report.grad_divergence``). Gradients need real tensors: with fake CUDA
    (``device_type="cuda"`` without a GPU) ``grads=True`` raises ``ValueError``.

    ``compile=True`` also measures the compiled module's drift (``convert(..., compile=True)``, through
    inductor: not bitwise) from eager autocast on these inputs, outputs and, with ``grads``, gradients,
    in ``report.compiled_drift``; it does not change ``report.ok``, which is the exact conversion's.

    Returns:
        A :class:`Report`: per output dtype match, bitwise equality, max abs and relative error
        and SQNR; the first divergent node of the converted graph (op, dtype histories of its
        inputs on both sides, module path, graphamp's reason); cast counts on both sides; with
        ``grads=True``, per gradient the same errors, and the first divergent backward node.

    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
    ...     def forward(self, x):
    ...         return self.norm(self.proj(x))
    >>> model, x = nn.Sequential(Block()), torch.randn(4, 8)
    >>> assert verify(model, (x,), dtype=torch.float16).ok
    >>> wrong = Config(op_overrides={"layer_norm": "lower_precision_fp"})
    >>> report = verify(model, (x,), dtype=torch.float16, config=wrong)
    >>> assert not report.ok and (report.divergence.node, report.divergence.module_path) == ("layer_norm", "0.norm")
    >>> report = verify(model, (x,), grads=True)
    >>> assert report.ok and [g.name for g in report.grads][-2:] == ["0.norm.bias", "args[0]"]
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.verify")
    report = _verify(model, args, kwargs, dtype=dtype, device_type=device_type, mode=mode, config=config, grads=grads)
    if compile:
        from graphamp.compiled import measure_drift
        from graphamp.convert import convert

        cm = convert(model, args, kwargs, dtype=dtype, device_type=device_type, mode=mode, config=config, compile=True, self_check="off")
        drift = measure_drift(cm, model, args, kwargs, grads=grads) if getattr(cm, "runs_compiled", False) else getattr(cm, "drift", None)
        report = dataclasses.replace(report, compiled_drift=drift)
    return report


@source_lines_read_lazily()
def _verify(
    model: nn.Module, args: tuple, kwargs: dict, *, dtype: torch.dtype | str | None, device_type: str | None, mode: str,
    config: Config | None, grads: bool, amp: AmpModule | None = None,
) -> Report:
    """verify's body; ``amp``, a conversion of ``model`` already made (convert's self-check), is
    checked as it is instead of converting again."""
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
            sides = _run_fake_cuda(model, args, kwargs, dtype, mode, config)
        else:
            sides = _run_real(model, args, kwargs, dtype, device_type, mode, config, amp=amp)
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
