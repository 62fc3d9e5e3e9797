"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models, converted unit by unit.

FSDP2 gathers a unit's parameters in a forward pre-hook and frees them in a forward hook, and
reduce-scatters its gradients from autograd hooks on the unit's inputs and outputs. One graph for
the whole model would bypass all of them. So each sharded unit (every module ``fully_shard`` was
applied to) is converted on its own, with its parameters unsharded so that capture sees plain
tensors, and with each nested unit's call kept as one opaque node of its graph. At run time that
node calls the nested unit *as a module*, so FSDP's hooks run as usual, with the unit's
``forward`` bound to its converted graph for the duration of the call; the graph reads the
unit's parameters at call time, after the pre-hook gathered them. Eager autocast's casts are
local to each op, so the units' graphs together compute what eager autocast + FSDP2 computes.

``graphamp.convert`` and ``graphamp.TrainStep`` dispatch here when the model holds a sharded unit.
What this does not support is refused before anything is captured or gathered, on every rank alike,
with :class:`graphamp.UnsupportedShardingError`: ``compile=True``, a unit's non-default
``MixedPrecisionPolicy``, activation checkpointing in the sharded model. The self-check of a model
converted this way is :mod:`graphamp.integrations.fsdp_self_check`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from graphamp.errors import CaptureError, GraphampError, InputMismatchError, UnitInputError, UnsupportedShardingError
from graphamp.probe import attribute_bound
from graphamp.spec import AmpSpec
from graphamp.eager import state_restored
from graphamp.integrations.fsdp_self_check import self_check
from graphamp.node_info import GraphInfo, graph_info, peek, peek_graph_info
from graphamp.runtime import KeptFunction, apply_function
from graphamp.spec import ambient_autocast

__all__ = ["FsdpUnitCall", "UnitInputError", "convert_sharded", "is_sharded", "refuse_compile", "self_check", "sharded_after_conversion", "sharded_units"]

_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"
# Activation checkpointing's module wrappers (checkpoint_wrapper, offload_wrapper) and the registry
# of composable APIs (torch.distributed._composable.checkpoint): none is in use unless imported.
_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_COMPOSABLE_CONTRACT = "torch.distributed._composable.contract"
# Set while the units are being converted: the engine converts each unit as a plain module then, and
# each nested unit's call is recorded as one node instead of running.
_CONVERTING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphamp_fsdp_converting", default=False)
# Set while a converted graph runs on its example: each nested unit records the inputs it gets.
_RECORDING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphamp_fsdp_recording", default=False)


def _fsdp_module_class() -> type | None:
    # Nothing is sharded unless fully_shard was imported; a plain conversion imports nothing here.
    module = sys.modules.get(_FULLY_SHARD)
    return None if module is None else module.FSDPModule


def sharded_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``fully_shard`` was applied to, with their paths, in
    ``named_modules`` order (a unit before the units inside it)."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return []
    return [(path, m) for path, m in model.named_modules() if isinstance(m, fsdp_module)]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``graphamp.convert`` must convert ``model`` unit by unit (it holds an FSDP2 unit)."""
    return not _CONVERTING.get() and bool(sharded_units(model))


class _Unit:
    """One sharded unit and its converted graph; the kept node of the enclosing graph calls it."""

    def __init__(self, path: str, module: nn.Module) -> None:
        self.path = path
        self.module = module
        self.amp: nn.Module | None = None
        self.out_spec: pytree.TreeSpec | None = None  # the forward's output structure (set at capture)
        self.example: tuple[tuple, dict] | None = None  # its inputs on the example (during conversion)
        self.links: list[tuple[nn.Module, str, nn.Module]] = []

    def __deepcopy__(self, memo: dict) -> _Unit:
        return self  # the unit is the model's own module, shared as its parameters are

    def __reduce__(self) -> tuple:
        raise GraphampError(
            f"a module graphamp converted unit by unit for FSDP cannot be saved (it calls the sharded "
            f"unit {self.path or '<root>'} of the live model). Way out: save the model's state_dict "
            "(FSDP's distributed checkpoint) and convert again after loading."
        )

    def __repr__(self) -> str:
        return f"<FSDP unit {self.path or '<root>'}: {type(self.module).__name__}>"

    def bind(self, amp: nn.Module, nested: list[_Unit]) -> None:
        """Use ``amp`` as this unit's forward; it reads the unit's own parameters (not the nested
        units') from the unit at each call."""
        inner = {id(p) for unit in nested for p in unit.module.parameters()}
        self.links = []
        for path, param in self.module.named_parameters():
            if id(param) in inner:
                continue
            prefix, _, name = path.rpartition(".")
            try:
                mine = amp.get_submodule(prefix)
            except AttributeError:
                continue
            if name in mine._parameters:
                self.links.append((mine, name, self.module.get_submodule(prefix)))
        # The unit amp must not convert itself again from the unit in the middle of FSDP's
        # forward (shape classes, modes), nor compare its parameters with the sharded ones.
        amp.__dict__.pop("_graphamp_model", None)
        amp.__dict__.pop("_graphamp_model_state", None)
        self.amp = amp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The unit's forward while its enclosing graph calls it: its converted graph, on the
        parameters FSDP's pre-forward hook has just gathered."""
        # The mode is the enclosing converted module's choice: it converted these units in it.
        amp = self.amp
        for mine, name, owner in self.links:
            mine._parameters[name] = owner._parameters[name]
        # FSDP frees the gathered parameters' storage after each use and refills it in place;
        # whether that bumps their versions depends on its copy-in path: no weight copy outlives a call.
        amp.refresh()
        try:
            return amp(*args, **kwargs)
        except UnitInputError:
            raise  # a unit inside this one refused its inputs: said once
        except InputMismatchError as e:
            # Not the shape-class or structure subtype, which the enclosing converted module would
            # answer by converting the sharded model again, here, on this rank alone: conversion
            # gathers parameters, a collective the other ranks (in their forward or backward) do
            # not take part in at this point.
            reason = str(e).split(" This module cannot convert again")[0]  # it cannot: see above
            raise UnitInputError(
                f"the FSDP unit {self.path or '<root>'} ({type(self.module).__name__}) was converted for the "
                "inputs its enclosing graph passed it on the example, and these need another conversion (other "
                f"sizes or structure), which cannot run inside FSDP's forward, nor on one rank alone: {reason} Way "
                "out: pad inputs to the example's sizes, convert again (on every rank) with an example like "
                "these inputs, or torch.compile(model, backend=\"graphamp\")."
            ) from e

    def call(self, spec: pytree.TreeSpec, leaves: tuple) -> tuple:
        """Call the unit as a module (FSDP's hooks run), its forward bound to its graph."""
        args, kwargs = pytree.tree_unflatten(list(leaves), spec)
        with _forward_bound(self.module, self.forward):
            out = self.module(*args, **kwargs)
        flat, out_spec = pytree.tree_flatten(out)
        if out_spec != self.out_spec:
            raise InputMismatchError(
                f"the FSDP unit {self.path or '<root>'} returned a different structure than when it was "
                f"converted: {out_spec} vs {self.out_spec}. Way out: convert again with inputs like these."
            )
        return tuple(flat)


class FsdpUnitCall(torch.autograd.Function):
    """The call of a nested sharded unit, recorded as one node while its enclosing unit is captured.

    Capture keeps a custom Function whole (``graphamp.capture.functions``): its forward runs on fake
    tensors under eager's autocast state, which gives the node eager's output dtypes, and the
    graph calls ``apply`` at run time, which here calls the unit as a module.
    """

    @staticmethod
    def forward(ctx: Any, unit: _Unit, spec: pytree.TreeSpec, *leaves: Any) -> tuple:
        args, kwargs = pytree.tree_unflatten(list(leaves), spec)
        if _RECORDING.get() and unit.example is None:
            unit.example = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        module = unit.module
        out = type(module).forward(module, *args, **kwargs)  # the model's own forward, no hooks
        flat, unit.out_spec = pytree.tree_flatten(out)
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # never runs: at run time the unit itself is called
        raise RuntimeError("FsdpUnitCall is only recorded, never differentiated")

    @classmethod
    def apply(cls, unit: _Unit, spec: pytree.TreeSpec, *leaves: Any) -> tuple:  # type: ignore[override]
        if _CONVERTING.get():
            return super().apply(unit, spec, *leaves)
        return unit.call(spec, leaves)


def _stub(unit: _Unit, *args: Any, **kwargs: Any) -> Any:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    flat = FsdpUnitCall.apply(unit, spec, *leaves)
    return pytree.tree_unflatten(list(flat), unit.out_spec)


def _forward_bound(module: nn.Module, forward: Any) -> contextlib.AbstractContextManager:
    """``module.forward`` is ``forward`` for the duration (an instance attribute shadows the class's)."""
    return attribute_bound(module, "forward", forward)


@contextlib.contextmanager
def _stubbed(units: list[_Unit]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for unit in units:
            # Named as the model's forward, so that the captured graph's inputs are named as its arguments.
            stub = functools.wraps(unit.module.forward)(functools.partial(_stub, unit))
            stack.enter_context(_forward_bound(unit.module, stub))
        yield


@contextlib.contextmanager
def _fsdp_hooks_off(units: list[nn.Module]) -> Iterator[None]:
    """FSDP's forward hooks and its state_dict pre-hooks (which reshard; conversion reads the
    state_dict) are not called for the duration: the parameters are unsharded already, and capture
    runs on fake tensors. Other hooks stay."""
    found = []
    for module in units:
        state = module._get_fsdp_state()
        found += [(module._forward_pre_hooks, state._pre_forward_hook_handle),
                  (module._forward_hooks, state._post_forward_hook_handle)]
        for group in state._fsdp_param_groups:
            found += [(m._state_dict_pre_hooks, h) for m, h in group._module_to_pre_save_state_dict_hook_handle.items()]
    saved = []
    for table, handle in found:
        if handle is not None and handle.id in table:
            saved.append((table, list(table.items())))
            del table[handle.id]
    try:
        yield
    finally:
        for table, items in reversed(saved):
            table.clear()
            table.update(items)


@contextlib.contextmanager
def _converting() -> Iterator[None]:
    token = _CONVERTING.set(True)
    try:
        yield
    finally:
        _CONVERTING.reset(token)


def _nested(module: nn.Module, units: dict[int, _Unit], *, include_self: bool = False) -> list[_Unit]:
    """The units nearest below ``module`` (itself, with ``include_self``, if it is one)."""
    if include_self and id(module) in units:
        return [units[id(module)]]
    found = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if id(child) in units:
                found.append(units[id(child)])
            else:
                walk(child)

    walk(module)
    return found


def _paths(paths: list[str], limit: int = 4) -> str:
    shown = [path or "<root>" for path in paths[:limit]]
    return ", ".join(shown) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def refuse_compile(model: nn.Module, caller: str) -> None:
    """Raise :class:`UnsupportedShardingError` if ``model`` holds FSDP2 units: ``caller``
    (``graphamp.convert`` or ``graphamp.TrainStep``) was asked for ``compile=True``, which a model
    converted unit by unit does not support. Called before anything is converted."""
    named = sharded_units(model)
    if named:
        raise UnsupportedShardingError(
            f"{caller}(compile=True) does not support a model sharded with FSDP's fully_shard (the FSDP units "
            f"{_paths([path for path, _ in named])}): graphamp converts such a model unit by unit and calls each "
            "unit through FSDP's hooks, which gather and reduce-scatter around the unit's graph, and neither "
            "compiles that program nor checks a compiled one against eager autocast + FSDP2. "
            f"Way out: {caller}(...) without compile=True: each unit's graph runs uncompiled, bitwise equal "
            "to eager torch.autocast + FSDP2."
        )


def _check_mixed_precision(units: list[tuple[str, nn.Module]]) -> None:
    """Refuse a unit sharded with a ``MixedPrecisionPolicy`` other than FSDP's default (which casts nothing)."""
    for path, module in units:
        policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
        if policy is None or not dataclasses.is_dataclass(policy):
            continue
        default = type(policy)()
        changed = [f"{f.name}={getattr(policy, f.name)}" for f in dataclasses.fields(policy) if getattr(policy, f.name) != getattr(default, f.name)]
        if changed:
            raise UnsupportedShardingError(
                f"graphamp does not convert the FSDP unit {path or '<root>'} ({type(module).__name__}), sharded "
                f"with mp_policy=MixedPrecisionPolicy({', '.join(changed)}): FSDP would then cast the unit's "
                "parameters, inputs, outputs or gradient reductions itself, around the graph in which graphamp "
                "already applies autocast's precision op by op; the graph is converted for the dtypes FSDP gives "
                "it at conversion, and the two casts together are not eager autocast's program. Way out: shard "
                "without mp_policy (fully_shard(module), FSDP's default MixedPrecisionPolicy()): graphamp applies "
                "autocast's precision itself, and FSDP then gathers and reduces in the parameters' dtype, as "
                "eager torch.autocast + FSDP2 does."
            )


def _checkpointed(model: nn.Module) -> list[tuple[str, str]]:
    """The modules of ``model`` with activation checkpointing, with their paths and how it is applied:
    ``checkpoint_wrapper``'s (or ``offload_wrapper``'s) modules, the composable
    ``torch.distributed._composable.checkpoint``, and Hugging Face's ``gradient_checkpointing_enable()``
    (the innermost flagged modules in training mode, where transformers calls torch.utils.checkpoint)."""
    wrappers = sys.modules.get(_CHECKPOINT_WRAPPER)
    wrapper = getattr(wrappers, "ActivationWrapper", None)
    contract = sys.modules.get(_COMPOSABLE_CONTRACT)
    registry = getattr(contract, "_get_registry", None)
    found = []
    flagged = []
    for path, m in model.named_modules():
        if wrapper is not None and isinstance(m, wrapper):
            kind = next((c.__name__ for c in type(m).__mro__ if c.__module__ == _CHECKPOINT_WRAPPER), type(m).__name__)
            found.append((path, f"{kind}, from torch.distributed.algorithms's checkpoint_wrapper"))
        elif registry is not None and "checkpoint" in (registry(m) or {}):
            found.append((path, "torch.distributed._composable.checkpoint"))
        elif m.training and getattr(m, "gradient_checkpointing", False) is True:
            flagged.append(path)
    # Hugging Face flags the model and its layers alike; older versions checkpoint the layers from
    # the model's loop, newer ones in each layer's call: the innermost flagged modules checkpoint.
    innermost = [p for p in flagged if not any(q != p and (p == "" or q.startswith(p + ".")) for q in flagged)]
    found += [(path, "gradient_checkpointing, Hugging Face's gradient_checkpointing_enable()") for path in innermost]
    return found


def _check_checkpointing(model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """Refuse activation checkpointing anywhere in a sharded model, naming the unit it is in."""
    found = _checkpointed(model)
    if not found:
        return

    def unit_of(path: str) -> str | None:
        owners = [u for u, _ in units if u == "" or path == u or path.startswith(u + ".")]
        return max(owners, key=len) if owners else None

    described = []
    for path, kind in found[:3]:
        unit = unit_of(path)
        if unit is None:
            where = "outside every FSDP unit"
        else:
            where = f"{'on' if unit == path else 'in'} the FSDP unit {unit or '<root>'}{' itself' if unit == path else ''}"
        described.append(f"{path or '<root>'} ({kind}) {where}")
    more = f", and {len(found) - 3} more" if len(found) > 3 else ""
    raise UnsupportedShardingError(
        f"graphamp does not convert a sharded model with activation checkpointing: {'; '.join(described)}{more}. "
        "graphamp captures each FSDP unit's forward as one graph: a non-reentrant checkpoint inside it (the "
        "default of checkpoint_wrapper, of the composable checkpoint and of transformers) is traced through, "
        "so nothing is recomputed and no memory is saved; a checkpoint around a unit recomputes the unit's "
        "eager forward, not its graph, for the tensors the graph saved; and no recompute under FSDP is "
        "checked against eager autocast + FSDP2. Way out: convert the model "
        "without activation checkpointing (build it without checkpoint_wrapper, checkpoint(...) or "
        "gradient_checkpointing_enable()), or keep the checkpointing and train it with eager "
        "torch.autocast + FSDP2, outside graphamp."
    )


def _check_units(units: list[tuple[str, nn.Module]]) -> None:
    for path, module in units:
        state = module._get_fsdp_state()
        if len(getattr(state, "_modules", (module,))) > 1:
            raise CaptureError(
                f"graphamp converts each FSDP unit on its own, but {path or '<root>'} was sharded together "
                "with other modules (fully_shard([a, b, ...])), whose forwards FSDP's hooks treat as one. "
                "Way out: fully_shard each module on its own, or torch.compile(model, backend=\"graphamp\")."
            )


def _record_nested(amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Run ``amp`` once on its example, so that each nested unit it calls records its inputs: what
    that unit's graph will get from this graph (not from eager, whose path may differ from the
    traced one: Hugging Face builds an explicit attention mask when traced, none in eager SDPA).
    Nested units run their own eager forward under eager's autocast state there; the model's
    buffers and the random state are restored after."""
    token = _RECORDING.set(True)
    try:
        with state_restored(model), torch.no_grad():
            amp(*args, **kwargs)
    finally:
        _RECORDING.reset(token)


def _eager_inputs(model: nn.Module, units: list[nn.Module], args: tuple, kwargs: dict, spec: AmpSpec) -> dict[int, tuple]:
    """Each unit's inputs in one eager autocast forward of the example (with FSDP's hooks); the
    model's buffers and the random state are restored after."""
    seen: dict[int, tuple] = {}

    def record(module: nn.Module, a: tuple, kw: dict) -> None:
        if id(module) not in seen:
            seen[id(module)] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (a, kw))

    # Registered after FSDP's pre-hook (which is prepended): the inputs as the forward sees them.
    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in units]
    try:
        with state_restored(model), torch.no_grad(), ambient_autocast(spec.device_type, spec.dtype):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@contextlib.contextmanager
def _eager_view(module: nn.Module, eager: tuple[tuple, dict] | None) -> Iterator[None]:
    """While ``module`` is converted, the runs that observe eager (not the capture, which runs on
    fake tensors) see the inputs eager autocast gave it, where its graph gets what its enclosing
    graph passes: graphamp follows eager's attention program from that observation (a traced
    Hugging Face decoder passes each layer an explicit causal mask where eager SDPA passes None and
    groups the key/value heads inside SDPA, which rounds their gradients differently)."""
    if eager is None:
        yield
        return
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(t, FakeTensor) for t in pytree.tree_leaves((args, kwargs))):
            args, kwargs = eager
        return original(*args, **kwargs)

    with _forward_bound(module, functools.wraps(original)(forward)):
        yield


def convert_sharded(
    model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, *, check: bool | None = None,
    build: Callable[..., nn.Module],
) -> nn.Module:
    """Convert a model holding FSDP2 units: ``model`` with its outermost units as nested calls,
    then each unit on its own, outer units first, each with the inputs its enclosing graph passes
    it on the example. Returns ``model``'s converted module (an AmpModule); its parameters are the
    model's (sharded) parameters.

    Every rank must call this together: it runs the example once eagerly (FSDP all-gathers), and
    gathers every unit's parameters for the capture and for one run of each graph on its example,
    then frees them again.
    """
    named = sharded_units(model)
    # Refused before any capture or collective: every rank refuses alike, none waits for the others.
    _check_units(named)
    _check_mixed_precision(named)
    _check_checkpointing(model, named)
    modules = [m for _, m in named]
    units = {id(m): _Unit(path, m) for path, m in named}
    with torch.no_grad():  # the all-gathers' copies need no autograd record
        eager = _eager_inputs(model, modules, args, kwargs, spec)
        for m in modules:
            m.unshard()
    try:
        with _fsdp_hooks_off(modules), _converting():
            with _stubbed(_nested(model, units, include_self=True)):
                top = build(model, args, kwargs, spec, check=check)
            _describe_unit_calls(top)
            _record_nested(top, model, args, kwargs)
            for _, m in named:  # a unit before the units inside it
                unit = units[id(m)]
                if unit.example is None:
                    raise CaptureError(
                        f"the FSDP unit {unit.path or '<root>'} ({type(m).__name__}) did not run in the example's "
                        "forward, so graphamp has no example of its inputs to convert it with. Way out: pass an "
                        "example that runs every sharded module, or torch.compile(model, backend=\"graphamp\")."
                    )
                unit_args, unit_kwargs = unit.example
                nested = _nested(m, units)
                try:
                    with _stubbed(nested), _eager_view(m, eager.get(id(m))):
                        amp = build(m, unit_args, unit_kwargs, spec, check=check)
                except GraphampError as e:
                    raise _in_unit(e, unit) from e
                _describe_unit_calls(amp)
                if nested:
                    _record_nested(amp, m, unit_args, unit_kwargs)
                unit.bind(amp, nested)
                unit.example = None  # the tensors are not kept
    finally:
        for m in modules:
            m.reshard()
    _share_sharded_parameters(top, model)
    graph_info(top).fsdp_units = [unit.path for unit in units.values()]
    return top


def _describe_unit_calls(amp: nn.Module) -> None:
    """Say in each nested unit's node what it is (capture recorded it as a kept Function)."""
    for node in amp.graph.find_nodes(op="call_function", target=apply_function):
        kept = getattr(amp, node.args[0].target, None) if node.args and hasattr(node.args[0], "target") else None
        record = peek(node)
        if isinstance(kept, KeptFunction) and kept.function is FsdpUnitCall and record is not None:
            unit = kept.template[0][0]
            record.reason = (
                f"the FSDP unit {unit.path or '<root>'} ({type(unit.module).__name__}), called as a module so that "
                "FSDP's hooks gather its parameters and reduce-scatter its gradients; its forward runs its own graph"
            )


def _in_unit(error: GraphampError, unit: _Unit) -> GraphampError:
    where = f"the FSDP unit {unit.path or '<root>'} ({type(unit.module).__name__})"
    message = (
        f"graphamp converts a sharded model unit by unit, and converting {where} failed: {error} "
        "Way out for the sharded model: torch.compile(model, backend=\"graphamp\")."
    )
    try:
        return type(error)(message)
    except TypeError:
        return CaptureError(message)


def _share_sharded_parameters(amp: nn.Module, model: nn.Module) -> None:
    """The converted module lists the model's parameters as they are outside a forward (sharded),
    as the optimizer holds them; its graph reads none of them (the units' graphs do)."""
    for path, param in model.named_parameters():
        prefix, _, name = path.rpartition(".")
        try:
            owner = amp.get_submodule(prefix)
        except AttributeError:
            continue
        if name in owner._parameters:
            owner._parameters[name] = param
    # Outside a forward FSDP holds the sharded parameters, inside it the gathered ones; the check
    # that the model still holds the graph's parameters does not apply (see sharded_after_conversion).
    amp.__dict__.pop("_graphamp_model_state", None)


def sharded_after_conversion(amp: nn.Module) -> str | None:
    """Why ``amp`` must not run: its model was sharded with ``fully_shard`` after ``graphamp.convert``
    converted it (the graph reads the parameters from before sharding, so it would train nothing
    and reduce no gradient); None if it may run. Cheap: no parameter is compared."""
    if (peek_graph_info(amp) or GraphInfo()).fsdp_units is not None:
        return None
    model = amp.__dict__.get("_graphamp_model")
    if model is None or not sharded_units(model):
        return None
    paths = [path or "<root>" for path, _ in sharded_units(model)]
    return (
        f"{type(model).__name__} was sharded with FSDP's fully_shard ({', '.join(paths[:4])}"
        f"{' ...' if len(paths) > 4 else ''}) after graphamp converted it: the converted graph reads the "
        "parameters from before sharding, so it would train nothing and reduce no gradient. Way out: shard "
        "first, then convert (graphamp.convert or graphamp.TrainStep on the sharded model), or "
        "torch.compile(model, backend=\"graphamp\")."
    )
