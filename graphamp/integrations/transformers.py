"""Hugging Face transformers: ``Trainer`` and ``generate()`` with graphamp's mixed precision.

Both functions return a *view* of the model: an object of the model's own class that shares its
parameters, buffers, submodules and config (nothing is copied; the model is not modified), whose
``forward`` alone runs through graphamp. Everything Trainer and ``generate()`` look at is the
model's own: ``isinstance(view, PreTrainedModel)`` (so ``Trainer.save_model`` writes
``config.json``), ``forward``'s signature (Trainer keeps the dataset columns the model takes), its
``accepts_loss_kwargs`` (Trainer passes ``num_items_in_batch``), its parameters in its own order
(gradient clipping sums the norm in the same order), its submodules' types (weight decay skips
norms as for the model), ``train()``/``eval()``, ``save_pretrained``, ``generation_config``.
The submodules are the model's, so ``view.train()``/``view.eval()`` set their modes as
``model.train()``/``model.eval()`` would (the model's own top-level flag stays its own), and training
the view trains the model.

- :func:`prepare`: ``forward`` runs the :class:`~graphamp.AmpModule` :func:`graphamp.convert` makes
  from the first call's inputs (one per autocast setting), which converts itself again for the
  other training mode (an eval graph at the first ``evaluate()``) and for another input structure
  or shape class. Pass it to
  ``Trainer`` with ``bf16=True`` (or ``fp16=True`` on a GPU): Trainer's run is the model under
  accelerate's ``torch.autocast``; the converted graphs follow that region, switch it off and apply
  the same casts, so losses, gradients, parameters and ``evaluate()`` are bitwise those of
  Trainer's own mixed-precision run. Without a region (no ``bf16=True``; ``fp16=True`` on CPU,
  which accelerate runs in fp32) a call raises :class:`graphamp.OptionError` unless
  ``prepare(model, dtype=...)`` names a precision. A converted graph cannot hold a key/value cache:
  a call with one (``generate()``) raises :class:`graphamp.CaptureError` naming :func:`compile`.
- :func:`compile`: ``forward`` runs under ``torch.compile(backend="graphamp")`` inside
  ``torch.autocast``, and dynamo follows the model's Python, a key/value cache included:
  ``generate()`` with the cache gives tokens and logits bitwise to eager autocast ``generate()``
  (``options={"inner": "eager"}``). It also trains under Trainer, bitwise to ``bf16=True``: the
  route for ``TrainingArguments(torch_compile_backend="graphamp")``, which accelerate refuses (see
  :mod:`graphamp.integrations.accelerate`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

import graphamp
from graphamp.backend.options import BackendOptions
from graphamp.config import Config
from graphamp.eager import rng_kept
from graphamp.errors import CaptureError, OptionError
from graphamp.inputs import key_value_cache
from graphamp.policy import resolve_dtype
from graphamp.spec import autocast_off
from graphamp.emit import MAX_SHAPE_CLASSES, AmpModule

try:
    import transformers  # noqa: F401 (the optional dependency, checked at import)
except ImportError as e:  # pragma: no cover - exercised only without the optional dependency
    raise ImportError("graphamp.integrations.transformers needs transformers: pip install transformers") from e

__all__ = ["MAX_CONVERSIONS", "compile", "prepare", "source_of"]

# How many graphs one prepared view converts, per training mode and autocast setting, for other
# input structures and shape classes before it refuses (the AmpModule's own limit): Trainer calls
# with one structure per mode, so more means inputs that change structure per call.
MAX_CONVERSIONS = MAX_SHAPE_CLASSES
_CACHE_ARGUMENTS = ("cache", "past_key_values")
_VIEW = "_graphamp_view"  # the view's state, in its __dict__
# Module dicts a view gets its own copy of: its own hooks and top-level attributes, the model's children.
_OWN_DICTS = (
    "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def prepare(
    model: nn.Module,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    config: Config | None = None,
    self_check: str | bool = "raise",
) -> nn.Module:
    """The model, as a view whose ``forward`` runs graphs converted by :func:`graphamp.convert`.

    The first call converts the model, in the view's training mode, from that call's inputs; the
    :class:`graphamp.AmpModule` it makes converts itself again on first use for the other training
    mode and for another input structure or shape class. Each autocast setting followed (below)
    has an AmpModule of its own.

    ``dtype`` None follows the enclosing ``torch.autocast`` region of each call, its dtype and its
    ``cache_enabled``: that is Trainer's ``bf16=True`` (accelerate runs forward in the region), and
    then the graphs switch the region off and apply the same casts. A call outside any region
    raises :class:`graphamp.OptionError` (Trainer without ``bf16=True``, or ``fp16=True`` on CPU,
    where accelerate runs fp32: graphamp would run mixed precision the reference does not). With
    ``dtype`` (and ``config``) given, calls run in that precision in or out of a region; a region
    of another dtype or cache setting raises :class:`graphamp.OptionError`.

    Use it with ``transformers.Trainer(model=prepare(model), args=TrainingArguments(bf16=True, ...))``.

    >>> import transformers
    >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
    ...                               num_attention_heads=2, intermediate_size=32)
    >>> model = transformers.BertForSequenceClassification(cfg).eval()
    >>> view = prepare(model)
    >>> assert isinstance(view, transformers.BertForSequenceClassification) and view.bert is model.bert
    >>> ids = torch.randint(0, 32, (2, 6))
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     expected = model(input_ids=ids).logits
    ...     got = view(input_ids=ids).logits
    >>> assert torch.equal(got, expected)
    """
    _check_model(model, "prepare")
    dtype = None if dtype is None else resolve_dtype(dtype, device_type or "cpu")
    if config is not None and not isinstance(config, Config):
        raise OptionError(f"config must be a graphamp.Config, got {type(config).__name__}")
    state = _Converted(model, dtype, device_type, config, self_check)
    return _view(model, state)


def compile(
    model: nn.Module,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    options: Mapping[str, Any] | None = None,
    dynamic: bool | None = None,
) -> nn.Module:
    """The model, as a view whose ``forward`` runs under ``torch.compile(backend="graphamp")``.

    Each call runs inside a ``torch.autocast`` region, which is where the backend reproduces eager
    autocast: dynamo traces the model's Python as eager autocast runs it, and the compiled graphs
    switch the region off for their own casts. ``dtype`` None follows the enclosing region of each
    call (Trainer's ``bf16=True``), and a call outside any region raises :class:`graphamp.OptionError`;
    with ``dtype``, calls outside a region run inside ``torch.autocast(device_type, dtype)`` and a
    region of another dtype raises. ``options`` are the backend's (``{"inner": "eager"}`` for bitwise
    results; the default, inductor, matches to rounding).

    For ``model.generate()`` with the key/value cache, and for Trainer in place of
    ``TrainingArguments(torch_compile_backend="graphamp")``.

    >>> import transformers
    >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
    ...                               num_attention_heads=2, intermediate_size=32)
    >>> model = transformers.BertForSequenceClassification(cfg).eval()
    >>> view = compile(model, dtype=torch.bfloat16, options={"inner": "eager"})
    >>> ids = torch.randint(0, 32, (2, 6))
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     expected = model(input_ids=ids).logits
    >>> assert torch.equal(view(input_ids=ids).logits, expected) and source_of(view) is model
    """
    _check_model(model, "compile")
    opts = BackendOptions.parse(options)
    if opts.dtype is not None and dtype is not None and resolve_dtype(opts.dtype, "cpu") != resolve_dtype(dtype, "cpu"):
        raise OptionError(f"dtype={dtype!r} and options['dtype']={opts.dtype!r} disagree; pass one of them")
    dtype = dtype if dtype is not None else opts.dtype
    device_type = device_type or opts.device_type or _device_type(model)
    dtype = None if dtype is None else resolve_dtype(dtype, device_type)
    options = {k: v for k, v in (options or {}).items() if k != "dtype"}  # the region's dtype is the backend's
    state = _Compiled(model, dtype, device_type, options, dynamic)
    return _view(model, state)


def source_of(view: nn.Module) -> nn.Module:
    """The model a view of :func:`prepare` or :func:`compile` was made from."""
    state = view.__dict__.get(_VIEW)
    if state is None:
        raise TypeError(f"{type(view).__name__} is not a graphamp view; prepare() and compile() make one")
    return state.model


def _check_model(model: object, frontend: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphamp.integrations.transformers.{frontend} expects a torch.nn.Module, got {type(model).__name__}")

    if isinstance(model, (AmpModule, torch._dynamo.eval_frame.OptimizedModule)):
        what = "converted by graphamp.convert" if isinstance(model, AmpModule) else "compiled by torch.compile"
        raise OptionError(
            f"this {type(model).__name__} was already {what}; {frontend}() makes a view of the model itself. "
            f"Way out: {frontend}(model) with the original model"
            + ("" if isinstance(model, AmpModule) else " (compiled._orig_mod)")
        )
    if _VIEW in model.__dict__:
        raise OptionError(
            f"this model is already a graphamp view ({type(model.__dict__[_VIEW]).__name__.strip('_').lower()}); "
            f"Way out: call {frontend}() on the original model, graphamp.integrations.transformers.source_of(view)"
        )
    if "forward" in model.__dict__:
        # accelerate's prepare (a Trainer run) replaces forward with one under torch.autocast.
        raise OptionError(
            f"this {type(model).__name__} has a forward of its own instance ({model.__dict__['forward']!r}), which "
            "accelerate's prepare() or another wrapper set. Way out: pass the model as built or loaded "
            "(accelerator.unwrap_model(model, keep_fp32_wrapper=False) removes accelerate's)."
        )


def _device_type(model: nn.Module) -> str:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.device.type
    return "cpu"


def _view(model: nn.Module, state: _Converted | _Compiled) -> nn.Module:
    """A module of the model's class sharing its state (children, parameters, buffers, config),
    with a forward of its own that runs ``state``."""
    view = copy.copy(model)
    for name in _OWN_DICTS:
        if name in model.__dict__:
            value = model.__dict__[name]
            view.__dict__[name] = type(value)(value) if not isinstance(value, collections.OrderedDict) else collections.OrderedDict(value)
    view.__dict__[_VIEW] = state
    original = type(model).forward

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__[_VIEW](self, args, kwargs)

    view.forward = types.MethodType(forward, view)
    return view


@contextlib.contextmanager
def _training_as(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` (every submodule) in ``training`` mode for the duration, then as it was."""
    saved = [(m, m.training) for m in model.modules()]
    for m, _ in saved:
        m.training = training
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _ambient(device_type: str) -> tuple[torch.dtype, bool] | None:
    """The enclosing autocast region's (dtype, cache_enabled) on ``device_type``, or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


def _uses_cache(kwargs: dict) -> bool:
    """Whether a call asks for a key/value cache (generate() passes use_cache=True)."""
    # transformers 5 names the cache argument cache=, earlier versions past_key_values=.
    return any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS) or kwargs.get("use_cache") is True


def _no_region_error(model: nn.Module, frontend: str) -> OptionError:
    return OptionError(
        f"this {frontend}d {type(model).__name__} was called outside torch.autocast and was given no dtype, so "
        "nothing says which precision to run: under transformers.Trainer, mixed precision is "
        "TrainingArguments(bf16=True) (accelerate runs the model's forward in torch.autocast; fp16=True on CPU "
        "runs fp32). Way out: TrainingArguments(bf16=True), or call it inside torch.autocast(...), or "
        f"{frontend}(model, dtype=torch.bfloat16) to run graphamp's mixed precision without a region."
    )


def _cache_error(model: nn.Module) -> CaptureError:
    return CaptureError(
        f"this {type(model).__name__} was called with a key/value cache (cache= or past_key_values=, or use_cache=True as "
        "generate() does), and a graph converted by graphamp.convert cannot hold a Hugging Face cache: it is "
        "an object whose tensors change size at every step. Way out: generate with "
        "graphamp.integrations.transformers.compile(model).generate(...) (torch.compile(backend='graphamp') follows the "
        "cache through dynamo), or call this view with use_cache=False (training and evaluation do: Trainer sets "
        "config.use_cache = False)."
    )


class _Converted:
    """A prepared view's state: the model converted by :func:`graphamp.convert` at the first call,
    one :class:`~graphamp.AmpModule` per autocast setting followed (one in all with a dtype given),
    which converts itself again for another training mode, input structure or shape class."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, device_type: str | None, config: Config | None, self_check: str | bool) -> None:
        self.model, self.dtype, self.device_type, self.config, self.self_check = model, dtype, device_type, config, self_check
        # By enclosing region's (dtype, cache_enabled) with no dtype given; under None with one.
        # An AmpModule converts again only for the dtype and config it was converted with.
        self.converted: dict[tuple[torch.dtype, bool] | None, AmpModule] = {}
        # Held while converting, which runs the new graph (its self-check): re-entrant, so that a
        # call reaching this view again on the same thread recurses instead of waiting on itself.
        self.lock = threading.RLock()

    def __call__(self, view: nn.Module, args: tuple, kwargs: dict) -> Any:
        device_type = self.device_type or _device_type(self.model)
        ambient = _ambient(device_type)
        if _uses_cache(kwargs):
            raise _cache_error(self.model)
        if self.dtype is None and ambient is None:
            raise _no_region_error(self.model, "prepare")
        key = ambient if self.dtype is None else None
        amp = self.converted.get(key)
        if amp is None:
            with self.lock:
                amp = self.converted.get(key) or self._convert(view.training, args, kwargs, device_type, ambient)
                self.converted[key] = amp
        self._check_ambient(amp, ambient)
        if amp.training != view.training:
            amp.train(view.training)
        return amp(*args, **kwargs)

    def _convert(self, training: bool, args: tuple, kwargs: dict, device_type: str, ambient: tuple[torch.dtype, bool] | None) -> AmpModule:
        dtype, config = self.dtype, self.config or Config()
        if ambient is not None:
            dtype = dtype or ambient[0]
            if self.config is None and self.dtype is None:
                config = Config(cache_enabled=ambient[1])
        # Conversion runs the model (capture, the self-check) from the caller's random state and
        # restores it, so that the call after draws the dropout masks eager would.
        with rng_kept(), autocast_off(), torch.enable_grad(), _training_as(self.model, training):
            return graphamp.convert(
                self.model, args, kwargs, dtype=dtype, device_type=device_type, config=config, self_check=self.self_check
            )

    @staticmethod
    def _check_ambient(amp: nn.Module, ambient: tuple[torch.dtype, bool] | None) -> None:
        info = getattr(amp, "graphamp_info", None)
        if ambient is None or info is None:
            return
        if ambient[0] != info.dtype:
            raise OptionError(
                f"this call runs inside torch.autocast(dtype={ambient[0]}), but the view's graph was converted for "
                f"{info.dtype}, whose casts it would apply instead. Way out: prepare(model, dtype={ambient[0]}), or "
                "prepare(model) with no dtype, which follows the enclosing region."
            )
        if ambient[1] != info.config.cache_enabled:
            raise OptionError(
                f"this call runs inside torch.autocast(cache_enabled={ambient[1]}), but the view's graph was converted "
                f"with cache_enabled={info.config.cache_enabled}, whose weight casts round gradients differently. "
                "Way out: prepare(model, config=graphamp.Config(cache_enabled=...)) matching the region, or "
                "prepare(model) with no dtype and config, which follows the region."
            )


class _Compiled:
    """A compiled view's state: the model's forward under torch.compile(backend="graphamp")."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, device_type: str, options: dict, dynamic: bool | None) -> None:
        self.model, self.dtype, self.device_type, self.options, self.dynamic = model, dtype, device_type, options, dynamic
        self.compiled: Any = None

    def __call__(self, view: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.compiled is None:
            forward = type(self.model).forward.__get__(view)
            self.compiled = torch.compile(forward, backend="graphamp", options=self.options or None, dynamic=self.dynamic)
        ambient = _ambient(self.device_type)
        if ambient is None and self.dtype is None:
            raise _no_region_error(self.model, "compile")
        if ambient is not None and self.dtype is not None and ambient[0] != self.dtype:
            raise OptionError(
                f"this call runs inside torch.autocast(dtype={ambient[0]}), but the view compiles for {self.dtype}. "
                f"Way out: compile(model, dtype={ambient[0]}), or compile(model) with no dtype, which follows the "
                "enclosing region, or call it outside that region."
            )
        region = contextlib.nullcontext() if ambient is not None else torch.autocast(self.device_type, dtype=self.dtype)
        with region:
            try:
                return self.compiled(*args, **kwargs)
            except AssertionError as e:
                if "Guard failed on the same frame it was created" not in str(e) or key_value_cache(args, kwargs) is None:
                    raise
                raise CaptureError(
                    f"torch.compile(backend='graphamp') could not compile this {type(self.model).__name__} step with its "
                    "key/value cache: running the frame eagerly to observe it (grouped key/value heads) advanced the "
                    "cache, and dynamo's guards then saw it one step ahead. Way out: generate under eager autocast "
                    "(with torch.autocast(...): model.generate(...)), which is the reference this would equal, or pass "
                    "use_cache=False."
                ) from e


