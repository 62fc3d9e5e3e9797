"""The module graphamp returns: a GraphModule with explicit casts and no runtime autocast."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import dataclasses
import importlib
import inspect
import io
import logging
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.fx import GraphModule
from torch.fx.graph_module import _forward_from_src

from graphamp.capture import SIZE_CONDITIONS
from graphamp.config import Config
from graphamp.errors import InputMismatchError, InputShapeError, InputStructureError, InputValueError, PolicyDriftError, ModelChangedError, ModelMethodError
from graphamp.spec import AmpSpec, autocast_off
from graphamp.passes.cache_weights import WEIGHT_CACHE
from graphamp.passes.fuse_encoder_layers import FUSED_WITHOUT_GRAD
from graphamp.passes.graph_edit import attr_of, cast_source, tensor_dtype
from graphamp.node_info import NodeInfo, peek
from graphamp.policy import short_dtype
from graphamp.codegen import bindings_of, eager_body, hoist_state_reads
from graphamp.model_state import ModelState
from graphamp.eager import difference_without
from graphamp.shared_state import in_capture
from graphamp.runtime import (
    RESTORE_ON_REFUSAL, AmpTracer, InputGuard, cached_cast, read_state, rebuild_amp_module, restored_on_refusal,
)
from graphamp.runtime_saved import MODEL, NODE_META, node_meta_record

__all__ = ["AmpModule", "AmpInfo", "SelfCheck", "emit", "input_signature", "describe_signature"]

_GUARD = "_graphamp_guard"
_TRACEABLE = "_graphamp_traceable"  # the forward dynamo traces (recompile)
_GRAPH = "_graphamp_graph"  # the class attribute holding the generated code (recompile)
_BUILDING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphamp_emit_building", default=False)
_VARIANTS = "_graphamp_variants"  # the modules converted for other shape classes, in order
_MODES = "_graphamp_modes"  # the modules converted for another training mode, or for calls without grad
# Keyword inputs passed as None when all ones: convert found eager's program for an all-ones mask is
# the one it runs without the mask (the model drops it by value), and checked it (convert.py).
ALL_ONES_AS_NONE = "_graphamp_all_ones_as_none"
# {(training, ((name, mask shape), ...)): bool}: whether eager autocast was seen to run the same
# program for these all-ones masks as without them. The example's entry is proven by convert's
# self-check; every other is checked once, on first use, by running eager both ways.
ALL_ONES_PROVEN = "_graphamp_all_ones_proven"
MAX_ALL_ONES_PROVEN = 64  # past this many mask shapes, all-ones masks are passed as given
_MODEL_STATE = "_graphamp_model_state"  # a ModelState: what the model held at conversion
# The engine that converts the model again (emit's ``engine``); saved by its qualified name.
ENGINE = "_graphamp_engine"
# amp.meta key: what convert's self-check found (a SelfCheck; a plain dict once loaded).
SELF_CHECK_META = "graphamp.self_check"
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


@dataclass(frozen=True)
class AmpInfo:
    """What a converted module was converted for (``amp.graphamp_info``); saved with it."""

    __module__ = "graphamp"  # its public path, which saved modules name

    device_type: str
    dtype: torch.dtype
    mode: str
    training: bool
    config: Config
    inference: bool = False
    keep_io_types: bool = False  # a default: modules saved before it was recorded load with it
    grad_free: bool = False  # the graph for calls without grad of an exact module (AmpSpec.grad_free)
    capture: str = "export"  # how the graph was captured (AmpSpec.capture); other shapes capture alike

    def spec(self) -> AmpSpec:
        """The conversion's spec again, to convert the same model for another shape class."""
        return AmpSpec(
            self.device_type, self.dtype, self.mode, self.inference, self.config, "module", self.keep_io_types, self.grad_free,
            self.capture,
        )


_TENSOR = "<tensor>"


def input_signature(args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """The inputs' structure and non-tensor values, which a converted graph fixes (tensor sizes
    and values may vary); keyword order does not matter."""
    leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in sorted(kwargs)}))
    return spec, tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)


@dataclasses.dataclass(frozen=True)
class SelfCheck:
    """What convert's self-check compared and found, kept in ``amp.meta["graphamp.self_check"]``."""

    # True: every output value and dtype (and gradient, if compared) equal to eager autocast's.
    ok: bool
    # Whether parameter gradients of a fixed loss were compared too (not for inference=True).
    grads: bool
    # Seconds the check took (both runs, and on a difference the search for the divergent node).
    seconds: float
    # What differs, empty when ok.
    problem: str = ""


def is_all_ones(value: Any) -> bool:
    """Whether ``value`` is a non-empty integer or bool tensor of ones: a mask that masks nothing.

    >>> assert is_all_ones(torch.ones(2, 3, dtype=torch.long)) and not is_all_ones(torch.ones(2))
    """
    return (
        isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
        and value.numel() > 0 and bool((value == 1).all())
    )


def all_ones_key(kwargs: dict, names: tuple[str, ...], training: bool) -> tuple | None:
    """The :data:`ALL_ONES_PROVEN` key of these keyword inputs: the training mode and the shapes of
    the all-ones masks among ``names``; None where none is all ones.

    >>> all_ones_key({"attention_mask": torch.ones(2, 5, dtype=torch.long)}, ("attention_mask",), False)
    (False, (('attention_mask', (2, 5)),))
    """
    ones = tuple((k, tuple(kwargs[k].shape)) for k in names if is_all_ones(kwargs.get(k)))
    return (training, ones) if ones else None


def _plain_arity(args: tuple, kwargs: dict) -> int | None:
    """n when the example was n positional tensors and nothing else: calls like it skip flattening."""
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    return len(args)


def describe_signature(signature: tuple[Any, tuple]) -> str:
    spec, constants = signature
    args, kwargs = pytree.tree_unflatten(list(constants), spec)
    return f"args={args!r} kwargs={kwargs!r}"


def _guard_from(gm: GraphModule) -> InputGuard:
    names, specs = [], []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        names.append(node.name)
        if isinstance(val, torch.Tensor):
            dims = [_dim_spec(d) for d in val.shape]
            specs.append((val.dtype, val.device.type, dims))
        else:
            specs.append(None)
    ranges = {}
    for sym, vr in gm.meta.get("range_constraints", {}).items():
        ranges[str(sym)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    symbols = {d for spec in specs if spec is not None for d in spec[2] if isinstance(d, str)}
    conditions = [c for c in gm.meta.get(SIZE_CONDITIONS, ()) if set(c[1]) <= symbols]
    return InputGuard(names, specs, ranges, gm.meta.get("range_reasons"), conditions)


def _bound(value: Any) -> int | None:
    """An integer range bound, or None for infinity (sympy's and torch's int_oo)."""
    return int(value) if getattr(value, "is_Integer", False) else None


def _dim_spec(d: int | torch.SymInt) -> int | str:
    """A static size, or the name (or expression) of a symbolic one."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    return int(expr) if expr.is_number else str(expr)


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
        if torch.compiler.is_compiling():
            return self._call_graph(args, kwargs)
        self._check_parameters()
        names = self.__dict__.get(ALL_ONES_AS_NONE)
        if names:
            kwargs = self._all_ones_dropped(args, kwargs, names)
        return self._for_mode(args, kwargs)._call_classes(args, kwargs)

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
        with _training_as(model, self.training):
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
        if not info.inference and not info.grad_free and base.meta.get(FUSED_WITHOUT_GRAD) and not _needs_grad(self, args, kwargs):
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

    def _converted_as(self, training: bool, grad_free: bool, args: tuple, kwargs: dict) -> AmpModule:
        """The model converted again in another training mode, or for calls without grad."""
        model = self.__dict__.get(MODEL)
        mode = ("training" if training else "eval") + (" without grad" if grad_free else "")
        if model is None:
            raise InputMismatchError(
                f"this module was converted in {'training' if self.graphamp_info.training else 'eval'} mode and is "
                f"called in {mode} mode, whose graph it cannot convert: it holds no reference to its model (saved by "
                "an older graphamp, or the model could not be pickled with it). Way out: call "
                f"model.{'train' if training else 'eval'}() on the original model and graphamp.convert it again."
            )
        spec = dataclasses.replace(self.graphamp_info.spec(), grad_free=grad_free)
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
        # Captured in the grad mode its calls run in: the model's code may read it.
        with _training_as(model, training), torch.inference_mode(False), torch.set_grad_enabled(not spec.grad_free):
            try:
                return self._engine()(model, args, kwargs, spec, self.meta.get(SELF_CHECK_META))
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

    def _check_parameters(self) -> None:
        """Refuse to run where the model no longer holds a parameter or buffer the graph reads
        (replaced by assignment, ``load_state_dict(assign=True)``, a swapped submodule, or FSDP's
        ``fully_shard`` after conversion): the graph would compute with, and train, tensors nobody
        optimizes. Cheap per call (:class:`graphamp.model_state.ModelState`); ``check_model()``
        compares every tensor."""
        state = self.__dict__.get(_MODEL_STATE)
        if state is not None and not state.unchanged():
            self.check_model()

    def check_model(self) -> None:
        """Raise :class:`graphamp.ModelChangedError` if the model does not hold, under each name it
        held a parameter or buffer at conversion, the object this module's graph reads (compared by
        identity): one of them was replaced on one side only."""
        model, state = self.__dict__.get(MODEL), self.__dict__.get(_MODEL_STATE)
        if model is None or state is None:
            return
        replaced = state.replaced(model, _reads(self))
        theirs = [p for _, p in model.named_parameters(remove_duplicate=False)]
        sharded = type(model).__name__.startswith("FSDP") or any(
            type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor" for p in theirs
        )
        if not replaced and not sharded:
            state.accept(model)  # e.g. a class swapped by a wrapper, or a new submodule: fine
            return
        names = ", ".join(replaced[:3]) + (" ..." if len(replaced) > 3 else "")
        if sharded:
            raise ModelChangedError(
                f"{type(model).__name__} was sharded (FSDP fully_shard) after graphamp converted it: the converted "
                f"graph reads the parameters from before sharding ({names}), so it would train nothing and reduce "
                "no gradient. Way out: shard first, then convert (graphamp.TrainStep / graphamp.convert on the "
                "sharded model), or torch.compile(model, backend=\"graphamp\")."
            )
        raise ModelChangedError(
            f"{type(model).__name__}'s parameters or buffers were replaced after graphamp converted it ({len(replaced)} "
            f"of {len(state.tensors)}: {names}): the converted graph reads the old tensors, which the model and its "
            "optimizer no longer see. Way out: update them in place (load_state_dict without assign=True, optimizer "
            "steps, param.data.copy_), or graphamp.convert the model again."
        )

    def _call_graph(self, args: tuple, kwargs: dict) -> Any:
        info = self.__dict__.get("_graphamp")
        expected = self.__dict__.get("_graphamp_signature")
        arity = self.__dict__.get("_graphamp_arity")
        plain = arity is not None and not kwargs and len(args) == arity
        if plain:
            for a in args:
                if not isinstance(a, torch.Tensor):
                    plain = False
                    break
        if expected is not None and not plain and input_signature(args, kwargs) != expected:
            raise InputStructureError(
                "these inputs differ in structure (positional count, keyword names, nesting) or in "
                "non-tensor values from the example the graph was converted for, which it baked in: "
                f"{describe_signature(input_signature(args, kwargs))} vs {describe_signature(expected)}."
            )
        restore = self.meta.get(RESTORE_ON_REFUSAL)
        with restored_on_refusal(self, *restore) if restore else contextlib.nullcontext():
            if info is not None and info.inference:
                with torch.no_grad():
                    return self._call_without_autocast(info, args, kwargs)
            return self._call_without_autocast(info, args, kwargs)

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
        if torch.compiler.is_compiling():  # dynamo traces the code without direct overload calls
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
        cls.forward = _signed_forward(self.__dict__.get(MODEL))
        if "__call__" in vars(cls):
            del cls.__call__
        return code

    def refresh(self) -> None:
        """Recompute the low-precision weight copies from the model's parameters.

        Updates through a parameter itself (``optimizer.step()``, ``load_state_dict``) are seen
        automatically; call this after changing one through ``.data``, which its version counter
        does not see, or to re-cast the weights an ``inference=True`` module froze at conversion.
        """
        cache = getattr(self, WEIGHT_CACHE, None)
        if cache is not None:
            cache.clear()
        for variant in [*self.__dict__.get(_VARIANTS, ()), *self.__dict__.get(_MODES, {}).values()]:
            variant.refresh()
        for path, source in self.__dict__.get("_graphamp_frozen", {}).items():
            param = source()
            if param is None:
                raise RuntimeError(
                    f"cannot refresh {path}: the model it was converted from is gone. Way out: keep the "
                    "model alive, or load new weights with load_state_dict(model.state_dict())"
                )
            with torch.no_grad():
                self.get_buffer(path).copy_(param)

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

    def __reduce__(self) -> tuple:
        _, (body, import_block) = super().__reduce__()
        # Files keep FX's own code (plain get_attr reads); loading recompiles, which hoists again.
        body["_code"] = self._graph.python_code(root_module="self").src
        body["_tracer_cls"] = AmpTracer
        body.pop("_graphamp_frozen", None)  # weak references to the source model do not travel
        body.pop(_TRACEABLE, None)  # recompiled on load
        body.pop(_VARIANTS, None)  # converted again on first use after loading
        body.pop(_MODES, None)
        body.pop(_MODEL_STATE, None)  # taken again from the loaded model
        body.pop(ENGINE, None)  # files name only the runtime: the loaded module finds the engine by name
        # The model travels so that the loaded module converts again for other shape classes; its
        # parameters are pickled once, as the objects this module shares with it.
        if body.get(MODEL) is not None and not _picklable(body[MODEL]):
            body.pop(MODEL)
        # Loading re-traces the code, which keeps no node meta: graphamp's record of each node
        # travels beside it, so a loaded module's cast_summary() still reports its casts.
        body[NODE_META] = node_meta_record(self.graph, _saved_info)
        # convert's self-check record is a compile-time class: files hold its fields, a plain dict.
        check = body.get("meta", {}).get(SELF_CHECK_META)
        if dataclasses.is_dataclass(check):
            body["meta"] = {**body["meta"], SELF_CHECK_META: dataclasses.asdict(check)}
        return (rebuild_amp_module, (body, import_block))

    def __deepcopy__(self, memo: dict) -> AmpModule:
        """A copy as ``torch.save``/``torch.load`` makes one (its own parameters, model and record
        of the conversion); FX's deepcopy would keep only FX's attributes."""
        rebuild, (body, import_block) = self.__reduce__()
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


# What reports read; the rest of a NodeInfo (regions, captured dtypes) is compile-time only.
_SAVED_FIELDS = ("category", "dtype", "reason", "cast", "source_dtype", "cached", "frozen", "decomposed_from", "eager_kernel", "attention", "notes")


def _saved_info(node: torch.fx.Node) -> dict[str, Any] | None:
    """A node's record as a saved module keeps it: a plain dict, with a cast's source dtype."""
    record = peek(node)
    if record is None:
        return None
    saved = {k: v for k, v in record.to_dict().items() if k in _SAVED_FIELDS}
    if record.cast:
        found = (node.args[1], None) if node.target is cached_cast else cast_source(node)
        if found is not None and tensor_dtype(found[0]) is not None:
            saved["source_dtype"] = tensor_dtype(found[0])
    return saved or None


def _shapes(args: tuple, kwargs: dict) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


class _TensorsAside(pickle.Pickler):
    """Pickles all but tensor data: whether a model pickles, without copying its weights."""

    def persistent_id(self, obj: Any) -> int | None:
        return id(obj) if isinstance(obj, torch.Tensor) else None


def _picklable(model: nn.Module) -> bool:
    """Whether ``model`` can be saved with its converted module (a class defined in a function,
    a lambda attribute or a ScriptModule cannot)."""
    try:
        _TensorsAside(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(model)
    except Exception:
        return False
    return True


@contextlib.contextmanager
def _training_as(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` (every submodule) in the given training mode for the duration, then as it was:
    the converted module's graph fixed its mode, which the model may have left since."""
    saved = [(m, m.training) for m in model.modules()]
    if any(flag != training for _, flag in saved):
        model.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    for p in parents:
        if not hasattr(module, p):
            module.add_module(p, nn.Module())
        module = getattr(module, p)
    return module, name


def emit(
    gm: GraphModule, model: nn.Module, spec: AmpSpec, *, example: tuple[tuple, dict] | None = None,
    engine: Callable[..., AmpModule] | None = None,
) -> AmpModule:
    """Wrap the rewritten graph as an AmpModule whose state is the model's own parameters and
    buffers. ``engine`` converts the model again where a call needs another graph (``reconvert(model,
    args, kwargs, spec, self_check_record)``, from :mod:`graphamp.pipeline`, which calls emit)."""
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    guard = _guard_from(gm)
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
    frozen = gm.meta.pop("graphamp_frozen", {})
    amp.meta.update(gm.meta)
    state = model.state_dict(keep_vars=True)
    persistent = set(state)
    params = {id(p) for p in model.parameters()}
    for path, buf in model.named_buffers(remove_duplicate=False):
        if path not in persistent:
            state[path] = buf
    for path, value in state.items():
        owner, name = _owner(amp, path)
        if id(value) in params and not isinstance(value, nn.Parameter):
            # A deep-copied ScriptModule's parameters are plain (non-leaf) tensors; the model
            # lists them as parameters, and so does its converted module.
            owner._buffers.pop(name, None)
            owner._parameters[name] = value
            continue
        if name in dict(owner.named_parameters(recurse=False)) or name in dict(owner.named_buffers(recurse=False)):
            continue
        if isinstance(value, nn.Parameter):
            owner.register_parameter(name, value)
        else:
            owner.register_buffer(name, value)
    # Constants lifted by export and non-persistent buffers stay out of state_dict, as in the model.
    for path, _ in list(amp.named_buffers(remove_duplicate=False)):
        if path not in persistent:
            owner, name = _owner(amp, path)
            buf = owner.get_buffer(name)
            delattr(owner, name)
            owner.register_buffer(name, buf, persistent=False)
    amp.__dict__["_graphamp"] = AmpInfo(
        spec.device_type, spec.dtype, spec.mode, model.training, spec.config, spec.inference, spec.keep_io_types,
        grad_free=spec.grad_free, capture=spec.capture,
    )
    if spec.target == "module":
        bind_model(amp, model)
    amp.__dict__["_graphamp_frozen"] = frozen
    if engine is not None:
        amp.__dict__[ENGINE] = engine
    if example is not None:
        amp.__dict__["_graphamp_signature"] = input_signature(*example)
        amp.__dict__["_graphamp_arity"] = _plain_arity(*example)
    nn.Module.train(amp, model.training)
    _in_model_order(amp, model)
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
    amp.__dict__[_MODEL_STATE] = ModelState(model, _reads(amp))
    if _GRAPH in type(amp).__dict__:  # a loaded module: its class's forward gets the signature now
        type(amp).forward = _signed_forward(model)


def _reads(amp: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers ``amp``'s graph reads, by name."""
    reads = dict(amp.named_parameters(remove_duplicate=False))
    reads.update(amp.named_buffers(remove_duplicate=False))
    return reads


def _signed_forward(model: nn.Module | None) -> Any:
    """AmpModule.forward as a function of its own, showing the model's forward's signature (HF
    Trainer drops the dataset columns it does not name)."""

    def forward(self: AmpModule, *args: Any, **kwargs: Any) -> Any:
        return AmpModule.forward(self, *args, **kwargs)

    forward.__doc__ = AmpModule.forward.__doc__
    if model is not None:
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):  # a builtin or C++ forward (ScriptModule)
            return forward
        params = list(signature.parameters.values())
        if not params or params[0].name != "self":  # a ScriptModule's method shows its self
            params.insert(0, inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD))
        try:
            forward.__signature__ = signature.replace(parameters=params)
        except ValueError:  # a parameter named self elsewhere: keep the generic signature
            pass
    return forward


def _in_model_order(amp: nn.Module, model: nn.Module) -> None:
    """Order each submodule's parameters, buffers and children as the model's, so that
    ``parameters()`` lists them in the model's order (gradient clipping sums the norm in it)."""
    ours = dict(amp.named_modules(remove_duplicate=False))
    for path, theirs in model.named_modules(remove_duplicate=False):
        mine = ours.get(path)
        if mine is None:
            continue
        for field in ("_parameters", "_buffers", "_modules"):
            table, order = getattr(mine, field), list(getattr(theirs, field).keys())  # ScriptModule's wrap theirs
            rank = {name: i for i, name in enumerate(order)}
            ordered = sorted(table.items(), key=lambda item: rank.get(item[0], len(rank)))
            table.clear()
            table.update(ordered)
