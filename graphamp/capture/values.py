"""Capture by running the model on the example's values: eager's own program, with guards.

torch.export traces on fake tensors, so model code that reads a tensor's value, or asks whether it
is being traced, takes another program than eager: transformers' mask utilities drop an all-ones
mask in eager (``padding_mask.all()``) and build an fp32 zero bias when traced (``is_tracing`` is
True for a fake tensor), which makes softmax run in fp32 under autocast; data-dependent branches
stop export altogether. Here the model runs for real, on the example, under the tracer (make_fx at
pre-dispatch, as export's own tracer): every op is recorded as eager runs it, and every value the
model's Python reads is what eager reads. The graph then holds the example's program, so it checks,
as it runs, what it follows:

* each read of a tensor value (``bool(t)``, ``t.item()``, ``t.tolist()``, ``torch.equal``, ...) gives
  what it gave on the example (:func:`graphamp.runtime.guard_value`);
* each op whose output size depends on values (``nonzero``, ``masked_select``) gives the example's
  size (:func:`graphamp.runtime.guard_size`);
* every input size is the example's (the graph is static, ``GraphInfo.captured_static``).

A failed check raises :class:`graphamp.InputValueError` (or a shape error), and the converted module
converts again for those inputs, as for any other shape class. A check that would fail after the
graph changed state (a buffer updated in place, a random draw) is moved, with the ops it reads, to
the start of the graph, so a refused call leaves nothing behind.

The reads themselves are recorded by :mod:`graphamp.capture.value_reads`.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from graphamp.shared_state import capture_lock
from graphamp.capture.export import host_draws_refused
from graphamp.capture.functions import _FunctionKeeper
from graphamp.eager import RngState
from graphamp.errors import CaptureError
from graphamp.node_info import graph_info, info, peek
from graphamp.runtime import fill, guard_size, guard_value
from graphamp.spec import ambient_autocast
from graphamp.capture.functions import _bind_kept_functions
from graphamp.capture.value_reads import VALUE_READ, Read, ValueReads, eager_reads
from graphamp.eager import state_restored
from graphamp.passes.graph_edit import ancestors, fake_mode_of, recompute_val

__all__ = ["capture_by_values"]


def capture_by_values(
    model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype, grads: bool = True,
    flip: int | None = None, keep_functions: bool = True,
) -> GraphModule:
    """The graph of eager's program on this example, traced on its values under autocast(device_type,
    dtype), with guards on what it follows; in the form ``capture`` returns (parameters and buffers as
    the model's own attributes, the inputs' and outputs' pytree), every size static.
    ``keep_functions`` as for ``capture``."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    reads = ValueReads(flip)
    out_spec: list[Any] = []

    def run(state: dict[str, torch.Tensor], flat: list[Any]) -> list[Any]:
        a, k = pytree.tree_unflatten(flat, in_spec)
        with reads:
            out = torch.func.functional_call(model, state, a, k, tie_weights=False, strict=True)
        leaves, spec = pytree.tree_flatten(out)
        out_spec.append(spec)
        return leaves

    run._orig_mod = model  # make_fx records each node's module stack relative to the model
    keeper = _FunctionKeeper(keep=keep_functions)
    rng = RngState()
    try:
        with (
            capture_lock(), state_restored(model), host_draws_refused(model), ambient_autocast(device_type, dtype), keeper,
            torch.enable_grad() if grads else contextlib.nullcontext(), one_fake_mode_while_tracing((state, flat)),
        ):
            traced = make_fx(
                run, tracing_mode="real", pre_dispatch=True, record_module_stack=True,
                _error_on_data_dependent_ops=False, record_stack_traces=True,
            )(state, flat)
    except CaptureError:
        raise
    except Exception as e:
        raise CaptureError(
            f"graphamp could not trace {type(model).__name__} on the example's values: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        ) from e
    _check_outputs(traced, model)
    gm = _as_model_graph(traced, model, list(state), flat, in_spec, out_spec[0])
    _guard_reads(gm, reads.reads, _run_for_values(gm, flat, rng, model, device_type, dtype))
    _guard_sizes(gm)
    _guards_first(gm)
    _drop_dead(gm.graph)
    _one_fake_mode(gm)
    graph_info(gm).captured_static = True
    if keeper.kept:
        _bind_kept_functions(gm, keeper.kept)
    gm.recompile()
    return gm


def _check_outputs(traced: GraphModule, model: nn.Module) -> None:
    (outputs,) = traced.graph.find_nodes(op="output")
    for leaf in pytree.tree_leaves(outputs.args[0]):
        if not isinstance(leaf, (Node, int, float, bool, str, type(None), torch.dtype, torch.device)):
            raise CaptureError(
                f"graphamp could not trace {type(model).__name__} on the example's values: it returns a "
                f"{type(leaf).__name__} in its outputs, which a converted graph cannot return (register it "
                "with torch.utils._pytree, or for a Hugging Face cache pass use_cache=False)"
            )


def _as_model_graph(
    traced: GraphModule, model: nn.Module, names: list[str], flat: list[Any], in_spec: Any, out_spec: Any,
) -> GraphModule:
    """``traced``'s graph with the state placeholders read as the model's attributes, the inputs
    named for the model's arguments, and the model's input and output pytree."""
    graph = traced.graph
    placeholders = graph.find_nodes(op="placeholder")
    state_nodes, input_nodes = placeholders[: len(names)], placeholders[len(names):]
    root: dict[str, Any] = {}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node, path in zip(state_nodes, names):
        with graph.inserting_before(first):
            attr = graph.create_node("get_attr", path)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)
        root[path] = model.get_parameter(path) if path in dict(model.named_parameters(remove_duplicate=False)) else model.get_buffer(path)
    for node in graph.find_nodes(op="get_attr"):
        if node.target not in root:
            root[node.target] = operator.attrgetter(node.target)(traced)
    arg_names = _argument_names(model, flat, in_spec)
    for node, name in zip(input_nodes, arg_names):
        node._rename(name)
        node.target = node.name
    # The forward takes the model's own arguments (a dict of tensors is one argument); the generated
    # code flattens them into the graph's inputs.
    graph._codegen = torch.fx.graph._PyTreeCodeGen(torch.fx.graph._PyTreeInfo(_top_level_names(model, in_spec), in_spec, out_spec))
    gm = GraphModule(root, graph)
    gm.meta.update(traced.meta)
    return gm


def _top_level_names(model: nn.Module, in_spec: Any) -> list[str]:
    """The forward's argument names as the model is called: one per positional argument (its
    parameter's name, or ``arg{i}`` past the named ones), then the keywords."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    args_spec, kwargs_spec = in_spec.children()
    positional = [params[i] if i < len(params) else f"arg{i}" for i in range(args_spec.num_children)]
    return positional + [str(k) for k in kwargs_spec.context]


def _argument_names(model: nn.Module, flat: list[Any], in_spec: Any) -> list[str]:
    """A name per flat input: the forward's parameter (or keyword) it is, with its path inside."""
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = []
    names = []
    for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(flat, in_spec))[0]:
        (where, *inner) = path
        if where.idx == 0 and inner:  # positional: args[i]
            i, inner = inner[0].idx, inner[1:]
            base = params[i] if i < len(params) else f"arg{i}"
        elif inner:
            base, inner = str(inner[0].key), inner[1:]
        else:
            base = "input"
        names.append("_".join([base, *(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "x")))) for p in inner)]))
    return names


_DATA_DEPENDENT = torch.Tag.data_dependent_output


def _is_data_read(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and (
        _DATA_DEPENDENT in node.target.tags or node.target is torch.ops.aten.is_nonzero.default
    )


def _guard_reads(gm: GraphModule, reads: list[Read], values_of: Callable[[list[Node]], dict[Node, Any]]) -> None:
    """Each recorded read becomes a guard on its value; the ATen reads the tracer recorded for it go.

    A read the model's code made below the Python API the tracer sees (an op's own ``.item()``, as
    ``torch.where(cond)`` or Longformer's chunking make) becomes a guard on that ATen op, with the
    value ``values_of`` finds for it.
    """
    graph = gm.graph
    pending: list[Node] = []
    unmarked: list[Node] = []
    for node in graph.nodes:
        if _is_data_read(node):
            pending.append(node)
        elif node.op == "call_function" and node.target is VALUE_READ:
            pending.clear()
        elif pending and node.op == "call_function":
            unmarked += pending
            pending.clear()
    unmarked += pending
    observed = values_of(unmarked) if unmarked else {}
    for node in unmarked:
        with graph.inserting_before(node):
            guard = graph.call_function(guard_value, ("op", [node.target, *node.args], observed[node], _line(node)))
        guard.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
        _explain_guard(guard)
        if not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if _is_data_read(node):
            pending.append(node)
        elif node.op == "call_function" and node.target is VALUE_READ:
            tensors, key = node.args
            read = reads[key]
            values = fill(read.template, list(tensors))
            with graph.inserting_before(node):
                guard = graph.call_function(guard_value, (read.name, list(values), read.observed, read.where))
            guard.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
            info(guard).value_read = key
            _explain_guard(guard)
            graph.erase_node(node)
            for done in pending:
                if not done.users:
                    graph.erase_node(done)
            pending.clear()
        else:
            pending.clear()


def _run_for_values(gm: GraphModule, flat: list[Any], rng: RngState, model: nn.Module, device_type: str, dtype: torch.dtype) -> Callable[[list[Node]], dict[Node, Any]]:
    """What ``_guard_reads`` asks for: the value each of some nodes had, from the graph run once more
    on the example from the trace's random state (its changes to the model put back)."""
    def values_of(nodes: list[Node]) -> dict[Node, Any]:
        wanted, found = set(nodes), {}

        class Recording(torch.fx.Interpreter):
            def run_node(self, n: Node) -> Any:
                out = super().run_node(n)
                if n in wanted:
                    found[n] = out
                return out

        try:
            with state_restored(model), ambient_autocast(device_type, dtype), torch.no_grad():
                rng.restore()
                Recording(gm).run(*flat)
        except Exception as e:
            raise _unguarded(nodes[0]) from e
        return found

    return values_of


def _unguarded(node: Node) -> CaptureError:
    where = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:-1]
    return CaptureError(
        f"graphamp could not trace the model on the example's values: its code reads a tensor value with "
        f"{node.target} where graphamp cannot check it{(' (' + where[0].strip() + ')') if where else ''}"
    )


# Ops whose output size depends on values that torch does not tag ``dynamic_output_shape``: the
# composite forms the capture records at pre-dispatch (``t.nonzero(as_tuple=True)``, one-argument
# ``torch.where``, ``t.repeat_interleave(repeats_tensor)``).
VALUE_SIZED_UNTAGGED = frozenset({
    torch.ops.aten.nonzero_numpy.default,
    torch.ops.aten.where.default,
    torch.ops.aten.repeat_interleave.self_Tensor,
})


def _value_sized(node: Node) -> bool:
    """Whether ``node``'s output size depends on the values of its inputs."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    tagged = torch.Tag.dynamic_output_shape in target.tags and not _integer_indexing(node)
    return tagged or target in VALUE_SIZED_UNTAGGED


def _guard_sizes(gm: GraphModule) -> None:
    """After each op whose output size depends on values, a guard that it is the example's."""
    graph = gm.graph
    for node in list(graph.nodes):
        if _value_sized(node):
            for i, val in enumerate(pytree.tree_leaves(node.meta.get("val"))):
                if not isinstance(val, torch.Tensor):
                    continue
                with graph.inserting_after(node):
                    src = node if isinstance(node.meta.get("val"), torch.Tensor) else graph.call_function(operator.getitem, (node, i))
                    if src is not node:
                        src.meta["val"] = val
                with graph.inserting_after(src):
                    _explain_guard(graph.call_function(guard_size, (src, list(val.shape), _line(node))))


def _integer_indexing(node: Node) -> bool:
    """``aten.index`` with integer indices only: its output size follows the indices' sizes (only a
    bool mask makes it depend on values)."""
    if node.target is not torch.ops.aten.index.Tensor:
        return False
    indices = [i for i in node.args[1] if i is not None]
    return all(isinstance(i, Node) and not i.meta["val"].dtype.is_floating_point and i.meta["val"].dtype is not torch.bool for i in indices)


def _explain_guard(guard: Node) -> None:
    """The guard's reason, as explain shows it."""
    what = "a value the model's code reads" if guard.target is guard_value else "a data-dependent size"
    info(guard).reason = f"guard: {what} ({guard.args[-1] or 'in the model'}) is the example's, else the module converts again"


def _line(node: Node) -> str:
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    frame = next((line for line in reversed(lines) if line.strip().startswith("File ")), "")
    return frame.strip().replace('File "', "").split('", line ')[0].rsplit("/", 1)[-1] + (
        ":" + frame.split(", line ")[1].split(",")[0] if ", line " in frame else ""
    )


def _changes_state(node: Node) -> bool:
    """Whether running ``node`` changes what a later call sees: an in-place op, a random draw, a kept
    custom Function (its forward may do either)."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return (
            target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
            # Their schemas do not say so, but in training they update the running statistics.
            or any(name in target.name() for name in ("batch_norm", "instance_norm"))
        )
    return target not in _SCOPED


# Calls a pre-dispatch graph records that change no state a later call sees.
_SCOPED = (
    guard_value, guard_size, operator.getitem, torch._C._set_grad_enabled,
    torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast,
)


def _guards_first(gm: GraphModule) -> None:
    """Each guard that comes after a change of state moves, with a copy of the ops it reads, before
    the first such change, so that a refused call has changed nothing. A guard whose reads change
    state themselves (DETR checks ``isfinite`` after dropout) stays; the module then saves what the
    graph changes (buffers updated in place, the random state) and puts it back when a call is
    refused (``GraphInfo.restore_on_refusal``)."""
    graph = gm.graph
    changes = [n for n in graph.nodes if _changes_state(n)]
    if not changes:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = changes[0]
    stays = False
    for guard in [n for n in graph.nodes if n.target in (guard_value, guard_size)]:
        if order[guard] < order[first]:
            continue
        cone = ancestors(guard)
        if any(_changes_state(n) for n in cone):
            stays = True
            continue
        copies: dict[Node, Node] = {}
        for node in sorted(cone, key=order.__getitem__):
            if node.op == "placeholder" or order[node] < order[first] or node in copies:
                continue
            with graph.inserting_before(first):
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
                for sized in (n for n in _size_guards_on(node) if n not in copies):  # torch.export sizes each copy by its own
                    copies[sized] = graph.node_copy(sized, lambda n: copies.get(n, n))
        if guard not in copies:
            with graph.inserting_before(first):
                graph.node_copy(guard, lambda n: copies.get(n, n))
        if guard.target is not guard_size:  # a size guard stays too: torch.export sizes the original by it
            graph.erase_node(guard)
    if stays:
        buffers = dict(gm.named_buffers())
        changed = {
            a.target for n in changes for a in n.all_input_nodes if a.op == "get_attr" and a.target in buffers
        }
        random = any(isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags for n in changes)
        graph_info(gm).restore_on_refusal = (sorted(changed), random or any(not isinstance(n.target, torch._ops.OpOverload) for n in changes))


def _size_guards_on(node: Node) -> list[Node]:
    """The ``guard_size`` nodes on ``node``'s output or its items, each after the item it reads."""
    found = [u for u in node.users if u.target is guard_size]
    for item in (u for u in node.users if u.target is operator.getitem):
        guards = [g for g in item.users if g.target is guard_size]
        found += [item, *guards] if guards else []
    return found


def _drop_dead(graph: Graph) -> None:
    """Drop the ops whose values only the replaced reads used (pure ATen ops with no users; a random
    draw stays, as eager draws it)."""
    for node in reversed(list(graph.nodes)):
        target = node.target
        if (
            node.op == "call_function" and not node.users and isinstance(target, torch._ops.OpOverload)
            and not _changes_state(node)
        ):
            graph.erase_node(node)


@contextlib.contextmanager
def one_fake_mode_while_tracing(tensors: Any) -> Any:
    """``make_fx`` on real tensors records each node's value as a fake tensor of a FakeTensorMode made
    for that node, and each mode records the Python stack as it is made (about 1 ms a node under a
    deep stack: a third of a BERT's capture on values). One mode for the whole trace instead, given
    as the tracing context's, which ``make_fx`` asks for first. Only for real tensors outside any
    other trace: where a fake mode or a tracing context is already about, nothing changes."""
    from torch._guards import TracingContext, active_fake_mode, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    leaves = [t for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
    if TracingContext.try_get() is not None or active_fake_mode() is not None or any(is_fake(t) or t.is_meta for t in leaves):
        yield
        return
    with tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True))):
        yield


def _one_fake_mode(gm: GraphModule) -> None:
    """Every node's value as a fake tensor of one mode (make_fx gives each its own), which the
    passes recompute edited nodes in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def rehome(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        with mode:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(rehome, node.meta["val"])


# Ops a guard's reads may go through and still hold for inputs of any size: no size is baked into
# them (pointwise ops, whole-tensor reductions, dtype and device conversions).
_SIZE_FREE = frozenset({
    "aten::all", "aten::any", "aten::sum", "aten::max", "aten::min", "aten::to", "aten::_to_copy", "aten::clone",
    "aten::detach", "aten::alias", "aten::lift_fresh_copy", "aten::isfinite", "aten::isnan", "aten::isinf",
})
_SIZE_FREE_OVERLOADS = frozenset({"default", "dim", "dtype", "device", "dtype_layout", "other", "Scalar", "Tensor"})


def _size_free(node: Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or _changes_state(node):
        return False
    if any(isinstance(a, (list, tuple)) for a in node.args):
        return False
    return target._schema.name in _SIZE_FREE or (torch.Tag.pointwise in target.tags and target._overloadname in _SIZE_FREE_OVERLOADS)


def guard_eager_reads(
    gm: GraphModule, model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype, grads: bool,
    keep_functions: bool = True,
) -> list[str]:
    """Give a graph torch.export captured the guards the capture on values finds, where they hold
    for any size: eager reads those values to choose its program (transformers' ``mask.all()``), the
    trace did not, so the graph is eager's program only for inputs whose reads give the example's
    values. A failing guard makes the module convert again for those inputs. Returns where eager
    reads values that no such guard can check (the caller warns)."""
    if not eager_reads(model, args, kwargs, device_type=device_type, dtype=dtype):
        return []
    try:
        traced = capture_by_values(model, args, kwargs, device_type=device_type, dtype=dtype, grads=grads, keep_functions=keep_functions)
    except CaptureError as e:
        return [f"(the capture on values failed: {str(e).splitlines()[0][:160]})"]
    ours, theirs = gm.graph.find_nodes(op="placeholder"), traced.graph.find_nodes(op="placeholder")
    # The reads of eager's Python only: sizes that depend on values are symbolic in export's graph.
    guards = [n for n in traced.graph.nodes if n.target is guard_value]
    if len(ours) != len(theirs):
        return [_where(g) for g in guards]
    program = _program(traced)
    decided: dict[str, bool] = {}

    def matters(guard: Node) -> bool:
        """Whether the model's code runs another program when this read (a bool) comes out the other
        way: traced again with it flipped (once per line of code, for the first few lines). A read
        only logging looks at (transformers' padding warning) changes nothing: no warning."""
        key, where = (peek(guard).value_read if peek(guard) else None), _where(guard)
        if key is None or not isinstance(guard.args[2], bool):
            return True
        if where not in decided and len(decided) >= _MAX_FLIPS:
            return True
        if where not in decided:
            try:
                flipped = capture_by_values(
                    model, args, kwargs, device_type=device_type, dtype=dtype, grads=grads, flip=key, keep_functions=keep_functions,
                )
                decided[where] = _program(flipped) != program
            except Exception:
                decided[where] = True
        return decided[where]

    graph, fake_mode = gm.graph, fake_mode_of(gm)
    anchor = ours[-1].next if ours else next(iter(graph.nodes))  # right after the inputs
    order = {n: i for i, n in enumerate(traced.graph.nodes)}
    env: dict[Node, Node] = dict(zip(theirs, ours))
    unguarded = []
    for guard in guards:
        cone = sorted(ancestors(guard), key=order.__getitem__)
        if not any(n.op == "placeholder" for n in cone):
            # No input's value reaches it: a read of sizes and the model's own tensors (Llama's
            # packed-sequence check on the position ids it builds with arange). Not checked per call:
            # the graph keeps the traced path there for every size (README, Known limits).
            continue
        if not all(n.op in ("placeholder", "get_attr") or _size_free(n) for n in cone):
            if matters(guard):  # traced again only here: a guard costs nothing to keep where it can
                unguarded.append(_where(guard))
            continue
        for node in cone:
            if node in env:
                continue
            if node.op == "get_attr":
                env[node] = _attribute(gm, traced, node.target, anchor)
                continue
            with graph.inserting_before(anchor):
                sized = [_sized(a, cone, env, graph) for a in node.args]  # size nodes first, then the op
                copy = env[node] = graph.node_copy(node, env.__getitem__)
                copy.args = tuple(z if z is not a else m for z, a, m in zip(sized, node.args, copy.args))
            copy.meta["val"] = recompute_val(copy, fake_mode)
        with graph.inserting_before(anchor):
            graph.node_copy(guard, env.__getitem__)
    gm.recompile()
    return unguarded


# At most this many reads are traced again flipped per conversion (each is one traced forward).
_MAX_FLIPS = 3


def _sized(arg: Any, cone: list[Node], env: dict[Node, Node], graph: Graph) -> Any:
    """A number the trace baked in that is a tensor's size in the read (``mask.sum() == mask.numel()``,
    transformers' ``fast_all``), as that size computed in ``graph``, so the guard holds for any size."""
    if type(arg) is not int or arg < 2:
        return arg
    for node in cone:
        val = node.meta.get("val")
        if node not in env or not isinstance(val, torch.Tensor):
            continue
        if val.numel() == arg:
            size = graph.call_function(torch.ops.aten.sym_numel.default, (env[node],))
        elif arg in val.shape:
            size = graph.call_function(torch.ops.aten.sym_size.int, (env[node], list(val.shape).index(arg)))
        else:
            continue
        mine = env[node].meta["val"]
        size.meta["val"] = mine.numel() if size.target is torch.ops.aten.sym_numel.default else mine.shape[size.args[1]]
        return size
    return arg


def _program(gm: GraphModule) -> list[tuple]:
    """The ops a graph runs, with their arguments (nodes by position): guards left out."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [
        (n.target, str(torch.fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])))
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target not in (guard_value, guard_size)
    ]


def _attribute(gm: GraphModule, traced: GraphModule, target: str, anchor: Node) -> Node:
    """A get_attr in ``gm`` for ``traced``'s attribute: the model's own, or a constant copied over."""
    value = operator.attrgetter(target)(traced)
    try:
        mine = operator.attrgetter(target)(gm)
    except AttributeError:
        mine = None
    if mine is not value:  # a constant the model's code made (torch.tensor(...)): gm holds it too
        target = f"_graphamp_read_constant{len([n for n in dir(gm) if n.startswith('_graphamp_read_constant')])}"
        setattr(gm, target, value)
    with gm.graph.inserting_before(anchor):
        node = gm.graph.create_node("get_attr", target)
    if isinstance(value, torch.Tensor):
        node.meta["val"] = fake_mode_of(gm).from_tensor(value, static_shapes=True)
    return node


def _where(guard: Node) -> str:
    return guard.args[3] if guard.target is guard_value else guard.args[2]
