"""Follow eager where its Python dropped an attention mask by value: two programs, chosen per call.

transformers drops a padding mask of all ones in eager and calls SDPA without a mask (and, for
some models, then attends otherwise: PaliGemma bidirectionally, AIMv2's text tower without its
causal mask); traced, it skips that value check and builds the mask, so dynamo's graph holds the
masked program. Eager autocast is the reference, and which program eager runs depends on the
mask's values, which no graph guard can express. So where the eager run of the frame (no grad,
autocast on, the compiling flags off: :mod:`graphamp.backend.observe`) called SDPA without a mask
where dynamo's graph passes one computed from an input, the backend compiles two programs:

* eager's on the example: the graph with those masks dropped and ``is_causal`` as eager passed it;
* dynamo's: the graph as traced, which is eager's where the mask is kept (padding).

Each call first computes the graph's masks (a small graph of the mask's ops alone) and runs
eager's program where every such mask has the pattern it had on the example (every position
attends, or causal), dynamo's otherwise. That stands for eager's own test (the padding mask is all
ones) as long as the sizes decide the rest of the mask, as they do in transformers' mask functions.
A call whose masks cannot be computed runs dynamo's program, with an ``EagerPathWarning`` once.

Eager attention (``scores + mask``, then softmax) drops the mask the same way, and there no call
records it: adding the fp32 zero mask only promotes the low-precision scores to fp32, so dynamo's
program returns fp32 attention weights where eager's returns bf16. :func:`split_dropped_adds` finds
the adds of a mask computed from the call's inputs alone (no parameter) that is zero on the example;
the backend splits there only where dynamo's program differs from eager autocast on the example and
the program without those adds gives eager's outputs exactly.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from graphamp.backend.observe import Frame, eager_frame_sdpa_calls
from graphamp.errors import EagerPathWarning
from graphamp.passes.graph_edit import ancestors, input_dependent
from graphamp.probe import SdpaCall
from graphamp.spec import autocast_off

__all__ = ["MaskPattern", "Split", "added_masks", "dispatch", "eager_sdpa_calls_for", "sdpa_nodes", "split_dropped_adds", "split_dropped_masks"]

_TORCH_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
# F.scaled_dot_product_attention's arguments after (query, key, value), in order.
_SDPA_OPTIONAL = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_nodes(gm: GraphModule) -> list[Node]:
    """Dynamo's (torch-level) SDPA calls, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _TORCH_SDPA]


def _mask(node: Node) -> Any:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def eager_sdpa_calls_for(gm: GraphModule, frame: Frame | None, *, device_type: str, dtype: torch.dtype) -> list[SdpaCall] | None:
    """The frame's eager SDPA calls, where one of the graph's SDPA calls takes a mask computed from
    an input (else None: the frame is not run)."""
    if frame is None or not any(input_dependent(_mask(n)) for n in sdpa_nodes(gm)):
        return None
    return eager_frame_sdpa_calls(frame, device_type=device_type, dtype=dtype)


def _attends(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0


class MaskPattern(NamedTuple):
    """What a mask looked like on the example: every position attends ("all"), causal ("causal"),
    or anything else ("values": then only the same mask, position for position, matches).

    >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()
    >>> p = MaskPattern.of(causal[None, None])
    >>> p.kind, p.matches(torch.ones(4, 4, dtype=torch.bool).tril()), p.matches(torch.ones(3, 3, dtype=torch.bool))
    ('causal', True, False)
    >>> MaskPattern.of(torch.zeros(2, 1, 3, 3)).matches(torch.tensor([[0.0, float("-inf")]]))
    False
    """

    kind: str
    attends: torch.Tensor | None = None

    @staticmethod
    def of(mask: torch.Tensor) -> MaskPattern:
        attends = _attends(mask)
        if bool(attends.all()):
            return MaskPattern("all")
        if torch.equal(attends, _causal(attends)):
            return MaskPattern("causal")
        return MaskPattern("values", attends.clone())

    def matches(self, mask: torch.Tensor) -> bool:
        attends = _attends(mask)
        if self.kind == "all":
            return bool(attends.all())
        if self.kind == "causal":
            return torch.equal(attends, _causal(attends))
        return attends.shape == self.attends.shape and torch.equal(attends, self.attends)


def _causal(attends: torch.Tensor) -> torch.Tensor:
    q, k = attends.shape[-2:]
    return torch.ones(q, k, dtype=torch.bool, device=attends.device).tril(k - q).expand(attends.shape)


class Split(NamedTuple):
    """Eager's program on the example (masks dropped), the graph of the masks, and their patterns."""

    eager_program: GraphModule
    masks: GraphModule
    patterns: list[MaskPattern]


def split_dropped_masks(gm: GraphModule, calls: Sequence[SdpaCall] | None, example_inputs: Sequence[Any]) -> Split | None:
    """The split where eager called one of ``gm``'s SDPA calls without the input-dependent mask the
    graph passes it; None where it did not (or the eager calls do not line up with the graph's)."""
    nodes = sdpa_nodes(gm)
    if not nodes or calls is None or len(calls) < len(nodes):
        return None
    dropped = [(i, call) for i, (node, call) in enumerate(zip(nodes, calls)) if not call.masked and input_dependent(_mask(node))]
    if not dropped or any(_stateful(n) for i, _ in dropped for n in ancestors(_mask(nodes[i]))):
        return None
    masks = _mask_graph(gm, [_mask(nodes[i]) for i, _ in dropped])
    try:
        with torch.no_grad(), autocast_off():
            values = masks(*[_hint(x) for x in example_inputs])
        patterns = [MaskPattern.of(v) for v in values]
    except Exception:  # a mask that cannot be computed here: keep dynamo's program alone
        return None
    return Split(_without_masks(gm, dict(dropped)), masks, patterns)


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None


# Calls that change the process's state (vmap levels, grad mode, autocast) as they run: a mask
# computed after one of them cannot be computed alone, without its pair that restores the state.
_STATEFUL = ("functorch", "grad_enabled", "autocast")


def _stateful(node: Node) -> bool:
    target = node.target
    name = f"{getattr(target, '__module__', '') or ''}.{getattr(target, '__name__', target)}"
    return node.op == "call_function" and any(word in name for word in _STATEFUL)


def _from_inputs_alone(node: Node) -> bool:
    """Whether ``node`` is computed from the call's inputs and constants alone, by stateless calls:
    no placeholder that requires grad (a parameter), nor a state change, among what it is computed from."""
    return not any(
        _stateful(n) or (n.op == "placeholder" and getattr(_value(n), "requires_grad", False))
        for n in (node, *ancestors(node))
    )


def added_masks(gm: GraphModule) -> list[tuple[Node, Node, Node]]:
    """Dynamo's adds of a floating-point mask computed from the call's inputs alone to another value
    of the add's own shape (eager attention's ``scores + mask``): (add, mask, the other value)."""
    found = []
    for node in gm.graph.nodes:
        is_add = (node.op == "call_function" and node.target in (operator.add, torch.add)) or (node.op == "call_method" and node.target == "add")
        if not is_add or len(node.args) != 2 or node.kwargs:
            continue
        out = _value(node)
        for mask, other in (node.args, node.args[::-1]):
            m, o = _value(mask), _value(other)
            if not (isinstance(m, torch.Tensor) and isinstance(o, torch.Tensor) and isinstance(out, torch.Tensor)):
                continue
            if m.is_floating_point() and o.shape == out.shape and input_dependent(mask) and _from_inputs_alone(mask):
                found.append((node, mask, other))
                break
    return found


def split_dropped_adds(gm: GraphModule, example_inputs: Sequence[Any]) -> Split | None:
    """The split where ``gm`` adds masks (:func:`added_masks`) that are zero on the example: the
    graph without those adds, the graph of the masks, and their pattern ("all": every position
    attends). None where there is no such add. Whether eager dropped them is the caller's to show."""
    adds = added_masks(gm)
    if not adds:
        return None
    masks = _mask_graph(gm, [mask for _, mask, _ in adds])
    try:
        with torch.no_grad(), autocast_off():
            values = masks(*[_hint(x) for x in example_inputs])
    except Exception:  # a mask that cannot be computed here: keep dynamo's program alone
        return None
    zero = [(add, mask, other) for (add, mask, other), v in zip(adds, values) if MaskPattern.of(v).kind == "all"]
    if not zero:
        return None
    # The graph every call runs computes the zero masks alone; the one above, of every candidate, ran once.
    return Split(_without_adds(gm, {add.name for add, _, _ in zero}), _mask_graph(gm, [mask for _, mask, _ in zero]), [MaskPattern("all")] * len(zero))


def _edited_copy(gm: GraphModule, edit: Callable[[GraphModule], None]) -> GraphModule:
    """A copy of ``gm`` with ``edit`` applied to the copy's graph, recompiled."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = GraphModule(gm, graph)
    edit(copy)
    # No dead-code elimination here: FX's drops an in-place write whose result goes unused (a
    # mixture-of-experts sum by index_add_, hf/deepseek_v3), and the re-trace leaves out what
    # nothing reads anyway.
    copy.recompile()
    return copy


def _without_adds(gm: GraphModule, names: set[str]) -> GraphModule:
    """A copy of ``gm`` in which each add named in ``names`` is replaced by its other operand."""

    def edit(copy: GraphModule) -> None:
        for add, _, other in added_masks(copy):
            if add.name in names:
                add.replace_all_uses_with(other)
                copy.graph.erase_node(add)

    return _edited_copy(gm, edit)


def _hint(x: Any) -> Any:
    return x.node.hint if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else x


def _without_masks(gm: GraphModule, dropped: dict[int, SdpaCall]) -> GraphModule:
    """A copy of ``gm`` whose SDPA calls numbered in ``dropped`` take no mask and eager's ``is_causal``."""

    def edit(copy: GraphModule) -> None:
        for i, node in enumerate(sdpa_nodes(copy)):
            if i in dropped:
                positional = dict(zip(_SDPA_OPTIONAL, node.args[3:]))
                node.kwargs = {**positional, **node.kwargs, "attn_mask": None, "is_causal": dropped[i].is_causal}
                node.args = node.args[:3]

    return _edited_copy(gm, edit)


def _mask_graph(gm: GraphModule, masks: list[Node]) -> GraphModule:
    """A graph taking ``gm``'s inputs and returning ``masks``, computed by the same nodes."""
    graph = Graph()
    env: dict[Node, Node] = {}
    needed = set(masks).union(*(ancestors(m) for m in masks))
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[m] for m in masks))
    return GraphModule(gm, graph)


def dispatch(split: Split, eager_program: Callable[..., Any], traced_program: Callable[..., Any]) -> Callable[..., Any]:
    """A call of the compiled graph: eager's program where every dropped mask has its example's
    pattern, dynamo's otherwise. Both programs take the same (boxed or unboxed) arguments."""
    boxed = bool(getattr(traced_program, "_boxed_call", False))

    warned = []

    def run(*args: Any) -> Any:
        flat = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
        try:
            with torch.no_grad(), autocast_off():
                values = split.masks(*flat)
            follows_eager = all(p.matches(v) for p, v in zip(split.patterns, values))
        except Exception as e:  # never a crash where dynamo's program runs: it runs, and says so
            if not warned:
                warned.append(e)
                warnings.warn(
                    f"graphamp could not compute the attention masks that choose between eager's program and "
                    f"dynamo's for this call ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                    "it runs dynamo's program, which differs from eager autocast's where eager drops an all-ones mask. "
                    "Way out: graphamp.convert(model, ...) follows eager's program by its own guards.",
                    EagerPathWarning,
                    stacklevel=2,
                )
            follows_eager = False
        return (eager_program if follows_eager else traced_program)(*args)

    if boxed:
        run._boxed_call = True  # type: ignore[attr-defined]
    return run
