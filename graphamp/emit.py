"""The module graphamp returns: a GraphModule with explicit casts and no runtime autocast.

Beside it: what it fixes and checks about its inputs (:mod:`graphamp.inputs`), how it holds its
model's state (:mod:`graphamp.model_binding`), what it records about its conversion
(:mod:`graphamp.conversion_info`), and the compile-time half of saving it (:mod:`graphamp.saving`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import dataclasses
import importlib
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.fx import GraphModule
from torch.fx.graph_module import _forward_from_src

from graphamp.conversion_info import AmpInfo, SelfCheck
from graphamp.errors import InputMismatchError, InputShapeError, InputStructureError, InputValueError, PolicyDriftError, ModelMethodError
from graphamp.spec import AmpSpec, autocast_off
from graphamp.passes.cache_weights import WEIGHT_CACHE
from graphamp.passes.graph_edit import attr_of, cast_source, tensor_dtype
from graphamp.node_info import GRAPHAMP, GraphInfo, NodeInfo, peek, peek_graph_info
from graphamp.policy import short_dtype
from graphamp.codegen import bindings_of, eager_body, hoist_state_reads
from graphamp.model_state import ModelState
from graphamp.model_binding import FROZEN, FROZEN_VERSIONS, follow_replaced_buffers, graph_reads, in_model_order, recast_frozen, share_state, signed_forward, take_frozen_versions, training_as
from graphamp.eager import difference_without, inputs_copied
from graphamp.runtime_guards import traced
from graphamp.shared_state import in_capture
from graphamp.inputs import (  # is_all_ones too: graphamp.pipeline imports it from here
    ALL_ONES_AS_NONE, ALL_ONES_PROVEN, MAX_ALL_ONES_PROVEN, all_ones_key, describe_signature, input_guard, input_signature,
    CACHE_WAY_OUT, is_all_ones, key_value_cache, plain_arity,
)
from graphamp.runtime import AmpTracer, cached_cast, read_state, rebuild_amp_module, restored_on_refusal
from graphamp.runtime_saved import MODEL, NODE_META, node_meta_record
from graphamp.saving import meta_from_saved, picklable, saved_info, saved_meta

__all__ = ["AmpModule", "AmpInfo", "SelfCheck", "emit", "input_signature", "describe_signature"]

_GUARD = "_graphamp_guard"
_TRACEABLE = "_graphamp_traceable"  # the forward dynamo traces (recompile)
_GRAPH = "_graphamp_graph"  # the class attribute holding the generated code (recompile)
_BUILDING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphamp_emit_building", default=False)
_VARIANTS = "_graphamp_variants"  # the modules converted for other shape classes, in order
_MODES = "_graphamp_modes"  # the modules converted for another training mode, or for calls without grad
_MODEL_STATE = "_graphamp_model_state"  # a ModelState: what the model held at conversion
# The engine that converts the model again (emit's ``engine``); saved by its qualified name.
ENGINE = "_graphamp_engine"
_ENGINE_MODULE, _ENGINE_NAME = "graphamp.pipeline", "reconvert"
# How many other shape classes one converted module converts for before it refuses: each holds a
# graph and costs a conversion (seconds), so inputs of ever new shapes should be padded instead.
MAX_SHAPE_CLASSES = 8
# Inputs a graph refuses but a conversion of their own may take: another shape class, or another
# structure or non-tensor value (HF Trainer adds loss kwargs such as num_items_in_batch).
_CONVERTIBLE = (InputShapeError, InputStructureError, InputValueError)
# The model's methods an AmpModule passes through: they read or write the shared parameters and the
# config, and never run the model's forward (HF PreTrainedModel's, as HF Trainer calls them).
PASSED_METHODS = frozenset({
    "save_pretrained", "push_to_hub", "get_input_embeddings", "get_output_embeddings", "num_parameters",
    "floating_point_ops", "estimate_tokens", "get_memory_footprint",
})
_log = logging.getLogger("graphamp")
# One lock per converted module, under which it converts itself again, so that threads calling it
# with inputs of one new class convert once. Per module, not process-wide: converting again checks
# the new variant by calling it, which converts that variant again for calls without grad (under
# the variant's own lock) while this one is held. Re-entrant: a model whose forward calls its own
# converted module re-enters on one thread and recurses instead of waiting on itself.
_RECONVERSION_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _reconversion_lock(module: nn.Module) -> contextlib.AbstractContextManager:
    """``module``'s re-conversion lock; none inside a capture, which holds the process-wide capture
    lock that every re-conversion takes after this one (so waiting here could wait for ever)."""
    if in_capture():
        return contextlib.nullcontext()
    with _LOCKS_LOCK:
        lock = _RECONVERSION_LOCKS.get(module)
        if lock is None:
            lock = _RECONVERSION_LOCKS[module] = threading.RLock()
    return lock


class AmpModule(GraphModule):
    """A model converted by :func:`graphamp.convert`.

    Its graph (``print(m.code)``) holds every cast explicitly, so it runs with no runtime autocast;
    an ambient ``torch.autocast`` around a call is switched off for the policy's device so the
    policy is never applied twice. Parameters and buffers are the original model's objects.

    Inputs whose sizes the graph does not hold (a size the capture made static, a range or a
    condition such as ``batch != 1`` the model's code imposes) get a conversion of their own on
    first use, kept per shape class (at most ``MAX_SHAPE_CLASSES``, each logged on the "graphamp"
    logger); it shares the parameters. For that the module keeps a reference to its model, which
    ``torch.save`` writes along when it pickles. Another dtype, rank or input structure stays an
    :class:`~graphamp.InputMismatchError`.

    >>> import torch, graphamp
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> amp = graphamp.convert(model, (torch.randn(2, 4),))
    >>> assert amp.get_parameter("0.weight") is model[0].weight
    >>> assert amp.cast_summary()["by_dtype"] == {"fp32->bf16": 3}   # input, weight, bias
    >>> assert amp(torch.randn(5, 4)).dtype is torch.bfloat16
    """

    __module__ = "graphamp"  # its public path, as numpy's set_module does

    @property
    def graphamp_info(self) -> AmpInfo:
        return self.__dict__["_graphamp"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module's call (hooks), whose forward is the dispatch below; FX's wrapped call would
        # reach the generated code directly.
        return nn.Module.__call__(self, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward: the graph converted for the module's mode (``train()`` /
        ``eval()``), grad mode where eager's program depends on it, and these inputs' shape class
        and structure, converting one on first use. Takes the model's arguments; each converted
        module's class shows the model's signature (``inspect.signature(amp.forward)``)."""
        if traced():
            return self._call_graph(args, kwargs)
        self._check_parameters()
        names = self.__dict__.get(ALL_ONES_AS_NONE)
        if names:
            kwargs = self._all_ones_dropped(args, kwargs, names)
        try:
            return self._for_mode(args, kwargs)._call_classes(args, kwargs)
        except RuntimeError as e:  # where the model's tensors changed dtype, say so
            state = self.__dict__.get(_MODEL_STATE)
            refusal = state and state.retyped_refusal(self.__dict__.get(MODEL), e)
            if refusal:
                raise refusal from e
            raise

    def _all_ones_dropped(self, args: tuple, kwargs: dict, names: tuple[str, ...]) -> dict:
        """``kwargs`` with its all-ones masks among ``names`` passed as None where eager autocast
        runs the same program for them as without them, at these masks' shapes and this training
        mode: proven on the example by convert's self-check, and for any other shape checked once
        on first use, running eager both ways. Elsewhere the masks are passed as given, and the
        call gets a graph converted with them (checked in turn): the example's finding is never
        extrapolated to inputs it was not seen to hold for."""
        key = all_ones_key(kwargs, names, self.training)
        if key is None:
            return kwargs
        proven = self.__dict__.setdefault(ALL_ONES_PROVEN, {})
        verdict = proven.get(key)
        if verdict is None:
            model = self.__dict__.get(MODEL)
            if model is None or len(proven) >= MAX_ALL_ONES_PROVEN:
                return kwargs
            with _reconversion_lock(self):
                verdict = proven.get(key)
                if verdict is None:
                    verdict = proven[key] = self._eager_drops(model, args, kwargs, tuple(k for k, _ in key[1]))
        return {**kwargs, **dict.fromkeys(name for name, _ in key[1])} if verdict else kwargs

    def _eager_drops(self, model: nn.Module, args: tuple, kwargs: dict, names: tuple[str, ...]) -> bool:
        """Whether eager autocast gives the same outputs (and, in training, gradients) with these
        all-ones masks as with None for them."""
        info = self.graphamp_info
        grads = self.training and not info.inference and torch.is_grad_enabled()
        with training_as(model, self.training):
            problem = difference_without(model, args, kwargs, names, info.spec(), grads=grads)
        if problem:
            _log.info(
                "graphamp: %s keeps an all-ones %s at these shapes (%s): converting with it", type(model).__name__,
                ", ".join(names), problem,
            )
        return not problem

    def _call_classes(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self._call_graph(args, kwargs)
        except _CONVERTIBLE as e:
            return self._call_shape_class(e, args, kwargs)

    def _for_mode(self, args: tuple, kwargs: dict) -> AmpModule:
        """This module, or the one converted for the current training mode and, where eager's
        program differs without grad (nn.TransformerEncoderLayer's fused kernel), grad mode."""
        info = self.__dict__.get("_graphamp")
        if info is None:
            return self
        training = self.training
        base = self if training == info.training else self._mode_variant((training, False), args, kwargs)
        if not info.inference and not info.no_grad and (peek_graph_info(base) or GraphInfo()).fused_without_grad and not _needs_grad(self, args, kwargs):
            return self._mode_variant((training, True), args, kwargs)
        return base

    def _mode_variant(self, key: tuple[bool, bool], args: tuple, kwargs: dict) -> AmpModule:
        modes = self.__dict__.setdefault(_MODES, {})
        variant = modes.get(key)
        if variant is None:
            with _reconversion_lock(self):
                variant = modes.get(key)
                if variant is None:
                    variant = modes[key] = self._converted_as(*key, args, kwargs)
        return variant

    def _converted_as(self, training: bool, no_grad: bool, args: tuple, kwargs: dict) -> AmpModule:
        """The model converted again in another training mode, or for calls without grad."""
        model = self.__dict__.get(MODEL)
        mode = ("training" if training else "eval") + (" without grad" if no_grad else "")
        if model is None:
            raise InputMismatchError(
                f"this module was converted in {'training' if self.graphamp_info.training else 'eval'} mode and is "
                f"called in {mode} mode, whose graph it cannot convert: it holds no reference to its model (saved by "
                "an older graphamp, or the model could not be pickled with it). Way out: call "
                f"model.{'train' if training else 'eval'}() on the original model and graphamp.convert it again."
            )
        spec = dataclasses.replace(self.graphamp_info.spec(), no_grad=no_grad)
        variant = self._converted(model, spec, training, args, kwargs, f"{mode} mode")
        _log.info("graphamp converted %s again for %s mode", type(model).__name__, mode)
        return variant

    def _converted(
        self, model: nn.Module, spec: AmpSpec, training: bool, args: tuple, kwargs: dict, what: str, refused: str = "",
        error: type[Exception] = InputShapeError,
    ) -> AmpModule:
        """``model`` converted with ``spec`` in the given training mode by the engine this module was
        emitted with, checked as convert checked this module (raising, or warning where convert
        warned); a conversion that fails is ``error``, naming ``what`` it was for."""
        # Captured in the grad mode its calls run in: the model's code may read it. On a copy of the
        # call's inputs, which the call itself then takes (a model may write its inputs in place).
        args, kwargs = inputs_copied((args, kwargs))
        with training_as(model, training), torch.inference_mode(False), torch.set_grad_enabled(not spec.no_grad):
            try:
                return self._engine()(model, args, kwargs, spec, (peek_graph_info(self) or GraphInfo()).self_check)
            except PolicyDriftError:
                raise
            except Exception as failure:
                raise error(
                    f"{refused}Converting {type(model).__name__} again for {what} failed: {type(failure).__name__}: "
                    f"{str(failure).strip().splitlines()[0][:300]} Way out: check that the model runs eagerly on "
                    "these inputs, in this mode."
                ) from failure

    def _engine(self) -> Callable[..., AmpModule]:
        """What converts this module's model again: the engine ``emit`` was handed
        (``graphamp.pipeline.reconvert``); a loaded module finds it by its qualified name (files
        name only the stable runtime, so the engine can move)."""
        engine = self.__dict__.get(ENGINE)
        if engine is None:
            engine = self.__dict__[ENGINE] = getattr(importlib.import_module(_ENGINE_MODULE), _ENGINE_NAME)
        return engine

    def _check_parameters(self) -> bool:
        """Refuse to run where the model no longer holds a parameter or buffer the graph reads
        (replaced by assignment, ``load_state_dict(assign=True)``, a swapped submodule, or FSDP's
        ``fully_shard`` after conversion): the graph would compute with, and train, tensors nobody
        optimizes. Cheap per call (:class:`graphamp.model_state.ModelState`); ``check_model()``
        compares every tensor. Returns whether it followed a buffer the model replaced."""
        state = self.__dict__.get(_MODEL_STATE)
        followed = state is not None and not state.unchanged() and self.check_model()
        frozen = self.__dict__.get(FROZEN_VERSIONS)
        if frozen is not None and frozen.moved():  # a weight inference=True cast once was updated
            self.refresh()
        return followed

    def check_model(self) -> bool:
        """Raise :class:`graphamp.ModelChangedError` if the model does not hold, under each name it
        held a parameter or buffer at conversion, the object this module's graph reads (compared by
        identity): one of them was replaced on one side only. A buffer the model replaced by one of
        the same shape, dtype and device (code that assigns ``self.buf = ...`` in forward) is read
        from the model from then on, as eager reads it: returns whether one was."""
        model, state = self.__dict__.get(MODEL), self.__dict__.get(_MODEL_STATE)
        if model is None or state is None:
            return False
        replaced = state.replaced(model, graph_reads(self))
        followed = replaced and follow_replaced_buffers(self._all_converted(), model, [n for n in replaced if n in state.shared])
        if followed:
            self.refresh()  # no cast kept of the old tensors
            replaced = state.replaced(model, graph_reads(self))
        refusal = state.refusal(model, replaced)
        if refusal is not None:
            raise refusal
        state.accept(model)  # e.g. a class swapped by a wrapper, or a new submodule: fine
        return bool(followed)

    def _call_graph(self, args: tuple, kwargs: dict) -> Any:
        info = self.__dict__.get("_graphamp")
        self.check_structure(args, kwargs)
        restore = (peek_graph_info(self) or GraphInfo()).restore_on_refusal
        with restored_on_refusal(self, *restore) if restore else contextlib.nullcontext():
            if info is not None and info.inference:
                with torch.no_grad():
                    return self._call_without_autocast(info, args, kwargs)
            return self._call_without_autocast(info, args, kwargs)

    def check_structure(self, args: tuple, kwargs: dict) -> None:
        """Raise :class:`graphamp.InputStructureError` where these inputs differ from the example in
        structure or in the non-tensor values the graph baked in."""
        expected = self.__dict__.get("_graphamp_signature")
        if expected is not None and not self.plain_call(args, kwargs) and input_signature(args, kwargs) != expected:
            raise InputStructureError(
                "these inputs differ in structure (positional count, keyword names, nesting) or in "
                "non-tensor values from the example the graph was converted for, which it baked in: "
                f"{describe_signature(input_signature(args, kwargs))} vs {describe_signature(expected)}."
            )

    def plain_call(self, args: tuple, kwargs: dict) -> bool:
        """Whether these inputs have the example's form where that was n positional tensors: then
        they pass every structure check and are the graph's inputs, in order."""
        arity = self.__dict__.get("_graphamp_arity")
        if arity is None or kwargs or len(args) != arity:
            return False
        for a in args:
            if not isinstance(a, torch.Tensor):
                return False
        return True

    def _call_shape_class(self, refused: InputMismatchError, args: tuple, kwargs: dict) -> Any:
        """Run the module converted for these inputs' shape class (or structure), converting it on
        first use."""
        variants = self.__dict__.setdefault(_VARIANTS, [])
        tried = 0
        while True:
            for variant in variants[tried:]:
                try:
                    return variant._call_graph(args, kwargs)
                except _CONVERTIBLE:
                    tried += 1
            with _reconversion_lock(self):
                if len(variants) == tried:  # else another thread converted one meanwhile: try it first
                    variant = self._converted_for(refused, args, kwargs)
                    break
        return variant._call_graph(args, kwargs)

    def _converted_for(self, refused: InputMismatchError, args: tuple, kwargs: dict) -> AmpModule:
        model, variants = self.__dict__.get(MODEL), self.__dict__.setdefault(_VARIANTS, [])
        shapes = (
            _shapes(args, kwargs) if isinstance(refused, InputShapeError)
            else "(values the model's code branches on)" if isinstance(refused, InputValueError)
            else "(another input structure)"
        )
        if model is None:
            raise type(refused)(
                f"{refused} This module cannot convert again for these inputs {shapes}: it holds no "
                "reference to its model (it was saved by an older graphamp, or its model could not be "
                "pickled with it). Way out: call graphamp.convert again with an example like these inputs."
            ) from None
        if len(variants) >= MAX_SHAPE_CLASSES:
            raise type(refused)(
                f"{refused} This module has already converted itself for {MAX_SHAPE_CLASSES} other input "
                f"classes (shapes, structures or non-tensor values), the most it holds; these inputs {shapes} "
                "would need one more. Way out: pad inputs to a few fixed shapes and keep non-tensor arguments "
                "fixed (or pass them as tensors), or convert with an example whose sizes the model's code lets "
                "vary, or use torch.compile(model, backend=\"graphamp\")."
            ) from None
        cache = key_value_cache(args, kwargs)
        if cache is not None:  # checked before any run of the model, which would write into it
            raise InputStructureError(f"{refused} These inputs pass a key/value cache, {cache}, which this module does not convert for. {CACHE_WAY_OUT}") from None
        spec = self.graphamp_info.spec()
        variant = self._converted(
            model, spec, self.graphamp_info.training, args, kwargs, f"these inputs {shapes}", refused=f"{refused} ",
            error=type(refused),
        )
        variants.append(variant)
        _log.log(
            logging.WARNING if len(variants) == 1 else logging.INFO,
            "graphamp converted %s again for inputs %s (input class %d of at most %d besides the "
            "example's), because %s",
            type(model).__name__, shapes, len(variants), MAX_SHAPE_CLASSES, refused,
        )
        return variant

    def _call_without_autocast(self, info: AmpInfo | None, args: tuple, kwargs: dict) -> Any:
        if info is not None and torch.is_autocast_enabled(info.device_type):
            with autocast_off((info.device_type,)):
                return self._run(args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if traced():  # dynamo traces the code without direct overload calls
            return self.__dict__[_TRACEABLE](self, *args, **kwargs)
        return type(self).__dict__[_GRAPH](self, *args, **kwargs)

    def recompile(self):  # noqa: ANN201 (FX's PythonCode)
        """FX's recompile, writing faster code (:mod:`graphamp.codegen`): ``self.code`` hoists the
        parameter reads and calls each ATen overload directly; under dynamo (``torch.compile`` of
        this module), which cannot trace the direct calls, calls run the same code without them."""
        if _BUILDING.get():  # emit() recompiles once more when the module is complete
            return super().recompile()
        with self._graph.on_generate_code(lambda _previous: hoist_state_reads):
            traceable = self._graph.python_code(root_module="self")
        self.__dict__[_TRACEABLE] = _forward_from_src(traceable.src, traceable.globals)
        bindings = bindings_of(self._graph)
        with self._graph.on_generate_code(lambda _previous: lambda body: eager_body(body, bindings)):
            code = super().recompile()
        cls = type(self)
        # The generated code runs the graph (_run); the class's forward is the dispatch, with the
        # model's signature, and its call nn.Module's (FX's wrapped call would bypass the dispatch).
        setattr(cls, _GRAPH, cls.__dict__["forward"])
        cls.forward = signed_forward(AmpModule.forward, self.__dict__.get(MODEL))
        if "__call__" in vars(cls):
            del cls.__call__
        return code

    def refresh(self) -> None:
        """Recompute the low-precision weight copies from the model's parameters. Updates through a
        parameter itself (``optimizer.step()``, ``load_state_dict``, in-place ops) are seen at the
        next call, frozen weights included; call this after changing one through ``.data``."""
        for amp in self._all_converted():
            cache = getattr(amp, WEIGHT_CACHE, None)
            if cache is not None:
                cache.clear()
            recast_frozen(amp)

    def _all_converted(self) -> list[AmpModule]:
        """This module and those it converted for other inputs and modes (theirs included)."""
        others = [*self.__dict__.get(_VARIANTS, ()), *self.__dict__.get(_MODES, {}).values()]
        return [self, *(amp for other in others for amp in other._all_converted())]

    def train(self, mode: bool = True) -> AmpModule:
        """Set the training mode, as ``nn.Module.train``: the next call runs the graph converted in
        that mode (dropout, batch norm), converting it from the model on first use."""
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules as nn.Module finds them; then the model's public
        attributes (``config``, ``generation_config``, ``main_input_name``) and the methods in
        ``PASSED_METHODS`` (``save_pretrained``). Other methods of the model would run its own
        unconverted code: an AttributeError says so."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get(MODEL)
            if model is None or name.startswith("_"):
                raise
        try:
            value = getattr(model, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object (and its model) has no attribute {name!r}") from None
        if inspect.ismethod(value) and value.__self__ is model and name not in PASSED_METHODS:
            way_out = (
                "generate with graphamp.integrations.transformers.compile(model).generate(...), which follows the "
                "key/value cache through torch.compile(backend=\"graphamp\")"
                if name == "generate" else
                f"call model.{name}(...) on the model itself (under torch.autocast for mixed precision)"
            )
            raise ModelMethodError(
                f"{type(model).__name__}.{name} is a method of the model, which the converted module does not pass "
                f"through: it would run the model's own unconverted code (no mixed precision). Way out: {way_out}."
            )
        return value

    def _graphamp_bind(self, model: nn.Module) -> None:
        """Keep ``model`` (the runtime calls this on load); see :func:`bind_model`."""
        bind_model(self, model)

    # What the code's hoisted parameter reads call (graphamp.codegen.READ_METHOD): self is the root.
    _graphamp_read = read_state

    # A saved record (a plain dict) as the node's NodeInfo again; the runtime calls it on load.
    node_info_from_saved = staticmethod(NodeInfo.from_dict)
    # The saved module meta with its GraphInfo again (a plain dict in the file); the runtime calls it on load.
    meta_from_saved = staticmethod(meta_from_saved)

    def __reduce__(self) -> tuple:
        _, (body, import_block) = super().__reduce__()
        # Files keep FX's own code (plain get_attr reads); loading recompiles, which hoists again.
        body["_code"] = self._graph.python_code(root_module="self").src
        body["_tracer_cls"] = AmpTracer
        body.pop(FROZEN, None), body.pop(FROZEN_VERSIONS, None)  # weak references to the source model do not travel
        body.pop(_TRACEABLE, None)  # recompiled on load
        body.pop(_VARIANTS, None)  # converted again on first use after loading
        body.pop(_MODES, None)
        body.pop(_MODEL_STATE, None)  # taken again from the loaded model
        body.pop(ENGINE, None)  # files name only the runtime: the loaded module finds the engine by name
        # The model travels so that the loaded module converts again for other shape classes; its
        # parameters are pickled once, as the objects this module shares with it.
        if body.get(MODEL) is not None and not picklable(body[MODEL]):
            body.pop(MODEL)
        # Loading re-traces the code, which keeps no node meta: graphamp's record of each node
        # travels beside it, so a loaded module's cast_summary() still reports its casts.
        body[NODE_META] = node_meta_record(self.graph, saved_info)
        # The module's GraphInfo is a compile-time class: files hold its fields, a plain dict.
        body["meta"] = saved_meta(body.get("meta", {}))
        return (rebuild_amp_module, (body, import_block))

    def __deepcopy__(self, memo: dict) -> AmpModule:
        """A copy as ``torch.save``/``torch.load`` makes one (its own parameters, model and record
        of the conversion); FX's deepcopy would keep only FX's attributes."""
        rebuild, (body, import_block) = self.__reduce__()
        # Pytree specs are immutable: the copy shares them (deep-copying one warns in torch 2.13,
        # FutureWarning: isinstance(treespec, LeafSpec)).
        for value in (body.get("_in_spec"), body.get("_out_spec"), *(body.get("_graphamp_signature") or ())):
            if isinstance(value, pytree.TreeSpec):
                memo.setdefault(id(value), value)
        new = rebuild(copy.deepcopy(body, memo), import_block)
        memo[id(self)] = new
        return new

    def cast_summary(self) -> dict[str, Any]:
        """Counts of graphamp's casts, by (from, to) dtype; how many are weight casts kept across
        calls; weights frozen to low precision; and op nodes by category."""
        casts: collections.Counter = collections.Counter()
        categories: collections.Counter = collections.Counter()
        cached = frozen = 0
        for node in self.graph.nodes:
            record = peek(node) or NodeInfo()
            if record.cast:
                src, dtype = (node.args[1], node.args[2]) if node.target is cached_cast else cast_source(node)
                # A loaded module's nodes have no fake values: the cast's source dtype was saved.
                casts[f"{short_dtype(tensor_dtype(src) or record.source_dtype)}->{short_dtype(dtype)}"] += 1
                cached += node.target is cached_cast
            frozen += record.frozen
            if record.category:
                categories[record.category] += 1
        return {"casts": sum(casts.values()), "by_dtype": dict(casts), "cached_weight_casts": cached,
                "frozen_weights": frozen, "ops_by_category": dict(categories)}


def _shapes(args: tuple, kwargs: dict) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def emit(
    gm: GraphModule, model: nn.Module, spec: AmpSpec, *, example: tuple[tuple, dict] | None = None,
    engine: Callable[..., AmpModule] | None = None,
) -> AmpModule:
    """Wrap the rewritten graph as an AmpModule whose state is the model's own parameters and
    buffers. ``engine`` converts the model again where a call needs another graph (``reconvert(model,
    args, kwargs, spec, self_check_record)``, from :mod:`graphamp.pipeline`, which calls emit)."""
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    guard = input_guard(gm)
    gm.add_submodule(_GUARD, guard)
    if placeholders:
        with graph.inserting_after(placeholders[-1]):
            graph.call_module(_GUARD, tuple(placeholders))
    root = collections.OrderedDict((n.target, attr_of(gm, n.target)) for n in graph.find_nodes(op="get_attr"))
    root[_GUARD] = guard
    building = _BUILDING.set(True)
    try:
        amp = AmpModule(root, graph, class_name=type(model).__name__ + "Amp")
    finally:
        _BUILDING.reset(building)
    record = peek_graph_info(gm) or GraphInfo()
    amp.meta.update(gm.meta)
    # The weak references to the model's parameters go on the module itself: they are not saved.
    frozen, amp.meta[GRAPHAMP] = record.frozen, dataclasses.replace(record, frozen={})
    share_state(amp, model)
    amp.__dict__["_graphamp"] = AmpInfo(
        spec.device_type, spec.dtype, spec.mode, model.training, spec.config, spec.inference, spec.keep_io_types,
        no_grad=spec.no_grad, capture=spec.capture,
    )
    if spec.target == "module":
        bind_model(amp, model)
    amp.__dict__[FROZEN] = frozen
    take_frozen_versions(amp)
    if engine is not None:
        amp.__dict__[ENGINE] = engine
    if example is not None:
        amp.__dict__["_graphamp_signature"] = input_signature(*example)
        amp.__dict__["_graphamp_arity"] = plain_arity(*example)
    nn.Module.train(amp, model.training)
    in_model_order(amp, model)
    amp.recompile()
    return amp


def _needs_grad(amp: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call builds an autograd graph: eager's fused encoder kernels run where it does not
    (no grad mode, or no parameter and no input that requires grad)."""
    if not torch.is_grad_enabled():
        return False
    return any(p.requires_grad for p in amp.parameters()) or any(
        t.requires_grad for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    )


def bind_model(amp: AmpModule, model: nn.Module) -> None:
    """Keep ``model`` with its converted module: to convert it again (other shapes, modes), to show
    its forward's signature, and to notice when its parameters are no longer the graph's."""
    amp.__dict__[MODEL] = model
    amp.__dict__[_MODEL_STATE] = ModelState(model, graph_reads(amp))
    if _GRAPH in type(amp).__dict__:  # a loaded module: its class's forward gets the signature now
        type(amp).forward = signed_forward(AmpModule.forward, model)
