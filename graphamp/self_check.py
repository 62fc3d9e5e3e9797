"""Convert's own check: on the example, the converted module against eager autocast, bit for bit.

The passes follow autocast's tables, and every node's dtype is checked against what eager gave it
during capture; still, a capture can hold another program than eager runs (a model that branches
on ``torch.compiler.is_exporting()``, an op decomposed above the autocast key), and gradients can
round differently where values agree. So exact-mode ``convert`` runs the example once more on both
sides, from the same random state with buffers restored, and compares every output's value and
dtype and, where the conversion keeps a gradient path, every parameter's gradient of a fixed loss
(and the forward once more under ``no_grad``, where kernels may choose by ``requires_grad``).
A difference raises :class:`~graphamp.errors.PolicyDriftError` (or warns, on request) naming
what differs and the first divergent node that :func:`graphamp.verify` finds; it is never silent.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphamp.emit import SelfCheck
from graphamp.errors import CheckSkippedWarning, PolicyDriftError, PolicyDriftWarning
from graphamp.node_info import GraphInfo, innermost_module, peek_graph_info
from graphamp.eager import Outcome, autocast_call, difference, equal, fp32_interface, holds_values, outcome, same_start
from graphamp.spec import AmpSpec
from graphamp.backend.fallback import DynamoAmpModule
from graphamp.integrations.fsdp import self_check

__all__ = ["SELF_CHECKS", "check_against_eager", "check_self_check", "checker_for"]

# "raise": a difference raises PolicyDriftError; "warn": it warns PolicyDriftWarning and the module
# is returned; "off": no check (for users who convert in a loop and verify once).
SELF_CHECKS = ("raise", "warn", "off")


def check_self_check(self_check: object) -> str:
    if self_check is True:
        return "raise"
    if self_check is False or self_check is None:
        return "off"
    if not isinstance(self_check, str) or self_check not in SELF_CHECKS:
        raise ValueError(
            f"self_check={self_check!r} is not one of {SELF_CHECKS}: 'raise' (default) raises PolicyDriftError "
            "where the converted module differs from eager autocast on the example, 'warn' warns instead, "
            "'off' skips the check"
        )
    return self_check


def applies(spec: AmpSpec, model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Exact mode with autocast's own policy on real tensors: the only case that promises equality."""
    if not spec.check or spec.target != "module":
        return False
    return holds_values(model, args, kwargs)


def checker_for(amp: nn.Module) -> Callable[..., SelfCheck]:
    """:func:`check_against_eager`, or, for a module converted unit by unit on an FSDP2 model,
    :func:`graphamp.integrations.fsdp.self_check` (backward through FSDP, gradient shards compared)."""
    if (peek_graph_info(amp) or GraphInfo()).fsdp_units is not None:
        return self_check
    return check_against_eager


def check_against_eager(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, on_drift: str, diagnose: bool = True,
) -> SelfCheck:
    """Run the example through ``amp`` and through ``model`` under eager autocast; raise or warn on
    any difference (``on_drift``), and return what was compared.

    ``diagnose=False`` raises a difference (other than one under ``no_grad`` only, which warns as
    always) at once, without locating it: for a caller that tries other conversions first and
    checks again, diagnosing, only if none is exact (locating costs another run or a compile).
    """
    start = time.perf_counter()
    grads = not spec.inference and any(p.requires_grad for p in model.parameters())
    try:
        ref = outcome(lambda: autocast_call(model, args, kwargs, spec), model, grads=grads, no_grad=spec.inference, inputs=(args, kwargs))
    except Exception as e:  # the model itself cannot run eagerly here: nothing to compare against
        problem = f"not checked: eager autocast could not run the example ({type(e).__name__}: {str(e).strip()[:200]})"
        warnings.warn(f"graphamp.convert's self-check was skipped: {problem}", PolicyDriftWarning, stacklevel=3)
        return SelfCheck(ok=True, grads=False, seconds=time.perf_counter() - start, problem=problem)
    try:
        amp_args, amp_kwargs = fp32_interface((args, kwargs)) if spec.keep_io_types else (args, kwargs)
        got = outcome(lambda: amp(*amp_args, **amp_kwargs), model, grads=grads, no_grad=spec.inference, inputs=(amp_args, amp_kwargs))
    except Exception as e:
        raise PolicyDriftError(
            f"graphamp.convert's self-check: the converted {type(model).__name__} fails on the example that eager "
            f"autocast runs ({type(e).__name__}: {str(e).strip()[:300]}). This is a graphamp bug; please report it. "
            "Way out meanwhile: torch.compile(model, backend=\"graphamp\"), or eager torch.autocast."
        ) from e
    problem = difference(got, ref, keep_io_types=spec.keep_io_types)
    if not problem and not spec.inference:
        # Inference usually runs under no_grad, where kernels may choose by requires_grad
        # (matmul's fold): the forward is compared there too.
        try:
            ref = outcome(lambda: autocast_call(model, args, kwargs, spec), model, grads=False, no_grad=True, inputs=(args, kwargs))
        except Exception as e:  # eager itself fails without grad (nn.TransformerEncoder's nested tensors under autocast)
            ref = None
            skipped = CheckSkippedWarning(
                f"graphamp.convert's self-check: eager torch.autocast itself fails on the example under torch.no_grad "
                f"({type(e).__name__}: {str(e).strip()[:200]}), so the converted module, exact with grad, was not "
                "compared there. Under no_grad it runs the same graph; eager does not run at all."
            )
            skipped.reason = "error"
            warnings.warn(skipped, stacklevel=4)
        if ref is not None:
            got = outcome(lambda: amp(*amp_args, **amp_kwargs), model, grads=False, no_grad=True, inputs=(amp_args, amp_kwargs))
            problem = difference(got, ref, keep_io_types=spec.keep_io_types)
        if problem:
            # Exact with grad, which is what the graph holds; eager takes another path only without
            # grad (a fused inference kernel, or one that reads requires_grad): said, not refused.
            problem, on_drift = f"under torch.no_grad, {problem}", "warn"
    if not problem:
        return SelfCheck(ok=True, grads=grads, seconds=time.perf_counter() - start)
    no_grad_only = problem.startswith("under torch.no_grad")
    if not diagnose and not no_grad_only:
        unlocated = PolicyDriftError(
            f"graphamp.convert's self-check: the converted {type(model).__name__} differs from eager torch.autocast"
            f"({spec.device_type}, {spec.dtype}) on the example: {problem}."
        )
        unlocated.undiagnosed = True
        raise unlocated
    where, other_path = _first_divergence(
        amp, model, args, kwargs, spec, grads=grads and problem.startswith("gradient"), no_grad=no_grad_only
    )
    if no_grad_only:
        way_out = (
            "With grad enabled the module equals eager autocast; without grad eager takes another kernel path "
            "(a fused inference kernel such as nn.TransformerEncoder's, or a kernel that reads requires_grad). "
            "Way out: for inference under torch.no_grad, convert(..., inference=True), which follows eager's "
            "no_grad path; call this module with grad enabled otherwise."
        )
    elif verdict := _torch_compile_verdict(amp, got, ref, model, args, kwargs, spec, grads=grads):
        where = ""  # no node to locate: the sentence that says whose difference it is comes first
        way_out = _TORCH_COMPILE_OWN.format(
            verdict=verdict, refused=_first_sentence(str(amp.cast_summary().get("reason", ""))),
        )
    elif other_path and (dropped := _dropped_mask(amp, model, args, kwargs, spec)):
        way_out = dropped
    elif other_path:
        way_out = (
            "Some ops ran on one side only: the model's code takes another path when traced than in eager "
            "(it reads tensor values, checks for fake tensors or torch.compiler.is_compiling()), and no trace "
            "reproduces its eager program on this example (torch.compile takes the traced path too). Way out: "
            "eager torch.autocast for this model; or, if the difference is acceptable, convert(..., "
            "self_check='warn'), which returns the module anyway."
        )
    else:
        way_out = (
            "Way out: report it (it is a graphamp bug); meanwhile use eager torch.autocast for this model, or "
            "torch.compile(model, backend=\"graphamp\") and check it with graphamp.verify(model, args, grads=True); "
            "convert(..., self_check='warn') returns the module anyway."
        )
    message = (
        f"graphamp.convert's self-check: the converted {type(model).__name__} differs from eager torch.autocast"
        f"({spec.device_type}, {spec.dtype}) on the example: {problem}.{where} {way_out}"
    )
    result = SelfCheck(ok=False, grads=grads, seconds=time.perf_counter() - start, problem=problem)
    if on_drift == "raise":
        raise PolicyDriftError(message)
    warnings.warn(message, PolicyDriftWarning, stacklevel=3)
    return result


_TORCH_COMPILE_OWN = (
    "{verdict} (The usual cause: AOTAutograd differentiates each graph between graph breaks whole, so "
    "where a tensor's gradient gathers contributions from more than one graph, or from a graph and an "
    "output that returns the tensor itself, it sums them in another order than eager's autograd engine, "
    "in fp32 as under autocast.) Way out: let torch.export capture the model whole, so that convert needs "
    "no graph breaks (it refused: {refused}); or eager torch.autocast; convert(..., self_check='warn') "
    "returns the module anyway."
)
_PLAIN_COMPILE = "torch.compile without graphamp (backend=\"aot_eager\", under the same torch.autocast)"


def _first_sentence(reason: str) -> str:
    """What torch.export refused, without the way out its own message goes on with."""
    lines = reason.strip().splitlines()
    return (lines[0] if lines else "").split(". Way out:")[0][:200]


def _torch_compile_verdict(
    amp: nn.Module, got: Outcome, ref: Outcome, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, grads: bool
) -> str:
    """Whether plain torch.compile differs from eager as convert's dynamo fallback does, in words:
    bit for bit the same, or in every gradient the fallback differs in (and more); empty otherwise."""
    if not isinstance(amp, DynamoAmpModule):
        return ""
    compiled = torch.compile(model, backend="aot_eager")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = outcome(lambda: autocast_call(compiled, args, kwargs, spec), model, grads=grads, no_grad=spec.inference, inputs=(args, kwargs))
    except Exception:  # torch.compile alone cannot run it: no comparison, the generic message stands
        return ""
    if not difference(got, theirs, keep_io_types=False):
        what = "outputs and gradients" if grads else "outputs"
        return (
            f"{_PLAIN_COMPILE} gives bit for bit the same {what} as this module: the difference is "
            "torch.compile's own, not graphamp's casts."
        )
    ours, plain = _differing_grads(got, ref), _differing_grads(theirs, ref)
    if difference(got, Outcome(ref.outputs, {}), keep_io_types=False) or not ours or not ours <= plain:
        return ""
    return (
        f"{_PLAIN_COMPILE} differs from eager autocast in every gradient this module differs in ({len(ours)} "
        f"parameter(s){f', and in {len(plain - ours)} more where this module follows eager' if plain - ours else ''}): "
        "the difference is most likely torch.compile's own, not graphamp's casts."
    )


def _differing_grads(side: Outcome, ref: Outcome) -> set[str]:
    """The parameters whose gradient on ``side`` is not bitwise eager's."""
    return {
        name for name, want in ref.grads.items()
        if (side.grads.get(name) is None) != (want is None) or (want is not None and not equal(side.grads[name], want))
    }


def _dropped_mask(amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> str:
    """Where eager called SDPA without the mask the graph passes (the model's code dropped it by its
    value, as transformers' masking utilities drop an all-ones mask), that call and the way out, in
    words; empty otherwise."""
    if not isinstance(amp, torch.fx.GraphModule):
        return ""
    nodes = list(amp.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default))
    eager = _eager_sdpa_masks(model, args, kwargs, spec)
    if eager is None or len(eager) != len(nodes):
        return ""
    for node, (masked, causal) in zip(nodes, eager):
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if masked or mask is None:
            continue
        path = (innermost_module(node) or ("",))[0]
        where = f"module {path}" if path else "the model's own forward"
        semantics = (
            "and without is_causal, so eager attends to every position there while the mask says otherwise"
            if not causal else "and with is_causal=True"
        )
        return (
            f"Eager called scaled_dot_product_attention in {where} with no mask, {semantics}; the converted "
            "graph applies the mask it was given. The model's code dropped the mask by its value "
            "(transformers' masking utilities drop an all-ones mask in eager, and build it under any "
            "trace), so no graph follows eager for every mask. Way out: eager torch.autocast for this "
            "model; convert(..., self_check='warn') returns the module anyway, applying the mask as given."
        )
    return ""


def _eager_sdpa_masks(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> list[tuple[bool, bool]] | None:
    """(mask given, is_causal) of each SDPA call eager autocast makes on the example; None if it fails."""
    from torch.overrides import TorchFunctionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[bool, bool]] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, a: tuple = (), k: dict | None = None) -> Any:
            k = k or {}
            if func is sdpa:
                mask = a[3] if len(a) > 3 else k.get("attn_mask")
                causal = a[5] if len(a) > 5 else k.get("is_causal", False)
                calls.append((mask is not None, bool(causal)))
            return func(*a, **k)

    try:
        with same_start(model), torch.no_grad(), Record():
            autocast_call(model, args, kwargs, spec)
    except Exception:  # naming the call is a courtesy; the difference is already established
        return None
    return calls


def _first_divergence(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, grads: bool, no_grad: bool = False
) -> tuple[str, bool]:
    """verify's first divergent node of this very conversion, as a sentence, and whether ops ran
    on one side only (the capture took another path than eager)."""
    from graphamp.verify.check import check  # verify imports the engine, which imports this module

    if no_grad:  # verify runs both sides with grad, where they agree: it has nothing to locate
        return "", False
    if not isinstance(amp, torch.fx.GraphModule):  # convert's dynamo fallback: graphs between graph breaks
        return (
            " (graphamp.verify locates nodes in one graph; this module is convert's dynamo fallback, the model "
            "under torch.compile(backend=\"graphamp\") with graph breaks, whose Python between graphs runs eagerly)"
        ), False

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = check(
                model, args, kwargs, dtype=spec.dtype, device_type=spec.device_type, mode=spec.mode, config=spec.config,
                grads=grads, amp=amp,
            )
    except Exception as e:  # locating is a courtesy; the difference itself is already established
        return f" (graphamp.verify could not locate the first divergent node: {type(e).__name__}: {str(e).strip()[:150]})", False
    one_side = [n for n in report.notes if "only in graphamp" in n or "on one side only" in n]
    other_path = report.structure_differences > 0 or bool(one_side)
    extra = f" ({one_side[0]})" if one_side else ""
    if report.divergence is not None:
        return f" First divergent node: {report.divergence.describe()}{extra}.", other_path
    if report.grad_divergence is not None:
        return f" First divergent backward node: {report.grad_divergence.describe()}{extra}.", other_path
    return f" graphamp.verify finds no op whose dtypes differ: the capture holds another program than eager runs{extra}.", True
