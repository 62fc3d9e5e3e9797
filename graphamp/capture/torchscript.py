"""A plain graph of a model that holds TorchScript modules, over the model's own parameters."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from graphamp.eager import RngState
from graphamp.errors import ScriptCaptureError
from graphamp.shared_state import capture_lock
from graphamp.spec import ambient_autocast


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
    rng = RngState()
    try:
        # Unoptimized execution: the optimizing executor runs autodiff subgraphs whose inner ops
        # see detached inputs (their gradient is a C++ node the tracer never records), and its
        # passes insert TorchScript's own autocast ops.
        with (
            _jit_autocast_off(), ambient_autocast(device_type, dtype), warnings.catch_warnings(),
            torch.jit.optimized_execution(False),
        ):
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
        rng.restore()
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
                # A deep-copied ScriptModule's parameters are plain tensors that require grad
                # (TorchScript copies their values, not their Parameter type); they are kept
                # as the model has them, so gradients and optimizers reach the model's own.
                owner._parameters[leaf] = value
            else:
                owner.register_buffer(leaf, value, persistent=id(value) in names)
        node.target = name
    gm = GraphModule(root, traced.graph, class_name=type(model).__name__)
    gm.graph._codegen = _get_codegen(in_spec, out_specs[0])
    gm.recompile()
    return gm


@contextlib.contextmanager
def _jit_autocast_off() -> Iterator[None]:
    """TorchScript's own autocast pass off, a process-wide flag: under the capture lock, so no
    other capture sees it, and restored before the lock is released."""
    with capture_lock():
        previous = torch._C._jit_set_autocast_mode(False)
        try:
            yield
        finally:
            torch._C._jit_set_autocast_mode(previous)
