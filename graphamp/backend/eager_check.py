"""Check a rewritten graph that holds a whole frame against eager autocast on the call compiling it.

``graphamp.convert`` checks its module against eager autocast on the example (graphamp.self_check).
The backend has the frame dynamo compiles and the call's own arguments
(:func:`graphamp.backend.observe.compiled_frame`), so where dynamo's graph holds the whole frame
(no graph break) it does the same: the frame runs eagerly under autocast, the rewritten graph runs
on the same inputs, and each tensor the frame returns must be among the graph's outputs, equal in
value and dtype. Model code that picks another program when traced than in eager (transformers
drops an all-ones attention mask in eager and builds it when compiling, and some models then attend
otherwise) differs here, and is an ``EagerPathWarning`` rather than a silent difference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.backend.observe import EagerRun, Frame, frame_name
from graphamp.eager import rng_kept
from graphamp.errors import EagerPathWarning
from graphamp.spec import autocast_off

__all__ = ["check_outputs", "unmatched_outputs"]

# Ops whose results depend on the random state: two programs draw alike only if they call them
# alike, so a graph that draws is not compared (a difference there says nothing about dtypes).
_RANDOM = ("bernoulli", "rand", "normal", "multinomial", "uniform", "exponential", "geometric", "cauchy", "log_normal")


def _draws(gm: GraphModule) -> bool:
    """Whether the graph calls an op that draws random numbers (dropout in training included)."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if any(r in name for r in _RANDOM) or ("dropout" in name and _training_dropout(node)):
            return True
    return False


def _training_dropout(node: Any) -> bool:
    """Whether a dropout node drops: in training and with p > 0."""
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return bool(train) and p != 0


def _hint(x: Any) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.hint  # None where the size has no value to hand (unbacked)
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def unmatched_outputs(result: Any, graph_outputs: Sequence[Any], inputs: Sequence[Any]) -> list[tuple[int, torch.Tensor]]:
    """The tensors of ``result`` (with their index among its tensors) equal to no graph output and
    to no input.

    >>> a, b = torch.ones(2), torch.zeros(2)
    >>> unmatched_outputs({"x": a, "y": b.clone()}, [b], [])
    [(0, tensor([1., 1.]))]
    """
    tensors = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    outs = [t for t in pytree.tree_leaves(list(graph_outputs)) if isinstance(t, torch.Tensor)]
    ins = [t for t in inputs if isinstance(t, torch.Tensor)]
    return [(i, t) for i, t in enumerate(tensors) if not any(_same(t, o) for o in outs) and not any(_same(t, x) for x in ins)]


def _closest(t: torch.Tensor, outs: list[torch.Tensor]) -> str:
    alike = [o for o in outs if o.shape == t.shape]
    if not alike:
        return "no graph output has its shape"
    o = min(alike, key=lambda o: (o.dtype != t.dtype, (o.double() - t.double()).abs().max().item()))
    if o.dtype != t.dtype:
        return f"the closest graph output is {o.dtype} where eager autocast gives {t.dtype}"
    return f"the closest graph output differs by up to {(o.double() - t.double()).abs().max().item():.3g}"


def check_outputs(
    run: Callable[..., Any], example_inputs: Sequence[Any], frame: Frame | None, eager: EagerRun | None, *, graph: GraphModule,
) -> bool:
    """Warn (EagerPathWarning) if ``run`` (the rewritten ``graph``, or its compiled code), holding
    the whole of ``frame``, gives other values or dtypes than the frame's eager autocast run on
    this call. Returns whether it compared."""
    if frame is None or eager is None or _draws(graph):
        return False
    # The graph may update buffers in place (batch-norm statistics): it runs on copies of them.
    inputs = [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) else x for x in example_inputs]
    # A dynamic size arrives as a SymInt of dynamo's shape environment: computing with it here would
    # add guards (and specialize the graph); its value on this call is its hint.
    inputs = [_hint(x) for x in inputs]
    if any(x is None for x in inputs):
        return False
    try:
        with autocast_off(), torch.no_grad(), rng_kept(seed=0):
            outs = run(*inputs)
    except Exception:  # the check is advisory: a graph that cannot run eagerly here is not judged
        return False
    # What the frame returns as it received it (a value a resume function passes through) is no graph's.
    passed = [*example_inputs, *pytree.tree_leaves((frame.args, frame.kwargs))]
    missing = unmatched_outputs(eager.result, outs if isinstance(outs, (list, tuple)) else [outs], passed)
    if missing:
        i, t = missing[0]
        flat = [o for o in pytree.tree_leaves(list(outs) if isinstance(outs, (list, tuple)) else [outs]) if isinstance(o, torch.Tensor)]
        warnings.warn(
            f"{frame_name(frame)}: on the call it was compiled for, {len(missing)} of the tensors it returns differ "
            f"from eager torch.autocast's: tensor #{i} ({tuple(t.shape)}, {t.dtype}): {_closest(t, flat)}. The model's "
            "Python takes another program when traced than in eager (transformers, for one, drops an all-ones "
            "attention mask in eager and builds it when compiling). Way out: graphamp.verify(model, args) names "
            "the first divergent node where graphamp.convert can capture the model; or run this model under eager "
            "torch.autocast.",
            EagerPathWarning,
            stacklevel=3,
        )
    return True
