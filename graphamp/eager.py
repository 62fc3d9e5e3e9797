"""Running the user's model eagerly: from a restored state, under a spec's autocast, compared.

graphamp runs the model eagerly at conversion and check time; every such run goes through this
module. :func:`state_restored` puts back what a run changes (buffers, parameter objects, Python
containers, random generators); :func:`outcome` runs a call from that state and returns its
outputs and, when asked, the parameters' gradients of :func:`fixed_loss`; :func:`difference`
says in words where two outcomes differ.

The user's random state
-----------------------

graphamp runs the model at conversion and check time (capture, the self-check, the probe,
autotune's timing and accuracy check, the backend's eager check, verify, explain, search), and
seeds it so that both sides of a comparison draw the same dropout masks. Every random generator
of the process is the user's: graphamp puts each back as it found it.

"Every generator" is the CPU default generator and, for the process's accelerator (CUDA, XPU,
MPS, a PrivateUse1 device) where it is initialized, each of its devices' default generators;
XLA's, where ``torch_xla`` is loaded; and Python's global ``random`` generator and numpy's, which
model code draws from too (they are restored, never seeded). An accelerator that is present but not initialized holds
no state of the user's yet, and graphamp neither initializes it nor seeds it: not with
``torch.manual_seed``, which queues a seed on a CUDA not yet initialized that lands when the user
initializes it, and not with ``torch.random.fork_rng(devices=[])``, which keeps the CPU
generator only. graphamp code reads, seeds and restores generators only through this module
(``tests/test_eager_rng.py`` checks the source): :func:`rng_kept` around a run, and
:class:`RngState` where two runs start from the same state.

>>> before = torch.get_rng_state()
>>> with rng_kept(seed=0):
...     a = torch.rand(3)
>>> with rng_kept(seed=0) as start:
...     b = torch.rand(3)
...     start.restore()
...     c = torch.rand(3)
>>> assert torch.equal(a, b) and torch.equal(b, c)
>>> assert torch.equal(torch.get_rng_state(), before)
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphamp.policy import LOW_DTYPES
from graphamp.spec import AmpSpec, autocast_off

__all__ = [
    "Outcome", "RngState", "autocast_call", "difference", "difference_without", "equal", "fixed_loss", "fp32_interface", "fresh_tensor", "holds_values", "host_draws_found", "host_random_state",
    "inputs_copied", "inputs_restored", "outcome", "rng_kept", "same_start", "state_restored",
]


class RngState:
    """A snapshot of every generator the process holds state in (see the module's docstring):
    :meth:`restore` puts each back, :meth:`seed` seeds exactly those.

    >>> state = RngState()
    >>> a = torch.rand(3)
    >>> state.restore()
    >>> assert torch.equal(torch.rand(3), a)
    >>> state.seed(0)
    >>> b = torch.rand(3)
    >>> _ = torch.default_generator.manual_seed(0)
    >>> assert torch.equal(torch.rand(3), b)
    >>> state.restore()
    >>> assert torch.equal(torch.rand(3), a)
    """

    def __init__(self) -> None:
        self.cpu = torch.default_generator.get_state()
        self.accelerator = _initialized_accelerator()
        module = self.accelerator
        self.devices = [module.get_rng_state(i) for i in range(module.device_count())] if module is not None else []
        self.xla = _xla_model()
        self.xla_seed = self.xla.get_rng_state() if self.xla is not None else None
        self.host = host_random_state()

    def restore(self) -> None:
        """Put every generator of the snapshot back in the state it was taken in."""
        torch.default_generator.set_state(self.cpu)
        for i, state in enumerate(self.devices):
            self.accelerator.set_rng_state(state, i)
        if self.xla is not None:
            self.xla.set_rng_state(self.xla_seed)
        _set_host_random_state(self.host)

    def seed(self, seed: int) -> None:
        """Seed every generator of the snapshot (and no other) with ``seed``: on the CPU, the
        stream ``torch.manual_seed(seed)`` starts."""
        torch.default_generator.manual_seed(seed)
        if self.devices:  # each of its devices (MPS has one, and manual_seed only)
            seed_all = getattr(self.accelerator, "manual_seed_all", None) or self.accelerator.manual_seed
            seed_all(seed)
        if self.xla is not None:
            self.xla.set_rng_state(seed)


def host_random_state() -> tuple[Any, Any]:
    """The state of Python's global ``random`` generator and, where the process has loaded numpy,
    numpy's global one: model code draws from them too (BigBird's random attention blocks,
    wav2vec2's SpecAugment masks). graphamp neither seeds them nor imports numpy."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def _set_host_random_state(state: tuple[Any, Any]) -> None:
    python, numpy_state = state
    random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def _same_host_random_state(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    (python_a, numpy_a), (python_b, numpy_b) = a, b
    if python_a != python_b:
        return False
    if numpy_a is None or numpy_b is None:
        return numpy_a is numpy_b
    # ('MT19937', keys, pos, has_gauss, cached_gaussian)
    return all((x == y).all() if hasattr(x, "all") else x == y for x, y in zip(numpy_a, numpy_b))


@contextlib.contextmanager
def host_draws_found() -> Iterator[list[bool]]:
    """Yields a list that holds ``True`` after the block if it drew from Python's or numpy's global
    generator (see :func:`host_random_state`); the generators are put back either way."""
    before, found = host_random_state(), []
    try:
        yield found
    finally:
        found.append(not _same_host_random_state(before, host_random_state()))
        _set_host_random_state(before)


@contextlib.contextmanager
def rng_kept(seed: int | None = None) -> Iterator[RngState]:
    """Every generator of the process restored on exit (also on an exception), and seeded with
    ``seed`` on entry unless it is None. Yields the :class:`RngState` the block starts from
    (seeded, where ``seed`` is given), whose ``restore()`` starts another run from the same state.

    >>> before = torch.get_rng_state()
    >>> try:
    ...     with rng_kept(seed=3):
    ...         _ = torch.rand(2)
    ...         raise RuntimeError("the run failed")
    ... except RuntimeError:
    ...     pass
    >>> assert torch.equal(torch.get_rng_state(), before)
    """
    kept = RngState()
    try:
        if seed is None:
            yield kept
        else:
            kept.seed(seed)
            yield RngState()
    finally:
        kept.restore()


def _initialized_accelerator() -> ModuleType | None:
    """The torch module of the process's accelerator (``torch.cuda``, ...) if it is initialized,
    else None. Availability alone does not count: a CUDA not initialized has no state of the
    user's, and reading its generators would initialize it. MPS has no lazy initialization: there
    a generator exists where the device does."""
    device = torch.accelerator.current_accelerator()
    if device is None:
        return None
    module = torch.get_device_module(device.type)
    ready = getattr(module, "is_initialized", None) or getattr(module, "is_available", None)
    return module if ready is not None and ready() else None


def _xla_model() -> Any:
    """``torch_xla.core.xla_model`` where the user's code has loaded it (graphamp never imports it)."""
    return sys.modules.get("torch_xla.core.xla_model")


@contextlib.contextmanager
def state_restored(model: nn.Module, seed: int | None = None) -> Iterator[RngState]:
    """The model as it was after the block: buffers, parameter and buffer objects, plain Python
    containers, and every random generator (seeded with ``seed`` unless None); yields the random
    state the block starts from."""
    # Every random generator is restored too (graphamp.eager.rng_kept), and seeded with ``seed``
    # unless it is None; it yields the random state the run starts from.
    # A forward in training mode updates batch-norm statistics and draws dropout masks; some
    # models also fill Python caches (timm's LeViT: attention_bias_cache[device] in eval), which
    # a probe run at compile time must not leave behind: dynamo guarded on their contents.
    # Only a buffer the run wrote is copied back: a copy_ bumps the version counter, and autograd
    # refuses a backward through a tensor saved before it (a compile-time probe between a graph's
    # forward and its backward: Gemma's embed_scale, saved by the embedding graph's multiply).
    saved = {name: (buf._version, buf.clone()) for name, buf in model.named_buffers()}
    # Code that assigns a buffer (or parameter) in forward leaves another object in the model,
    # which a converted module would take for a replaced tensor: the objects go back too.
    # (Not in a model holding FSDP units, whose forward swaps sharded and gathered parameters by
    # design and may leave them gathered, nor in TorchScript modules, whose tables are the script's.)
    modules = list(model.modules())
    sharded = any(type(m).__name__.startswith("FSDP") for m in modules)
    tables = [] if sharded else [
        (table, dict(table)) for m in modules for table in (m._parameters, m._buffers) if isinstance(table, dict)
    ]
    containers = [
        (value, copy.copy(value))
        for m in model.modules()
        for key, value in vars(m).items()
        if not key.startswith("_") and type(value) in (dict, list, set)
    ]
    with rng_kept(seed) as start:
        try:
            yield start
        finally:
            for table, before in tables:
                for key, value in before.items():
                    if table.get(key, value) is not value:
                        table[key] = value
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    # (A kernel's own write, batch norm's running statistics, leaves the version.)
                    if name in saved and (buf._version != saved[name][0] or _differs(buf, saved[name][1])):
                        buf.copy_(saved[name][1])
            for value, before in containers:  # in place: code and guards hold these objects
                value.clear()
                value.update(before) if not isinstance(value, list) else value.extend(before)


def _differs(now: torch.Tensor, before: torch.Tensor) -> bool:
    try:
        return not torch.equal(now, before)
    except Exception:  # a fake tensor (verify's fake CUDA) has no values to compare: copy it back
        return True


def fresh_tensor(t: torch.Tensor, storages: dict[Any, Any]) -> torch.Tensor:
    """``t`` on a copy of its storage, so a run of the model cannot write the caller's tensor (code
    may write its inputs in place: ``x.mul_(2)``, ``hidden_states[mask] += y``); tensors that share
    a storage share the copy (a view and its base stay aliased). Parameters, leaves that require grad
    (autograd refuses to write them in place, and gradients are taken with respect to them) and
    tensors that are not plain dense tensors (fake, sparse, subclasses) are returned as they are."""
    if (
        isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad) or type(t) is not torch.Tensor
        or t.layout is not torch.strided or t.is_quantized or t.is_nested
    ):
        return t
    # One tensor passed twice stays one tensor: code branches on identity (nn.MultiheadAttention
    # takes its fused self-attention path only where query is key is value).
    same = ("tensor", id(t))
    if same in storages:
        return storages[same]
    if t.is_conj() or t.is_neg():  # a lazy conjugate or negation is a bit of the view, not of its storage
        storages[same] = t.clone()
        return storages[same]
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), t.device) if storage.nbytes() else id(t)
    if key not in storages:
        storages[key] = storage.clone()
    fresh = torch.empty((), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        fresh.set_(storages[key], t.storage_offset(), t.size(), t.stride())
    storages[same] = fresh.requires_grad_(t.requires_grad)
    return storages[same]


def inputs_copied(inputs: Any) -> Any:
    """The example inputs with every tensor :func:`fresh_tensor` copies copied: graphamp's runs of
    the model write graphamp's copy, never the user's example.

    >>> x = torch.zeros(3)
    >>> (y,), _ = inputs_copied(((x,), {}))
    >>> _ = y.add_(1)
    >>> assert torch.equal(x, torch.zeros(3))
    """
    storages: dict[Any, Any] = {}
    return pytree.tree_map_only(torch.Tensor, lambda t: fresh_tensor(t, storages), inputs)


@contextlib.contextmanager
def inputs_restored(inputs: Any) -> Iterator[None]:
    """The input tensors a run writes in place put back after it, so the next run starts from the
    same values (only those written: a ``copy_`` bumps the version counter)."""
    kept = [(t, t._version, t.clone()) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.layout is torch.strided]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, version, before in kept:
                if t._version != version:
                    t.copy_(before)


class Outcome:
    """One run's outputs (detached) and gradients of the fixed loss, by parameter name."""

    def __init__(self, outputs: Any, grads: dict[str, torch.Tensor | None]) -> None:
        self.outputs = outputs
        self.grads = grads


def autocast_call(model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec) -> Any:
    """``model(*args, **kwargs)`` under eager ``torch.autocast`` as ``spec`` says."""
    with torch.autocast(spec.device_type, dtype=spec.dtype, cache_enabled=spec.cache_enabled):
        return model(*args, **kwargs)


@contextlib.contextmanager
def same_start(model: nn.Module) -> Iterator[None]:
    """Both sides start from the same random state and buffers, and leave both as they found them."""
    with state_restored(model, seed=0), autocast_off():  # the same dropout masks on each side
        yield


def outcome(call: Callable[[], Any], model: nn.Module, *, grads: bool, no_grad: bool, inputs: Any = ()) -> Outcome:
    """``call()`` run from the model's restored state (:func:`same_start`), the tensors of ``inputs``
    (what it passes) put back after where it wrote them: its outputs and, with ``grads``, the
    gradients of :func:`fixed_loss` by parameter name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if grads else []
    with same_start(model), inputs_restored(inputs), (torch.no_grad() if no_grad else torch.enable_grad()):
        out = call()
        values = {}
        if named:
            loss = fixed_loss(out)
            if loss.requires_grad:
                found = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                values = {n: g for (n, _), g in zip(named, found)}
    return Outcome(pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), values)


def fixed_loss(out: Any) -> torch.Tensor:
    """verify's fixed loss: every floating output, position-weighted, summed in fp32:
    sum_i (i + 1) * (out_i.float() * linspace(-1, 1)).sum(). Position-dependent weights give every
    output element a distinct gradient, so a gradient that lands in the wrong place, or is summed in
    another order, shows."""
    total = torch.zeros((), dtype=torch.float32)
    floats = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for i, t in enumerate(floats):
        w = torch.linspace(-1, 1, t.numel(), dtype=torch.float32, device=t.device).reshape(t.shape) * (i + 1)
        total = total + (t.float() * w).sum().to(total.device)
    return total


def fp32_interface(inputs: Any) -> Any:
    """keep_io_types takes in fp32 the floating inputs the example gave in bf16/fp16 (and casts them
    back inside, so the values eager saw are the ones the graph sees)."""
    return pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in LOW_DTYPES else t, inputs)


def difference_without(
    model: nn.Module, args: tuple, kwargs: dict, names: tuple[str, ...], spec: AmpSpec, *, grads: bool
) -> str:
    """The first difference between eager autocast called with ``kwargs`` and with each of
    ``names`` passed as None, both from the same state; "" where eager treats them as absent
    (outputs, dtypes and, with ``grads``, parameter gradients bitwise)."""
    dropped = {**kwargs, **dict.fromkeys(k for k in names if k in kwargs)}
    ref = outcome(lambda: autocast_call(model, args, kwargs, spec), model, grads=grads, no_grad=not grads, inputs=(args, kwargs))
    got = outcome(lambda: autocast_call(model, args, dropped, spec), model, grads=grads, no_grad=not grads, inputs=(args, dropped))
    return difference(got, ref, keep_io_types=False)


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values, NaN where both are NaN."""
    return a.shape == b.shape and (torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or not a.is_floating_point() or not b.is_floating_point():
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return f"max abs difference {float((a.double() - b.double()).abs().nan_to_num(float('inf')).max()):.3g}"


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """The leaves with their pytree paths; by position where a registered type has no key paths
    (diffusers' output classes register no ``flatten_with_keys_fn``)."""
    try:
        return [("output" + pytree.keystr(path), leaf) for path, leaf in pytree.tree_leaves_with_path(tree)]
    except ValueError:
        return [(f"output leaf {i}", leaf) for i, leaf in enumerate(pytree.tree_leaves(tree))]


def difference(got: Outcome, ref: Outcome, *, keep_io_types: bool = False) -> str:
    """The first difference between two outcomes (``ref`` is eager's), in words; "" if none:
    values bitwise (NaN where both are NaN), dtypes, and gradients."""
    got_leaves, ref_leaves = _named_leaves(got.outputs), _named_leaves(ref.outputs)
    if len(got_leaves) != len(ref_leaves):
        return f"the output has {len(got_leaves)} leaves, eager's has {len(ref_leaves)}"
    for (name, a), (_, b) in zip(got_leaves, ref_leaves):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return f"{name} is a {type(a).__name__}, eager's is a {type(b).__name__}"
        if not isinstance(a, torch.Tensor):
            if a != b and not (a != a and b != b):  # NaN floats compare unequal to themselves
                return f"{name} is {a!r}, eager's is {b!r}"
            continue
        if keep_io_types and b.dtype in (torch.bfloat16, torch.float16) and a.dtype == torch.float32:
            b = b.float()  # keep_io_types returns low-precision outputs in fp32, by request
        if a.dtype != b.dtype:
            return f"{name} comes back {a.dtype}, eager autocast gives {b.dtype}"
        if not equal(a, b):
            return f"{name} differs ({_max_abs(a, b)})"
    for name, want in ref.grads.items():
        have = got.grads.get(name)
        if (have is None) != (want is None):
            return f"gradient of {name} is {'missing' if have is None else 'present'} where eager's is {'present' if want is not None else 'missing'}"
        if have is not None and not equal(have, want):
            return f"gradient of {name} differs ({_max_abs(have, want)})"
    return ""


def holds_values(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the model and inputs hold values an eager run can compare (no fake or meta tensors)."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]
    return not any(isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or t.device.type == "meta" for t in tensors)
