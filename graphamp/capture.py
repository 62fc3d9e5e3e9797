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
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch._ops import _get_dispatch_mode_pre_dispatch
from torch.export import Dim, ShapesCollection
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode, track_tensor_tree
from torch.utils import _pytree as pytree

from graphamp.errors import BannedOpError, CaptureError, EagerPathWarning, GraphampError, PromoteTypeError, ScriptCaptureError, UnsupportedFunctionError
from graphamp.passes.node_info import NodeInfo
from graphamp.spec import ambient_autocast
from graphamp.runtime import KeptFunction, PartialTemplate, Slot, apply_function, current_autocast_state, qualified_name

__all__ = ["capture", "ambient_autocast", "script_graph"]


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    # Every dim of every tensor input may vary; export keeps static what the model pins down.
    shapes = ShapesCollection()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            shapes[leaf] = {i: Dim.AUTO for i in range(leaf.dim())}
    return shapes.dynamic_shapes(model, args, kwargs)


def _describe(e: BaseException) -> tuple[str, str]:
    """The construct that stopped the capture, and the way out, from torch's exception."""
    text = f"{type(e).__name__}: {e}"
    first = text.strip().splitlines()[0][:300]
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered or "guardondatadependent" in lowered:
        return (
            f"data-dependent control flow or shape (a Python branch on a tensor's value): {first}",
            "make the branch independent of tensor values (torch.cond, torch.where), or use "
            "torch.compile(model, backend=\"graphamp\"), which splits the graph there",
        )
    if "constraint" in lowered or "specializ" in lowered or "dynamic" in lowered:
        return (
            f"a shape the example inputs cannot vary: {first}",
            "pass example inputs whose batch and sequence sizes are at least 2 and differ from "
            "the other dims, or use torch.compile(model, backend=\"graphamp\")",
        )
    return (
        first,
        "check that model(*args, **kwargs) runs eagerly with these example inputs; if it does, "
        "use torch.compile(model, backend=\"graphamp\"), which handles graph breaks",
    )


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device_type: str,
    dtype: torch.dtype,
    grads: bool = True,
) -> torch.fx.GraphModule:
    """Export ``model`` under autocast(device_type, dtype) and return the unlifted graph module.

    ``grads=False`` declares that no gradient will be taken through the result (inference, export).

    Parameters and buffers are attributes of the returned module (the model's own objects),
    inputs and outputs keep their pytree structure, and batch/sequence dims are symbolic.
    A model holding a ``torch.jit.ScriptModule`` is first traced to a plain graph (``script_graph``).
    """
    if any(isinstance(m, torch.jit.ScriptModule) for m in model.modules()):
        model = script_graph(model, args, kwargs, device_type=device_type, dtype=dtype, grads=grads)
    try:
        dynamic_shapes = _dynamic_shapes(model, args, kwargs)
        try:
            ep, keeper = _export(model, args, kwargs, dynamic_shapes, device_type, dtype, eager_flags=True)
        except GraphampError:
            raise
        except Exception as e:
            if _is_autocast_rejection(e):
                raise
            # The model's eager path cannot be traced (it reads tensor values where its compile
            # path does not): take the path torch.export and torch.compile take, and say so.
            ep, keeper = _export(model, args, kwargs, dynamic_shapes, device_type, dtype, eager_flags=False)
            warnings.warn(
                f"graphamp traced {type(model).__name__} as torch.export sees it (torch.compiler."
                "is_compiling() True), because its eager path could not be traced: "
                f"{str(e).strip().splitlines()[0][:200]}. Where the model's code takes another "
                "path when compiling, gradients (rarely values) may differ from eager autocast; "
                "graphamp.verify(model, args, grads=True) checks it.",
                EagerPathWarning,
                stacklevel=3,
            )
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
    gm.meta["range_constraints"], gm.meta["range_reasons"] = _model_ranges(ep)
    if keeper.kept:
        _bind_kept_functions(gm, keeper.kept)
    return gm


# Ops by which TorchScript reads a tensor's value into the interpreter (an `if` on a tensor, `.item()`,
# `int(t)`): the interpreter then takes one path, which a graph of the example's run would fix.
_VALUE_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default)


def _detaches_in_source(model: nn.Module) -> bool:
    """Whether any TorchScript method in ``model`` calls ``detach`` itself (then a detached
    parameter in the trace is the model's own choice, not the optimizing executor's)."""
    for m in model.modules():
        if isinstance(m, torch.jit.ScriptModule) and hasattr(m, "forward") and hasattr(m.forward, "graph"):
            graph = m.forward.graph.copy()
            torch._C._jit_pass_inline(graph)
            if "aten::detach" in str(graph):
                return True
    return False


_JIT_AUTOCAST_CASTS = (torch.ops.aten._autocast_to_reduced_precision.default, torch.ops.aten._autocast_to_full_precision.default)


def script_graph(model: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype, grads: bool = True) -> GraphModule:
    """A plain graph of a model that holds ``torch.jit.ScriptModule``s, over the model's own Parameters.

    torch.export refuses ScriptModules. Pre-dispatch ``make_fx`` records the ops the TorchScript
    interpreter dispatches, above the autocast key (TorchScript's own autocast pass is switched
    off for the trace, so the dispatcher's policy, which graphamp reproduces, applies); it runs on
    the real example (buffers and the RNG state are restored after) and records parameters as
    constants, which are mapped back here to the model's own Parameters and buffers by identity,
    so training and ``state_dict`` work as for ``nn.Module``s. The result is then captured like any
    module. Sizes the script computes from its inputs are the example's (the interpreter gives the
    tracer plain integers): later calls with other sizes are refused by the converted module.

    >>> net = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    >>> gm = script_graph(net, (torch.randn(2, 4),), {}, device_type="cpu", dtype=torch.bfloat16)
    >>> assert gm.get_parameter("0.weight") is dict(net.named_parameters())["0.weight"]
    """
    from torch.export._unlift import _get_codegen
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, in_spec = pytree.tree_flatten((args, kwargs))
    out_specs: list[Any] = []

    def run(*flat_args: Any) -> list[Any]:
        call_args, call_kwargs = pytree.tree_unflatten(list(flat_args), in_spec)
        leaves, out_spec = pytree.tree_flatten(model(*call_args, **call_kwargs))
        out_specs.append(out_spec)
        return leaves

    names: dict[int, tuple[str, bool]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), (name, True))
    for name, t in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(t), (name, False))
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    jit_autocast = torch._C._jit_set_autocast_mode(False)
    try:
        # Unoptimized execution: the optimizing executor runs autodiff subgraphs whose inner ops
        # see detached inputs (their gradient is a C++ node the tracer never records), and its
        # passes insert TorchScript's own autocast ops.
        with ambient_autocast(device_type, dtype), warnings.catch_warnings(), torch.jit.optimized_execution(False):
            warnings.simplefilter("ignore")
            traced = make_fx(run, pre_dispatch=True, tracing_mode="real")(*flat)
    except Exception as e:
        cause = f"{type(e).__name__}: {e}".strip().splitlines()
        marked = [cause[i - 1].strip() for i in range(1, len(cause)) if "<--- HERE" in cause[i]]
        if marked and re.search(r"\b(bool|int|float)\(|\.item\(|\.tolist\(|^(if|elif|while)\b", marked[-1]):
            raise ScriptCaptureError(
                f"{type(model).__name__}'s TorchScript reads a tensor's value at `{marked[-1]}` (TorchScript "
                "control flow on values), so its program depends on the input values and one graph cannot "
                "hold it. Way out: make the branch independent of values (torch.where), or convert the Python "
                "nn.Module it was scripted from with torch.compile(model, backend=\"graphamp\"), which splits "
                "the graph there."
            ) from e
        raise ScriptCaptureError(
            f"graphamp could not trace the TorchScript in {type(model).__name__} with make_fx: "
            f"{' '.join(line.strip() for line in cause[:6])[:400]}. Way out: check that the model runs "
            "on these inputs; or convert the Python nn.Module it was scripted from."
        ) from e
    finally:
        torch._C._jit_set_autocast_mode(jit_autocast)
        torch.set_rng_state(rng)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])
    # A graph executor warmed up under autocast elsewhere keeps TorchScript's own autocast casts in
    # its plan; graphamp applies the dispatcher's policy, which those casts mirror, so they go.
    for node in list(traced.graph.nodes):
        if node.op == "call_function" and node.target in _JIT_AUTOCAST_CASTS:
            node.replace_all_uses_with(node.args[0])
            traced.graph.erase_node(node)
    cut = [
        n for n in traced.graph.find_nodes(op="call_function", target=torch.ops.aten.detach.default)
        if n.args[0].op == "get_attr" and getattr(getattr(traced, n.args[0].target), "requires_grad", False)
    ]
    if cut and grads and not _detaches_in_source(model):
        scripts = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.jit.ScriptModule)})
        param = names.get(id(getattr(traced, cut[0].args[0].target)), (cut[0].args[0].target,))[0]
        raise ScriptCaptureError(
            f"TorchScript has already optimized the code of {', '.join(scripts)} (its methods ran before in this "
            "process, on this or another instance): the optimized plan runs autodiff subgraphs whose inner ops "
            f"see detached parameters ({param}, ...), so a trace of it would have no gradients. Way out: convert "
            "(or build the TrainStep and take its first step) before running the ScriptModule, or convert in a "
            "fresh process; graphamp.convert of a model not yet run under TorchScript is exact."
        )
    reads = [n for n in traced.graph.nodes if n.op == "call_function" and n.target in _VALUE_READS]
    if reads:
        raise ScriptCaptureError(
            f"{type(model).__name__}'s TorchScript reads a tensor's value ({reads[0].target.__name__}: "
            "TorchScript control flow on values, an `if` on a tensor or `.item()`), so its program depends on "
            "the input values and one graph would hold only the example's path. Way out: make the branch "
            "independent of values (torch.where), or convert the Python nn.Module it was scripted from "
            "with torch.compile(model, backend=\"graphamp\"), which splits the graph there."
        )
    root = nn.Module()
    for node in traced.graph.find_nodes(op="get_attr"):
        value = getattr(traced, node.target)
        name, is_param = names.get(id(value), (node.target, False))
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if not hasattr(owner, leaf):
            if is_param:
                owner.register_parameter(leaf, value)
            else:
                owner.register_buffer(leaf, value, persistent=id(value) in names)
        node.target = name
    gm = GraphModule(root, traced.graph, class_name=type(model).__name__)
    gm.graph._codegen = _get_codegen(in_spec, out_specs[0])
    gm.recompile()
    return gm


# Where torch's fake kernels and decompositions guard on sizes: to pick a memory format or a
# kernel, which the converted graph does not record (its ops pick again at run time), or to check
# sizes an op rejects at run time anyway, as in eager.
_KERNEL_FILES = tuple(
    os.path.join(os.path.dirname(torch.__file__), *part.split("/"))
    for part in ("_subclasses/fake_impls.py", "_meta_registrations.py", "_refs/", "_prims/", "_decomp/", "_prims_common/")
)


def _model_ranges(ep: torch.export.ExportedProgram) -> tuple[dict, dict[str, str]]:
    """export's range of each symbolic size, except that bounds only torch's kernels imposed are
    lifted to 1: a conv's fake kernel asks for batch > 1 to choose a memory format (so export
    pins batch to [2, inf)), while the model's own code takes batch 1 and eager runs it. Also,
    per size the model's code constrains, the first such condition and where it is."""
    from torch.utils._sympy.value_ranges import ValueRanges

    ranges = dict(ep.range_constraints)
    vals = pytree.tree_leaves([n.meta.get("val") for n in ep.graph.nodes])
    fake = next((v for v in vals if isinstance(v, torch._subclasses.fake_tensor.FakeTensor)), None)
    shape_env = fake.fake_mode.shape_env if fake is not None else None
    if shape_env is None:
        return ranges, {}
    by_model: dict = {}
    for guard in shape_env.guards:
        where = getattr(guard.sloc, "framework_loc", None)
        filename = str(getattr(where, "filename", where) or "")
        if not filename.startswith(_KERNEL_FILES):
            line = f"{os.path.basename(filename)}:{getattr(where, 'lineno', '?')}" if filename else "the model's code"
            for sym in guard.expr.free_symbols:
                by_model.setdefault(sym, f"{guard.expr} at {line}")
    reasons = {}
    for sym, vr in ranges.items():
        if sym in by_model:
            reasons[str(sym)] = by_model[sym]
        elif getattr(vr.lower, "is_Integer", False) and int(vr.lower) > 1:
            ranges[sym] = ValueRanges(1, vr.upper)
    return ranges, reasons


def _is_autocast_rejection(e: BaseException) -> bool:
    return "unsafe to autocast" in str(e) or "at::autocast::prioritize" in str(e)


def _export(
    model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, device_type: str, dtype: torch.dtype,
    *, eager_flags: bool,
) -> tuple[torch.export.ExportedProgram, _FunctionKeeper]:
    keeper = _FunctionKeeper()
    # backed_size_oblivious lets a dim traced at size >= 2 also accept size 1 at run time
    # (batch 1 inference) instead of pinning the range to [2, inf).
    with (
        fx_config.patch(backed_size_oblivious=True),
        ambient_autocast(device_type, dtype),
        warnings.catch_warnings(),
        _quiet_on_failure(),
        _eager_flags(model) if eager_flags else contextlib.nullcontext(),
        keeper,
    ):
        # nn.RNN* re-assign _flat_weights during tracing; export warns about it, harmlessly.
        warnings.filterwarnings("ignore", message=".*were assigned during export.*")
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    return ep, keeper


@contextlib.contextmanager
def _eager_flags(model: nn.Module) -> Iterator[None]:
    """Inside ``model``'s forward, ``torch.compiler.is_compiling()`` and ``is_exporting()`` say False.

    Model code reads them to take another, forward-equivalent program when compiled
    (transformers materialises attention masks and broadcasts position biases over the batch),
    whose gradients round differently. graphamp's module replaces eager execution, so it traces
    the eager program. Export's own machinery, outside the forward, still sees its flags.
    """

    def enter(module: nn.Module, args: Any) -> None:
        saved.append((torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag))
        torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = False

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = saved.pop()

    saved: list[tuple[bool, bool]] = []
    # Hooks on the model for the duration of the capture only: they are removed before returning.
    handles = [model.register_forward_pre_hook(enter, prepend=True), model.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _quiet_on_failure() -> Iterator[None]:
    """Hold what is printed while exporting; on failure drop torch.export's dump of the partial
    graph (printed once per export layer, before the exception reaches graphamp), keep the rest.

    graphamp's CaptureError says what failed and the way out; the dump would bury it.
    """
    held: list[tuple[Any, str]] = []
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Held(out, held), _Held(err, held)
    failure: BaseException | None = None
    try:
        yield
    except BaseException as e:
        failure = e
        raise
    finally:
        sys.stdout, sys.stderr = out, err
        dumps = _partial_graphs(failure)
        after_dump = False
        for stream, text in held:
            if text in dumps or (after_dump and text == "\n"):
                after_dump = text in dumps
                continue
            after_dump = False
            stream.write(text)


class _Held:
    """A stand-in for sys.stdout/sys.stderr that keeps writes, in order, for later."""

    def __init__(self, stream: Any, held: list[tuple[Any, str]]) -> None:
        self._stream = stream
        self._held = held

    def write(self, text: str) -> int:
        self._held.append((self._stream, text))
        return len(text)

    def flush(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _partial_graphs(e: BaseException | None) -> set[str]:
    dumps: set[str] = set()
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if hasattr(e, "partial_fx_graph"):
            dumps.add(str(e.partial_fx_graph))
        e = e.__cause__ or e.__context__
    return dumps


# The node a kept Function call is recorded as while exporting: a callable export's verifier
# allows (torch's own stand-in for custom Functions in pre-dispatch graphs), whose first argument
# here is graphamp's key for the call. capture() rebinds every such node before returning.
_RECORDED = torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_PATCH_LOCK = threading.Lock()
_patch_users = 0
_active = threading.local()


class _FunctionKeeper:
    """While exporting in this thread, records every custom ``autograd.Function`` call as one node.

    ``Function.apply`` is patched for the duration (torch 2.13 offers no hook for it other than
    decorating each Function class); calls from other threads, from inside a kept Function's
    forward, or outside export's tracer go to the original.
    """

    def __init__(self) -> None:
        self.kept: dict[str, KeptFunction] = {}
        self.busy = False

    def __enter__(self) -> _FunctionKeeper:
        global _patch_users
        with _PATCH_LOCK:
            if _patch_users == 0:
                torch.autograd.Function.apply = classmethod(_recording_apply)
            _patch_users += 1
        self.outer = getattr(_active, "keeper", None)
        _active.keeper = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _patch_users
        _active.keeper = self.outer
        with _PATCH_LOCK:
            _patch_users -= 1
            if _patch_users == 0:
                torch.autograd.Function.apply = _ORIGINAL_APPLY

    def record(self, cls: type, apply: Callable[..., Any], tracer: Any, args: tuple, kwargs: dict) -> Any:
        name = qualified_name(cls)
        template, values = _split((args, kwargs))
        if not values:
            # No tensor in, so no gradient out: eager's outputs do not require grad, and its
            # forward's ops are all there is to reproduce. Traced through under no_grad, as eager
            # runs a Function's forward, they get graphamp's casts like any other ops.
            with torch.no_grad():
                return apply(*args, **kwargs)
        hidden = [h for v in _constants(template) for h in _hidden_tensors(v)]
        if hidden:
            raise UnsupportedFunctionError(
                f"graphamp cannot keep the custom autograd.Function {name} with its own backward: an "
                f"argument of {cls.__name__}.apply hides tensors computed in forward ({'; '.join(hidden)}), "
                "whose values the converted graph could not pass in. Way out: pass those tensors as "
                f"arguments of {cls.__name__}.apply (for checkpoint: checkpoint(fn, *tensors))."
            )
        states, cache_enabled = current_autocast_state()
        self.busy = True
        try:
            with _below_tracer():
                out = apply(*args, **kwargs)
        except GraphampError:
            raise
        except Exception as e:
            if "unsafe to autocast" in str(e) or "at::autocast::prioritize" in str(e):
                raise  # capture() turns these into BannedOpError / PromoteTypeError, as for any op
            cause = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
            raise UnsupportedFunctionError(
                f"graphamp keeps the custom autograd.Function {name} whole, so that autograd calls "
                "its own backward, and needs its forward to run on fake tensors (shapes and dtypes "
                f"only) to do so; it failed there: {cause}. Way out: keep tensor values out of the "
                "forward's Python (no .item(), .tolist(), numpy or branches on values), or call the "
                "Function outside the converted module."
            ) from e
        finally:
            self.busy = False
        _check_outputs(out, name)
        key = f"{name}#{len(self.kept)}"
        self.kept[key] = KeptFunction(cls, template, states, cache_enabled)
        proxy = tracer.create_proxy("call_function", _RECORDED, (key, *(tracer.unwrap_proxy(v) for v in values)), {})
        track_tensor_tree(out, proxy, constant=None, tracer=tracer)
        return out


def _recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    apply = _ORIGINAL_APPLY.__get__(None, cls)
    keeper = getattr(_active, "keeper", None)
    if keeper is None or keeper.busy:
        return apply(*args, **kwargs)
    mode = _get_dispatch_mode_pre_dispatch(torch._C._TorchDispatchModeKey.PROXY)
    if mode is None or not mode.pre_dispatch:
        return apply(*args, **kwargs)
    return keeper.record(cls, apply, mode.tracer, args, kwargs)


@contextlib.contextmanager
def _below_tracer() -> Iterator[None]:
    """Run code below export's pre-dispatch tracer: ops reach autocast and fake tensors, unrecorded.

    The same dispatch-key switch as torch._export.wrappers.allow_in_pre_dispatch_graph; the
    tracer's torch-function mode is lifted too, or the Function's own ``torch.autocast`` and
    ``no_grad`` regions (custom_fwd, checkpoint) would leave markers in the graph.
    """
    include = torch._C._dispatch_tls_local_include_set().remove(torch._C.DispatchKey.PreDispatch)
    exclude = torch._C._dispatch_tls_local_exclude_set() | torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)
    stack = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    kept = [m for m in stack if not isinstance(m, PreDispatchTorchFunctionMode)]
    for mode in kept:
        torch._C._push_on_torch_function_stack(mode)
    try:
        with torch._C._ForceDispatchKeyGuard(include, exclude):
            yield
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for mode in stack:
            torch._C._push_on_torch_function_stack(mode)


def _is_graph_value(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))


def _split(value: Any) -> tuple[Any, list[Any]]:
    """``value`` with a :class:`~graphamp.runtime.Slot` for every tensor or symbolic size, and
    those values in order. Tuples, lists, dicts and ``functools.partial`` are looked into."""
    values: list[Any] = []

    def walk(obj: Any) -> Any:
        if _is_graph_value(obj):
            values.append(obj)
            return Slot(len(values) - 1)
        if isinstance(obj, tuple):
            parts = [walk(o) for o in obj]
            return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
        if type(obj) is list:
            return [walk(o) for o in obj]
        if type(obj) is dict:
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, functools.partial):
            return PartialTemplate(type(obj), walk(obj.func), walk(obj.args), walk(obj.keywords))
        return obj

    return walk(value), values


def _constants(template: Any) -> Iterator[Any]:
    if isinstance(template, (tuple, list)) and not isinstance(template, Slot):
        for t in template:
            yield from _constants(t)
    elif isinstance(template, dict):
        for t in template.values():
            yield from _constants(t)
    elif not isinstance(template, Slot):
        yield template


def _hidden_tensors(obj: Any) -> list[str]:
    """Tensors inside a constant argument, which the graph could not pass in at run time: in a
    container graphamp does not look into, or in a function's closure."""
    if isinstance(obj, (nn.Module, type)):
        return []  # a module's parameters and buffers are the model's own, live at run time
    func = getattr(obj, "__func__", obj)
    if isinstance(func, types.FunctionType):
        found = []
        for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(contents)):
                found.append(f"{func.__qualname__} closes over {name!r}")
        return found
    if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(obj)):
        return [f"a {type(obj).__name__} holds tensors"]
    return []


def _check_outputs(out: Any, name: str) -> None:
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    for leaf in leaves:
        if not (isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (bool, int, float, str, torch.SymInt, torch.SymFloat, torch.SymBool))):
            raise UnsupportedFunctionError(
                f"graphamp cannot keep the custom autograd.Function {name} whole: its forward returns "
                f"a {type(leaf).__name__}, and a kept Function's outputs must be tensors (or plain "
                "numbers) in a tuple. Way out: return the tensors as a flat tuple."
            )


def _bind_kept_functions(gm: GraphModule, kept: dict[str, KeptFunction]) -> None:
    """Turn each recorded Function node into ``apply_function(<KeptFunction attribute>, ...)``.

    A call inside a region written in forward (``torch.autocast``, ``no_grad``) sits in the region's
    subgraph; the KeptFunction reaches it as one more operand of the region, level by level.
    """
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    attrs: dict[str, Node] = {}

    def top_level(key: str) -> Node:
        if key not in attrs:
            function = kept[key].function
            base = "_graphamp_" + _snake(function.__name__)
            name = base
            for i in range(1, 1 << 20):
                if not hasattr(gm, name):
                    break
                name = f"{base}_{i}"
            gm.add_submodule(name, kept[key])
            with gm.graph.inserting_before(first):
                attrs[key] = gm.graph.get_attr(name)
            attrs[key].meta["val"] = kept[key]
        return attrs[key]

    _bind_in(gm, kept, top_level)
    gm.graph.lint()
    gm.recompile()


def _snake(name: str) -> str:
    """``MatMul`` -> ``mat_mul``, ``STE`` -> ``ste``: names for a kept Function's nodes."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _recorded_keys(gm: GraphModule, kept: dict[str, KeptFunction]) -> list[str]:
    keys = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _RECORDED and node.args and node.args[0] in kept:
            keys.append(node.args[0])
        for sub in _subgraphs(gm, node):
            keys.extend(k for k in _recorded_keys(sub, kept) if k not in keys)
    return keys


def _subgraphs(gm: GraphModule, node: Node) -> list[GraphModule]:
    return [
        getattr(gm, a.target) for a in node.args
        if isinstance(a, Node) and a.op == "get_attr" and isinstance(getattr(gm, a.target, None), GraphModule)
    ]


_REGION_OPS = (torch.ops.higher_order.wrap_with_autocast, torch.ops.higher_order.wrap_with_set_grad_enabled)


def _bind_in(gm: GraphModule, kept: dict[str, KeptFunction], source: Callable[[str], Node]) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _RECORDED and node.args and node.args[0] in kept:
            key = node.args[0]
            with gm.graph.inserting_before(node):
                call = gm.graph.create_node(
                    "call_function", apply_function, (source(key), *node.args[1:]), {}, name=_snake(kept[key].function.__name__)
                )
            call.meta = node.meta
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            states = ", ".join(f"{s.device_type} {s.dtype}" for s in kept[key].autocast if s.enabled) or "off"
            call.meta["graphamp"] = NodeInfo(
                reason=f"custom autograd.Function {qualified_name(kept[key].function)}, run whole with "
                f"its own backward under eager's autocast state there ({states})",
            )
            continue
        subs = _subgraphs(gm, node)
        keys = [k for sub in subs for k in _recorded_keys(sub, kept)]
        if not keys:
            continue
        if node.target not in _REGION_OPS or len(subs) != 1:
            name = qualified_name(kept[keys[0]].function)
            raise UnsupportedFunctionError(
                f"graphamp cannot keep the custom autograd.Function {name}: it is called inside "
                f"{node.format_node()}, a higher-order op graphamp does not rewrite. Way out: call it "
                "outside that construct."
            )
        sub = subs[0]
        last = ([n for n in sub.graph.nodes if n.op == "placeholder"] or [None])[-1]
        inner: dict[str, Node] = {}
        for key in dict.fromkeys(keys):
            where = sub.graph.inserting_after(last) if last is not None else sub.graph.inserting_before(next(iter(sub.graph.nodes)))
            with where:
                last = inner[key] = sub.graph.placeholder(f"kept_{len(inner)}")
            inner[key].meta["val"] = kept[key]
            node.args = (*node.args, source(key))
        _bind_in(sub, kept, inner.__getitem__)
        sub.graph.lint()
        sub.recompile()
