"""Eager-autocast reference graphs, recorded with ``make_fx``, to compare graphamp against.

Tracing below autocast (post-dispatch ``make_fx``) records every cast eager autocast makes as an
``aten._to_copy``; lowering a converted module the same way (autocast off) gives a comparable graph.
These graphs are for checking only: graphamp itself inserts casts from its own tables.

Also the two runs verify compares: eager autocast and the converted module, on real CPU tensors
or on fake CUDA tensors (see fake_cuda.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx._pytree as fx_pytree
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from graphamp.spec import ambient_autocast
from graphamp.config import Config
from graphamp.eager import inputs_restored, rng_kept
from graphamp.emit import AmpModule
from graphamp.errors import PolicyDriftError
from graphamp.model_binding import FROZEN
from graphamp.runtime import WeightCache
from graphamp.shared_state import capture_lock
from graphamp.spec import AmpSpec
from graphamp.verify.report import _detached
from graphamp.verify.signatures import aten
from graphamp.capture.values import one_fake_mode_while_tracing
from graphamp.verify.fake_cuda import fake_cuda_inputs, fake_cuda_model, fake_cuda_session

__all__ = ["eager_autocast_graph", "lowered_graph", "count_casts", "trace"]


def count_casts(gm: torch.fx.GraphModule) -> int:
    """Number of ``aten._to_copy`` nodes, the op every autocast cast lowers to."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default)


def trace(fn: Any, args: tuple, kwargs: dict, *, no_grad: bool = True) -> torch.fx.GraphModule:
    """The post-dispatch graph of ``fn(*args, **kwargs)``, its tensor inputs as placeholders."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def flat_fn(*vals: torch.Tensor) -> list:
        filled = list(flat)
        for i, v in zip(tensors, vals):
            filled[i] = v
        a, k = pytree.tree_unflatten(filled, spec)
        return pytree.tree_leaves(fn(*a, **k))


    with capture_lock(), torch.set_grad_enabled(not no_grad), one_fake_mode_while_tracing(flat):
        # Real tensors: data-dependent Python branches (mask checks in HF models) read real values.
        return make_fx(flat_fn, _error_on_data_dependent_ops=False)(*[flat[i] for i in tensors])


def eager_autocast_graph(model: nn.Module, args: tuple, kwargs: dict | None, *, device_type: str, dtype: torch.dtype) -> torch.fx.GraphModule:
    """The post-dispatch graph of ``model`` run under eager autocast: its casts are autocast's."""

    def run(*a: Any, **k: Any) -> Any:
        with ambient_autocast(device_type, dtype):
            return model(*a, **k)

    return trace(run, args, kwargs or {})


def lowered_graph(module: nn.Module, args: tuple, kwargs: dict | None) -> torch.fx.GraphModule:
    """The post-dispatch graph of a converted module, with autocast off."""
    return trace(module, args, kwargs or {})


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> GraphModule:
    # Grad mode stays as the caller set it (on): the reference must not take no_grad fast paths.
    return trace(fn, args, kwargs, no_grad=not torch.is_grad_enabled())


def _eager_graph(
    model: nn.Module, args: tuple, kwargs: dict, device_type: str, dtype: torch.dtype, *, cache_enabled: bool = True
) -> GraphModule:
    def run(*a: Any, **k: Any) -> Any:
        with ambient_autocast(device_type, dtype, cache_enabled=cache_enabled):
            return model(*a, **k)

    # Plain eager, as capture traces it (torch.compiler.is_compiling() False inside forward).
    return _trace(run, args, kwargs)


def _lowered_graph(amp: AmpModule, args: tuple, kwargs: dict) -> GraphModule:
    in_spec = amp.graph._codegen.pytree_info.in_spec
    # A warm weight cache hands out earlier casts as constants; a cold call shows every cast.
    for module in amp.modules():
        if isinstance(module, WeightCache):
            module.clear()

    def run(*a: Any, **k: Any) -> Any:
        flat = fx_pytree.tree_flatten_spec((a, k), in_spec)
        # The Interpreter runs node by node, so each lowered op records its converted node in from_node.
        return _CastFrozen(amp).run(*flat, enable_io_processing=False)

    with fx_traceback.preserve_node_meta():
        return _trace(run, args, kwargs)


class _CastFrozen(torch.fx.Interpreter):
    """The converted graph run node by node, each weight ``inference=True`` froze to low precision
    read as the cast it was made by (the model's parameter, cast to the buffer's dtype: the same
    values), so the lowered graph's dtype histories read ``fp32->bf16`` there, as eager's do."""

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().get_attr(target, args, kwargs)
        source = (self.module.__dict__.get(FROZEN) or {}).get(target)
        param = source() if source is not None else None
        return value if param is None else param.to(value.dtype)


def _count_casts(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._to_copy.default)


def _convert(
    model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, device_type: str, mode: str, config: Config | None,
    build: Callable[..., AmpModule] | None,
) -> tuple[AmpModule, list[str]]:
    if build is None:
        raise ValueError("verify's check needs a conversion to check (amp) or the engine to make one (build)")
    spec = AmpSpec(device_type, dtype, mode, config=config or Config())
    try:
        return build(model, args, kwargs, spec), []
    except PolicyDriftError as e:
        # Convert's own check stops at the first drifted node; rebuild without it so the report
        # can say where and how the result differs from eager.
        note = f"graphamp.convert raised PolicyDriftError: {str(e).splitlines()[0][:300]}"
        return build(model, args, kwargs, spec, check=False), [note]


def _uses_real_cuda(model: nn.Module, inputs: Any) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
    return any(t.device.type == "cuda" for t in tensors)


class _Sides(NamedTuple):
    amp: AmpModule
    out: Any
    ref: Any
    graphamp_graph: GraphModule
    eager_graph: GraphModule
    notes: list[str]


def _run_real(
    model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, device_type: str, mode: str, config: Config | None,
    amp: AmpModule | None = None, build: Callable[..., AmpModule] | None = None,
) -> _Sides:
    amp, notes = (amp, []) if amp is not None else _convert(model, args, kwargs, dtype, device_type, mode, config, build)
    cache_enabled = (config or Config()).cache_enabled
    # Same random stream on both sides, so dropout draws the same masks.
    # Each run starts from the same input values (a model may write its inputs in place).
    inputs = (args, kwargs)
    with rng_kept() as start, torch.enable_grad():
        with inputs_restored(inputs), torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled):
            ref = _detached(model(*args, **kwargs))
        start.restore()
        with inputs_restored(inputs):
            out = _detached(amp(*args, **kwargs))
        start.restore()
        with inputs_restored(inputs):
            eager_graph = _eager_graph(model, args, kwargs, device_type, dtype, cache_enabled=cache_enabled)
        start.restore()
        with inputs_restored(inputs):
            graphamp_graph = _lowered_graph(amp, args, kwargs)
    return _Sides(amp, out, ref, graphamp_graph, eager_graph, notes)


def _run_fake_cuda(
    model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, mode: str, config: Config | None,
    build: Callable[..., AmpModule] | None = None,
) -> _Sides:
    with fake_cuda_session(), warnings.catch_warnings():
        # Storage-keyed caches probe data_ptr(), which fake tensors only warn about.
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        fake_model = fake_cuda_model(model)
        fake_args, fake_kwargs = fake_cuda_inputs(args, kwargs)
        amp, notes = _convert(fake_model, fake_args, fake_kwargs, dtype, "cuda", mode, config, build)
        cache_enabled = (config or Config()).cache_enabled
        with ambient_autocast("cuda", dtype, cache_enabled=cache_enabled):
            ref = fake_model(*fake_args, **fake_kwargs)
        out = amp(*fake_args, **fake_kwargs)
        eager_graph = _eager_graph(fake_model, fake_args, fake_kwargs, "cuda", dtype, cache_enabled=cache_enabled)
        graphamp_graph = _lowered_graph(amp, fake_args, fake_kwargs)
    notes.append("values not compared: fake CUDA tensors carry no data; ops, dtypes and shapes were compared")
    return _Sides(amp, out, ref, graphamp_graph, eager_graph, notes)
