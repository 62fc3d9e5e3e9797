"""Check a rewritten graph that holds a whole frame against eager autocast on the call compiling it.

``graphamp.convert`` checks its module against eager autocast on the example (graphamp.self_check).
The backend has the frame dynamo compiles and the call's own arguments
(:func:`graphamp.backend.observe.compiled_frame`), so where dynamo's graph holds the whole frame
(no graph break) it does the same: the frame runs eagerly under autocast, the rewritten graph runs
on the same inputs, and each graph output the frame returns is compared with the value eager
autocast returns in its place (:func:`graphamp.backend.observe.returned_outputs` pairs them), by
position: equal values (NaN where both are NaN) and dtypes. In training (grad enabled and an input
or parameter requiring grad), both sides then run once more with grad from the same state and
backpropagate the same fixed loss of the paired outputs, and the gradients of the graph's inputs
(the model's parameters among them) are compared too.

Model code that picks another program when traced than in eager (transformers drops an all-ones
attention mask in eager and builds it when compiling, and some models then attend otherwise)
differs here, and is an ``EagerPathWarning`` rather than a silent difference. Where the check
cannot run (the graph holds part of a frame, draws random numbers, or a run raises), it says so
once per frame and reason with a ``CheckSkippedWarning``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.backend.eager_dtypes import _ends_at_graph_break
from graphamp.backend.observe import (
    EagerRun, Frame, _modules_reached, eager_backward, frame_name, returned_outputs, under_dynamo,
)
from graphamp.eager import fixed_loss, rng_kept
from graphamp.errors import CheckSkippedWarning, EagerPathWarning
from graphamp.spec import autocast_off

__all__ = ["Where", "check_outputs", "flat_pairs", "matches_eager", "output_difference", "say_skipped"]

# Ops whose results depend on the random state: two programs draw alike only if they call them
# alike, so a graph that draws is not compared (a difference there says nothing about dtypes).
_RANDOM = ("bernoulli", "rand", "normal", "multinomial", "uniform", "exponential", "geometric", "cauchy", "log_normal")

_WAY_OUT = (
    "Way out: graphamp.verify(model, args) compares the model with eager autocast op by op, and "
    "graphamp.convert(model, args) checks the module it returns against eager autocast itself."
)

# (reason, frame) pairs already said: a frame recompiled (new shapes, a second graph after the same
# break) is not said again.
_said: set[tuple[str, str]] = set()


def _draws(gm: GraphModule) -> list[str]:
    """The ops of the graph that draw random numbers (dropout in training included)."""
    found = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if any(r in name for r in _RANDOM) or ("dropout" in name and _training_dropout(node)):
            found.append(name.split(".")[0])
    return sorted(set(found))


def _training_dropout(node: Any) -> bool:
    """Whether a dropout node drops: in training and with p > 0."""
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return bool(train) and p != 0


def _hint(x: Any) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.hint  # None where the size has no value to hand (unbacked)
    return x


def say_skipped(name: str, reason: str, message: str, frame: Frame | None = None) -> None:
    """Say once per frame and reason that (part of) the check did not run."""
    key = (reason, _frame_key(frame) if frame is not None else name)
    if key in _said:
        return
    _said.add(key)
    warning = CheckSkippedWarning(f"{name}: {message} {_WAY_OUT}")
    warning.reason = reason
    warnings.warn(warning, stacklevel=4)


def _frame_key(frame: Frame) -> str:
    """The frame's model class (or function), with its module: the same for the resume functions
    dynamo makes of it after a graph break, other for a class of the same name elsewhere."""
    modules = _modules_reached(frame)
    owner = type(modules[0]) if modules else frame.fn
    return f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', frame.fn.__qualname__)}"


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}".rstrip(": ")


class Where(NamedTuple):
    """A place in the frame's return value: a pytree key path, or (where the value's types give no
    key paths) the index of a leaf."""

    path: tuple[Any, ...] | None
    leaf: int = -1

    def get(self, result: Any) -> Any:
        if self.path is None:
            return pytree.tree_leaves(result)[self.leaf]
        for key in self.path:
            result = key.get(result)
        return result

    def __str__(self) -> str:
        return f"output leaf {self.leaf}" if self.path is None else "output" + pytree.keystr(self.path)


class _Unpaired(Exception):
    """The graph's outputs cannot be paired with the frame's return value."""


def flat_pairs(result: Any, graph_outputs: Sequence[Any], received: Sequence[Any]) -> list[tuple[int, Where]]:
    """Pair the graph's tensor outputs with the tensors of ``result`` in order, where dynamo's tracer
    does not say where each output is returned: the result's tensors, in pytree order, without those
    it received (``received``: returned as they came, no graph's) and without repeats, must be as many
    as the graph's tensor outputs, each of the same shape as its pair. Raises _Unpaired otherwise.

    >>> a, b, x = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    >>> [(j, str(w)) for j, w in flat_pairs({"x": x, "y": (a, b, a)}, [a, b], [x])]
    [(0, "output['y'][0]"), (1, "output['y'][1]")]
    """
    try:
        leaves: list[tuple[Any, Any]] = [(tuple(path), leaf) for path, leaf in pytree.tree_flatten_with_path(result)[0]]
    except ValueError:  # a registered type without key paths (diffusers' output classes)
        leaves = [(None, leaf) for leaf in pytree.tree_leaves(result)]
    seen = {id(t) for t in received if isinstance(t, torch.Tensor)}
    mine = []
    for i, (path, leaf) in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            mine.append(Where(path, i))
    tensors = [j for j, o in enumerate(graph_outputs) if isinstance(o, torch.Tensor)]
    if len(mine) != len(tensors):
        raise _Unpaired(f"the frame returns {len(mine)} tensors it computes and the graph has {len(tensors)} tensor outputs")
    for j, where in zip(tensors, mine):
        if graph_outputs[j].shape != where.get(result).shape:  # in order they do not pair: say so, not a difference
            raise _Unpaired(f"in order, graph output #{j} has shape {tuple(graph_outputs[j].shape)} and the frame's {where} {tuple(where.get(result).shape)}")
    return list(zip(tensors, mine))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> str:
    if not (a.is_floating_point() or a.is_complex()) and not (b.is_floating_point() or b.is_complex()):
        return f"{int((a.long() - b.long().to(a.device)).abs().max())}" if a.numel() else "0"
    if not a.numel():
        return "0"
    d = (a.double() - b.double().to(a.device)).abs()
    both_nan = a.isnan() & b.to(a.device).isnan()
    return f"{float(d.masked_fill(both_nan, 0).nan_to_num(float('inf')).max()):.3g}"


def output_difference(a: Any, b: Any) -> str:
    """How ``a`` (the graph's) differs from ``b`` (eager autocast's), in words; empty if equal in
    value (NaN where both are NaN), dtype and shape.

    >>> output_difference(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    ''
    >>> output_difference(torch.ones(2), torch.ones(2, dtype=torch.bfloat16))
    'torch.float32 where eager autocast gives torch.bfloat16 (max abs difference 0)'
    """
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"a {type(a).__name__} where eager autocast gives a {type(b).__name__}"
    if not isinstance(a, torch.Tensor):
        return "" if a == b or (a != a and b != b) else f"{a!r} where eager autocast gives {b!r}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} ({a.dtype}) where eager autocast gives {tuple(b.shape)} ({b.dtype})"
    if a.dtype != b.dtype:
        return f"{a.dtype} where eager autocast gives {b.dtype} (max abs difference {_max_abs(a, b)})"
    b = b.to(a.device)
    if torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())):
        return ""
    return f"{a.dtype} as eager autocast's, max abs difference {_max_abs(a, b)}"


def _flat(outs: Any) -> list[Any]:
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def check_outputs(
    run: Callable[..., Any],
    example_inputs: Sequence[Any],
    frame: Frame | None,
    eager: EagerRun | None,
    *,
    graph: GraphModule,
    traced: GraphModule | None = None,
    device_type: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    cache_enabled: bool = True,
    grads: bool = False,
) -> bool:
    """Warn (EagerPathWarning) if ``run`` (the rewritten ``graph``, or its compiled code) gives
    other values or dtypes than the frame's eager autocast run on this call, output by output; with
    ``grads`` (training), also if the gradients of one backward differ. ``traced`` is dynamo's graph
    (its outputs, and whether it ends at a graph break). Where it cannot check, it says so once
    (CheckSkippedWarning). Returns whether it compared."""
    name = frame_name(frame) if frame is not None else "the frame dynamo compiles"
    if traced is not None and _ends_at_graph_break(traced):
        say_skipped(name, "graph_break", frame=frame, message=(
            "dynamo broke it into several graphs, and this graph holds only its part up to the break, whose "
            "values the frame does not return: that part was not compared with eager autocast (a graph that "
            "holds the rest of a frame is)."
        ))
        return False
    if frame is None:
        if under_dynamo():
            say_skipped(name, "no_frame", (
                "the backend could not rebuild the frame dynamo compiles from torch's tracer (private to "
                "torch), so the compiled graph was not compared with eager autocast."
            ))
        return False
    if eager is None and not _draws(graph):
        say_skipped(name, "error", frame=frame, message=f"eager autocast could not run the frame here ({_eager_failure(frame, device_type, dtype, cache_enabled)}), so the compiled graph was not compared with it.")
        return False
    try:
        pairs, differences, unread = _compare(run, example_inputs, frame, eager, graph=graph, traced=traced)
    except _CannotCompare as e:
        say_skipped(name, e.reason, frame=frame, message=e.message)
        return False
    if not pairs:
        return False
    if differences:
        _warn_outputs(name, differences, len(pairs), "")
        return True
    if unread:
        say_skipped(name, "unread", frame=frame, message=(
            f"the {len(pairs)} tensor{'s' if len(pairs) != 1 else ''} it returns where the backend can locate them equal eager autocast's, but those "
            f"it returns inside {_types(unread)}, whose contents the backend cannot locate, were not compared."
        ))
    if grads:
        _check_gradients(name, run, example_inputs, frame, pairs, device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
    return True


class _CannotCompare(Exception):
    """The comparison cannot be made: ``reason`` (CheckSkippedWarning's) and ``message`` say why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def _compare(
    run: Callable[..., Any], example_inputs: Sequence[Any], frame: Frame, eager: EagerRun | None, *,
    graph: GraphModule, traced: GraphModule | None,
) -> tuple[list[tuple[int, Where]], list[tuple[int, Where, str]], tuple[str, ...]]:
    """Run ``run`` on the call's inputs and pair its outputs with eager autocast's result: the
    pairs, their differences, and the types of returned objects whose outputs could not be paired
    (not compared). Raises _CannotCompare where it cannot compare any."""
    drawn = _draws(graph)
    if drawn:
        raise _CannotCompare("random", (
            f"the graph draws random numbers ({', '.join(drawn)}), as dropout does in training, and eager autocast "
            "and the compiled graph do not draw alike, so its outputs and gradients were not compared with eager "
            "autocast's. Check it in eval mode (model.eval() turns dropout off)."
        ))
    if eager is None:
        raise _CannotCompare("error", "eager autocast could not run the frame here, so the compiled graph was not compared with it.")
    # The graph may update buffers in place (batch-norm statistics): it runs on copies of them.
    inputs = [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) else x for x in example_inputs]
    # A dynamic size arrives as a SymInt of dynamo's shape environment: computing with it here would
    # add guards (and specialize the graph); its value on this call is its hint.
    inputs = [_hint(x) for x in inputs]
    if any(x is None for x in inputs):
        raise _CannotCompare("error", "a size of this call has no value to run with (an unbacked symbolic size), so the compiled graph was not compared with eager autocast.")
    try:
        with autocast_off(), torch.no_grad(), rng_kept(seed=0):
            outs = _flat(run(*inputs))
    except Exception as e:  # the check is advisory: said, not raised
        raise _CannotCompare("error", f"the compiled graph raised when the check ran it ({_error(e)}), so it was not compared with eager autocast.") from e
    # What the frame returns as it received it (a value a resume function passes through) is no graph's.
    received = [*example_inputs, *pytree.tree_leaves((frame.args, frame.kwargs))]
    received += [t for m in _modules_reached(frame) for t in (*m.parameters(), *m.buffers())]
    try:
        pairs, unread = _pairs(traced, eager.result, outs, received)
    except _Unpaired as e:
        raise _CannotCompare("unpaired", f"the backend could not pair the graph's outputs with the value the frame returns ({e}), so they were not compared with eager autocast's.") from e
    if not pairs and any(isinstance(o, torch.Tensor) for o in outs):
        if unread:
            raise _CannotCompare("unpaired", f"the frame returns the graph's outputs inside {_types(unread)}, whose contents the backend cannot locate, so they were not compared with eager autocast's.")
        raise _CannotCompare("unpaired", "the frame returns none of the graph's outputs (it stores them elsewhere), so they were not compared with eager autocast's.")
    return pairs, _differences(outs, eager.result, pairs), unread


def _types(names: Sequence[str]) -> str:
    return " and ".join(f"a {n}" for n in names)


def matches_eager(
    run: Callable[..., Any], example_inputs: Sequence[Any], frame: Frame | None, eager: EagerRun | None, *,
    graph: GraphModule, traced: GraphModule | None = None,
) -> bool:
    """Whether ``run`` (the rewritten ``graph``) gives eager autocast's outputs on this call, value
    and dtype, silently: False where that cannot be shown."""
    if frame is None or (traced is not None and _ends_at_graph_break(traced)):
        return False
    try:
        pairs, differences, unread = _compare(run, example_inputs, frame, eager, graph=graph, traced=traced)
    except _CannotCompare:
        return False
    return bool(pairs) and not differences and not unread


def _pairs(traced: GraphModule | None, result: Any, outs: list[Any], received: list[Any]) -> tuple[list[tuple[int, Where]], tuple[str, ...]]:
    """The (graph output, place in the frame's return value) pairs, and the types of the objects in
    it whose tensors could not be placed (their outputs are not compared)."""
    returned = returned_outputs(traced) if traced is not None else None
    if returned is None:
        return flat_pairs(result, outs, received), ()
    expected = traced.graph.output_node().args[0]
    if len(_flat(expected)) != len(outs):
        raise _Unpaired(f"dynamo's graph has {len(_flat(expected))} outputs and the rewritten graph {len(outs)}")
    if returned.unread:
        try:  # the result's pytree may list what the tracer did not (a registered output class)
            return flat_pairs(result, outs, received), ()
        except _Unpaired:
            pass
    return [(j, Where(returned.paths[j])) for j in sorted(returned.paths)], returned.unread


def _differences(outs: list[Any], result: Any, pairs: list[tuple[int, Where]]) -> list[tuple[int, Where, str]]:
    found = []
    for j, where in pairs:
        try:
            want = where.get(result)
        except Exception:
            found.append((j, where, "a value where eager autocast returns none"))
            continue
        problem = output_difference(_detached(outs[j]), want)
        if problem:
            found.append((j, where, problem))
    return found


def _warn_outputs(name: str, differences: list[tuple[int, Where, str]], compared: int, when: str) -> None:
    j, where, problem = differences[0]
    warnings.warn(
        f"{name}: on the call it was compiled for{when}, {len(differences)} of the tensors it returns differ from "
        f"eager torch.autocast's, compared by position ({compared} compared): graph output #{j} (the frame's "
        f"{where}) is {problem}. The model's Python takes another program when traced than in eager "
        "(transformers, for one, drops an all-ones attention mask in eager and builds it when compiling). "
        "Way out: graphamp.verify(model, args) names the first divergent node where graphamp.convert can "
        "capture the model; or run this model under eager torch.autocast.",
        EagerPathWarning,
        stacklevel=4,
    )


def _eager_failure(frame: Frame, device_type: str, dtype: torch.dtype, cache_enabled: bool) -> str:
    """Why the frame's eager run failed at compile time, in words (it runs once more to say)."""
    try:
        eager_backward(frame, {}, [], lambda r: torch.zeros(()), device_type=device_type, dtype=dtype, cache_enabled=cache_enabled)
    except Exception as e:
        return _error(e)
    return "it raised on its first run"


@contextlib.contextmanager
def _backward_compile_metrics() -> Iterator[None]:
    """Dynamo's compile metrics kept apart while the check backpropagates through AOTAutograd's code:
    its backward compiles on first use, and records metrics dynamo's compile of the forward has set."""
    try:
        from torch._dynamo import utils
        from torch._dynamo.metrics_context import MetricsContext

        tls = utils._metrics_context_tls
        saved = utils.get_metrics_context()
        tls.metrics_context = MetricsContext(on_exit=lambda *args: None)
    except Exception:  # private to torch: the backward records where it would
        yield
        return
    try:
        yield
    finally:
        tls.metrics_context = saved


def _check_gradients(
    name: str, run: Callable[..., Any], example_inputs: Sequence[Any], frame: Frame, pairs: list[tuple[int, Where]], *,
    device_type: str, dtype: torch.dtype, cache_enabled: bool,
) -> None:
    """Backpropagate the same fixed loss of the paired outputs through the graph and through the
    frame under eager autocast, from the same state, and compare the gradients of the graph's inputs
    that require grad (its parameters, and the frame's tensor arguments that require grad)."""
    targets = [k for k, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not targets:
        return
    arguments = {id(t) for t in pytree.tree_leaves((frame.args, frame.kwargs)) if isinstance(t, torch.Tensor)}
    graph_inputs = [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) and not x.requires_grad else x for x in example_inputs]
    graph_inputs = [_hint(x) for x in graph_inputs]
    substitutes: dict[int, torch.Tensor] = {}
    for k in targets:
        x = example_inputs[k]
        if x.is_leaf:
            continue  # a parameter, or an input tensor that requires grad: both sides take it as it is
        if id(x) not in arguments:
            say_skipped(name, "gradients", frame=frame, message=(
                f"its outputs equal eager autocast's, but the gradients were not compared: graph input #{k} is a "
                "tensor with autograd history that the frame reaches other than through its arguments, so the "
                "two backward passes would not start from the same leaves."
            ))
            return
        # An argument with history (a resume function's input, computed by the graph before the
        # break): both sides take a detached copy, so neither backward reaches the earlier graph.
        substitutes[id(x)] = x.detach().clone().requires_grad_(True)
        graph_inputs[k] = x.detach().clone().requires_grad_(True)
    eager_targets = [substitutes.get(id(example_inputs[k]), example_inputs[k]) for k in targets]
    graph_targets = [graph_inputs[k] for k in targets]
    try:
        with autocast_off(), torch.enable_grad(), rng_kept(seed=0), _backward_compile_metrics():
            got = _flat(run(*graph_inputs))
            total = fixed_loss([got[j] for j, _ in pairs])
            got_grads = (
                list(torch.autograd.grad(total, graph_targets, allow_unused=True))
                if total.requires_grad else None
            )
        got = [_detached(o) for o in got]
    except Exception as e:
        say_skipped(name, "gradients", frame=frame, message=f"its outputs equal eager autocast's, but the gradients were not compared: the compiled graph's backward raised ({_error(e)}).")
        return
    try:
        result, want_grads = eager_backward(
            frame, substitutes, eager_targets, lambda r: fixed_loss([w.get(r) for _, w in pairs]),
            device_type=device_type, dtype=dtype, cache_enabled=cache_enabled,
        )
    except Exception as e:
        say_skipped(name, "gradients", frame=frame, message=f"its outputs equal eager autocast's, but the gradients were not compared: eager autocast's backward raised ({_error(e)}).")
        return
    differences = _differences(got, result, pairs)
    if differences:
        _warn_outputs(name, differences, len(pairs), " (with grad enabled)")
        return
    if got_grads is None and all(g is None for g in want_grads):
        return  # no output carries a gradient on either side: nothing to compare
    names: dict[int, str] = {}
    for module in _modules_reached(frame):
        for n, p in module.named_parameters():
            names.setdefault(id(p), n)
    diffs = []
    for i, k in enumerate(targets):
        have = None if got_grads is None else got_grads[i]
        want = want_grads[i]
        label = names.get(id(example_inputs[k]), f"graph input #{k}")
        if (have is None) != (want is None):
            diffs.append((label, f"{'missing' if have is None else 'present'} where eager autocast's is {'present' if want is not None else 'missing'}"))
            continue
        if have is not None:
            problem = output_difference(have, want)
            if problem:
                diffs.append((label, problem))
    if diffs:
        label, problem = diffs[0]
        warnings.warn(
            f"{name}: on the call it was compiled for, its outputs equal eager torch.autocast's but the gradients "
            f"of one backward (the same fixed loss of the outputs on both sides) differ for {len(diffs)} of "
            f"{len(targets)} tensors: the gradient of {label} is {problem}. A known cause: AOTAutograd (inner=\"eager\" "
            "in training) decomposes a few ops otherwise than eager's kernels (bilinear interpolate, nn.LSTM). Way out: "
            "graphamp.verify(model, args) names the first divergent node, graphamp.convert(model, args) or "
            "graphamp.TrainStep checks its gradients against eager autocast itself; or train this model under "
            "eager torch.autocast.",
            EagerPathWarning,
            stacklevel=4,
        )
