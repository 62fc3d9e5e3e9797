"""Re-trace dynamo's torch-level graph to pre-dispatch ATen under autocast, keeping custom
Functions whole and replacing fused inference kernels by their composites (fast_paths.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._ops import _get_dispatch_mode_pre_dispatch
from torch.fx import GraphModule, Interpreter
from torch.fx.experimental.proxy_tensor import make_fx, track_tensor_tree

from graphamp.backend.fast_paths import composite_for, runs_under_autocast
from graphamp.backend.functorch_regions import (
    REGION_STARTS,
    KeptRegion,
    region_module,
    region_nodes,
    run_region,
)
from graphamp.capture.functions import below_tracer
from graphamp.node_info import NodeInfo
from graphamp.policy import Policy
from graphamp.runtime import (
    KeptGraphFunction,
    apply_graph_function,
    current_autocast_state,
)
from graphamp.spec import ambient_autocast

_AUTOGRAD_FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply


_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast


_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def _fake_inputs(gm: GraphModule, example_inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Dynamo's fake mode and the inputs fakified in it, with the symbolic sizes dynamo chose."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    context = torch._guards.TracingContext.try_get()
    placeholders = gm.graph.find_nodes(op="placeholder")
    fakes = []
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor):
            # Dynamo's symbolic context for this tensor keeps its dynamic dims (and their
            # symbols) rather than specializing them to the example's sizes, as AOTAutograd does.
            symbolic = context.tensor_to_context.get(value) if context is not None else None
            source = symbolic.tensor_source if symbolic is not None else None
            fakes.append(fake_mode.from_tensor(value, symbolic_context=symbolic, source=source))
        else:
            # A SymInt input: dynamo's own symbol, which the sizes above refer to.
            fakes.append(node.meta.get("example_value", value))
    return fake_mode, fakes


@dataclasses.dataclass(frozen=True)
class _KeptFunction:
    where: str  # the module that applied it
    untraced_custom_fwd: bool  # a custom_fwd body that dynamo traced with autocast off


class _Retracer(Interpreter):
    """Runs dynamo's graph under make_fx, swapping fused kernels for composites and keeping custom
    ``autograd.Function``\\s whole."""

    def __init__(self, gm: GraphModule, policy: Policy, kept: list[_KeptFunction]) -> None:
        super().__init__(gm)
        self.policy = policy
        self.kept = kept
        self.regions: list[torch.autocast] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "call_function" and n.target in REGION_STARTS:
            with self._set_current_node(n):
                return self.keep_region(n)
        return super().run_node(n)

    def keep_region(self, start: torch.fx.Node) -> None:
        # A torch.vmap (jvp, grad) region: run whole under eager's autocast state here, which AOTAutograd
        # then traces with that state on (functorch_regions.py). Its nodes are not traced here:
        # each gets its value in the environment, so that run() skips it.
        nodes = region_nodes(start)
        body, inputs, outputs = region_module(self.module, nodes)
        states, cache_enabled = current_autocast_state()
        kept = KeptRegion(body, states, cache_enabled)
        operands = [self.env[n] for n in inputs]
        out = _record_kept_call(
            run_region, kept, operands, "_graphamp_region", "functorch_region",
            "torch.vmap/jvp/grad region, run whole under eager's autocast state there",
        )
        for node in nodes[1:]:
            self.env[node] = None
        for node, value in zip(outputs, out):
            self.env[node] = value

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is _ENTER_AUTOCAST:
            # Pre-dispatch tracing records the marker but leaves the autocast state alone (it
            # expects Python's `with torch.autocast` to have set it); replaying a graph, nothing
            # has, so enter the region for real: the values traced inside get its dtypes.
            node = super().call_function(target, args, kwargs)
            region = torch.autocast(*args, **kwargs)
            with torch._C.DisableTorchFunction():
                region.__enter__()
            self.regions.append(region)
            return node
        if target is _EXIT_AUTOCAST:
            node = super().call_function(target, args, kwargs)
            with torch._C.DisableTorchFunction():
                self.regions.pop().__exit__(None, None, None)
            return node
        if target is _AUTOGRAD_FUNCTION_APPLY:
            return self.keep_autograd_function(*args, **kwargs)
        if target is _CHECKPOINT:
            return self.checkpoint(*args)
        if runs_under_autocast(target, self.policy):
            return self.fused_under_autocast(args, kwargs)
        composite = composite_for(target, self.policy)
        if composite is not None:
            return composite(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def fused_under_autocast(self, args: tuple, kwargs: dict) -> Any:
        # The encoder layer's fused kernel, run whole under the policy's autocast as eager runs it
        # (fast_paths.py): one op, which AOTAutograd and inductor keep whole.
        layer = (*args, *kwargs.values())  # the layer passes them positionally, in the schema's order
        return torch.ops.graphamp.encoder_layer_under_autocast(*layer, self.policy.device_type, self.policy.dtype)

    def checkpoint(self, body: GraphModule, *operands: Any) -> Any:
        # torch.utils.checkpoint, either mode: the region's ops are traced in place (graphamp's
        # casts go inside) and tagged for recomputation, as AOTAutograd tags the region itself,
        # so its partitioner recomputes them in backward instead of saving their activations.
        # (A selective-checkpoint context_fn's per-op policy is not reproduced: all recompute.)
        from torch._higher_order_ops.wrap import uid
        from torch.utils.checkpoint import CheckpointPolicy

        body = GraphModule(body, body.graph.__deepcopy__())
        graph_id = next(uid)
        for node in body.graph.nodes:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta["ac_graph_id"] = graph_id
        return _Retracer(body, self.policy, self.kept).run(*operands)

    def keep_autograd_function(self, fwd: GraphModule, bwd: GraphModule, *operands: Any, **kwargs: Any) -> Any:
        # Traced through, the Function's forward would be differentiated by autograd and its own
        # backward lost. Kept as one call, AOTAutograd later traces it as dynamo's own path does:
        # the forward under the autocast state eager has here (recorded now), the backward graph
        # as the Function's gradient.
        self.kept.append(_KeptFunction(_module_of(fx_traceback.get_current_meta()), _is_untraced_custom_fwd(fwd)))
        states, cache_enabled = current_autocast_state()
        kept = KeptGraphFunction(fwd, bwd, kwargs, states, cache_enabled)
        return _record_kept_call(
            apply_graph_function, kept, operands, "_graphamp_function", "autograd_function",
            "custom autograd.Function, run whole with its own backward under eager's autocast state there",
        )


def _module_of(meta: Mapping[str, Any]) -> str:
    stack = meta.get("nn_module_stack")
    if not stack:
        return "the compiled function"
    path, type_ = list(stack.values())[-1]
    type_name = type_ if isinstance(type_, str) else type_.__qualname__
    return f"module {_module_path(path) or '<root>'} ({type_name.rsplit('.', 1)[-1]})"


def _is_untraced_custom_fwd(fwd: GraphModule) -> bool:
    """Whether ``fwd`` runs under ``torch.amp.custom_fwd`` that saw autocast off while dynamo traced.

    Under autocast, custom_fwd leaves an autocast region in the body (and casts with
    ``cast_inputs``); with autocast off it runs the function as is and leaves only its frame in
    the stack traces.
    """
    nodes = [n for n in fwd.graph.nodes if n.op in ("call_function", "call_method")]
    decorated = any("in decorate_fwd" in (n.meta.get("stack_trace") or "") for n in nodes)
    return decorated and not any(n.target is _ENTER_AUTOCAST for n in nodes)


def _warn_untraced_custom_fwd(kept: list[_KeptFunction], policy: Policy, *, ambient: bool) -> None:
    untraced = sorted({f.where for f in kept if f.untraced_custom_fwd})
    if untraced and not ambient:
        warnings.warn(
            f"the custom autograd.Function(s) applied in {', '.join(untraced)} use torch.amp.custom_fwd, "
            "which dynamo traced with autocast off, so their cast_inputs casts and autocast-free "
            "region are not in the graph and autocast applies inside them. Way out: call the "
            f"compiled model inside torch.autocast({policy.device_type!r}, dtype={policy.dtype}); "
            "graphamp's casts stay the only ones applied.",
            stacklevel=3,
        )


def _retrace(gm: GraphModule, example_inputs: Sequence[Any], policy: Policy, *, ambient: bool) -> GraphModule:
    fake_mode, fakes = _fake_inputs(gm, example_inputs)
    kept: list[_KeptFunction] = []

    def run(*args: Any) -> Any:
        # preserve_node_meta carries each dynamo node's nn_module_stack and stack trace to the
        # ATen nodes traced from it, as AOTAutograd does.
        with fx_traceback.preserve_node_meta():
            return _Retracer(gm, policy, kept).run(*args)

    # Under the autocast graphamp reproduces: the nodes' fake values take eager autocast's dtypes
    # (pre-dispatch records ops above the autocast key, so no cast lands in the graph), and code
    # that reads the autocast state while tracing (fused kernels' composites, custom_fwd bodies)
    # behaves as in eager. Attributes of the graph (parameters under inductor's freezing) are real
    # tensors; make_fx keeps them as attributes of the new graph.
    with fake_mode, _allow_real_attributes(fake_mode), ambient_autocast(policy.device_type, policy.dtype):
        amp_gm = make_fx(run, pre_dispatch=True)(*fakes)
    if kept:
        _warn_untraced_custom_fwd(kept, policy, ambient=ambient)
    _copy_dynamo_metadata(gm, amp_gm)
    return amp_gm


@contextlib.contextmanager
def _allow_real_attributes(fake_mode: Any) -> Iterator[None]:
    previous = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = previous


_ROOT = re.compile(r"^L\['[^']+'\]\.?")


def _module_path(path: str) -> str:
    """``L['self'].encoder.layer[0]`` (dynamo's form) -> ``encoder.layer.0`` (export's form)."""
    path = _ROOT.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.replace("._modules.", ".").lstrip(".")


def _copy_dynamo_metadata(gm: GraphModule, amp_gm: GraphModule) -> None:
    """Carry what AOTAutograd reads from a dynamo graph (input sources, static inputs) to the new one."""
    for key in ("dynamo_compile_id", "dynamo_flat_name_to_original_fqn"):
        if key in gm.meta:
            amp_gm.meta[key] = gm.meta[key]
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        # make_fx renamed the graph's attributes (parameters under inductor's freezing); map each
        # new name to the source of the same tensor. Without the map, AOTAutograd treats the graph
        # as an exported one, which is correct too, so a tensor not found just drops the map.
        old_names = {id(t): n for n, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]}
        mapped = {}
        for name, t in [*amp_gm.named_parameters(), *amp_gm.named_buffers()]:
            if old_names.get(id(t)) in sources:
                mapped[name] = sources[old_names[id(t)]]
        if len(mapped) == len([*amp_gm.named_parameters(), *amp_gm.named_buffers()]):
            amp_gm._param_name_to_source = mapped
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), amp_gm.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
        if "tensor_dict" in old.meta:
            new.meta["tensor_dict"] = old.meta["tensor_dict"]
    for node in amp_gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {k: (_module_path(path), type_) for k, (path, type_) in stack.items()}


def _record_kept_call(run: Any, kept: torch.nn.Module, operands: Sequence[Any], qualname: str, node_name: str, reason: str) -> Any:
    """Record ``run(kept, *operands)`` as one node of the graph make_fx is building (``kept`` a
    submodule of it), and return its outputs: fake values with eager's dtypes, from running it
    below the tracer (under autocast, unrecorded)."""
    mode = _get_dispatch_mode_pre_dispatch(torch._C._TorchDispatchModeKey.PROXY)
    with below_tracer():
        out = run(kept, *operands)
    tracer = mode.tracer
    name = tracer.get_fresh_qualname(qualname)
    tracer.root.register_module(name, kept)
    attr = tracer.create_proxy("get_attr", name, (), {})
    attr.node.meta["val"] = kept
    proxy = tracer.create_proxy("call_function", run, (attr, *(tracer.unwrap_proxy(o) for o in operands)), {}, name=node_name)
    proxy.node.meta["graphamp"] = NodeInfo(reason=reason)
    return track_tensor_tree(out, proxy, constant=None, tracer=tracer)
