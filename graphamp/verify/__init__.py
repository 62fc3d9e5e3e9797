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
from graphamp.convert import check_inputs
from graphamp.pipeline import build
from graphamp.verify.report import Divergence, GradCheck, GradDivergence, OutputCheck, Report
from graphamp.verify.signatures import OpSignature, first_divergence, op_signatures
from graphamp.verify.check import check
from graphamp.compiled import measure_drift
from graphamp.convert import convert


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
    report = check(model, args, kwargs, dtype=dtype, device_type=device_type, mode=mode, config=config, grads=grads, build=build)
    if compile:
        cm = convert(model, args, kwargs, dtype=dtype, device_type=device_type, mode=mode, config=config, compile=True, self_check="off")
        drift = measure_drift(cm, model, args, kwargs, grads=grads) if getattr(cm, "runs_compiled", False) else getattr(cm, "drift", None)
        report = dataclasses.replace(report, compiled_drift=drift)
    return report
