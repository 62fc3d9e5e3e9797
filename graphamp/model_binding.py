"""How a converted module is bound to its model: it holds the model's own parameters and buffers,
under the model's names and in the model's order (so that an optimizer built on
``model.parameters()`` trains the converted module and ``state_dict`` keys match); its forward shows
the model's signature; and the model runs eagerly for it in the training mode its graph was
converted in."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphamp.model_state import Versions

__all__ = ["FROZEN", "FROZEN_VERSIONS", "follow_replaced_buffers", "graph_reads", "in_model_order", "recast_frozen", "share_state", "signed_forward", "take_frozen_versions", "training_as"]


def share_state(amp: nn.Module, model: nn.Module) -> None:
    """Register ``model``'s parameters and buffers in ``amp`` under the same paths (creating the
    submodules the paths pass through), as the same objects; buffers that stay out of the model's
    ``state_dict`` (non-persistent ones, constants export lifted) stay out of ``amp``'s.

    >>> model, amp = nn.Sequential(nn.Linear(2, 2)), nn.Module()
    >>> share_state(amp, model)
    >>> assert amp.get_parameter("0.weight") is model[0].weight
    """
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


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    for p in parents:
        if not hasattr(module, p):
            module.add_module(p, nn.Module())
        module = getattr(module, p)
    return module, name


def in_model_order(amp: nn.Module, model: nn.Module) -> None:
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


# An inference=True module's weights frozen to low precision: {buffer path: weak reference to the
# model's parameter it was cast from}, and the Versions of those parameters when last cast.
FROZEN = "_graphamp_frozen"
FROZEN_VERSIONS = "_graphamp_frozen_versions"


def recast_frozen(amp: nn.Module) -> None:
    """Cast ``amp``'s frozen low-precision weights again from the model's parameters, and take their
    versions: a later update in place of one of them casts again (``AmpModule._check_parameters``)."""
    frozen = amp.__dict__.get(FROZEN) or {}
    for path, source in frozen.items():
        param = source()
        if param is None:
            raise RuntimeError(
                f"cannot refresh {path}: the model it was converted from is gone. Way out: keep the "
                "model alive, or load new weights with load_state_dict(model.state_dict())"
            )
        with torch.no_grad():
            amp.get_buffer(path).copy_(param)
    take_frozen_versions(amp)


def take_frozen_versions(amp: nn.Module) -> None:
    """Record the versions of the parameters ``amp``'s frozen weights were cast from (None where
    it froze none)."""
    frozen = amp.__dict__.get(FROZEN) or {}
    amp.__dict__[FROZEN_VERSIONS] = Versions(source() for source in frozen.values()) if frozen else None


def graph_reads(amp: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers ``amp``'s graph reads, by name."""
    reads = dict(amp.named_parameters(remove_duplicate=False))
    reads.update(amp.named_buffers(remove_duplicate=False))
    return reads


def follow_replaced_buffers(modules: list[nn.Module], model: nn.Module, names: list[str]) -> list[str]:
    """Of ``names``, the buffers the model now holds as another tensor of the same shape, strides,
    dtype and device (a forward that assigns ``self.buf = ...``, as I-BERT's activation ranges do):
    bound in each of ``modules`` (a converted module first, then those it converted for other
    inputs) that held the first one's old tensor, so that the graphs read them as eager's next call
    does. Returns the names it bound.

    >>> model, amp = nn.BatchNorm1d(2), nn.Module()
    >>> share_state(amp, model)
    >>> model.running_mean = torch.ones(2)
    >>> assert follow_replaced_buffers([amp], model, ["running_mean"]) == ["running_mean"]
    >>> assert amp.running_mean is model.running_mean
    """
    held, bound = dict(model.named_buffers(remove_duplicate=False)), []
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        first = _submodule(modules[0], prefix)
        new, old = held.get(name), first._buffers.get(leaf) if first is not None else None
        if new is None or old is None or new is old or _kind(new) != _kind(old):
            continue
        for module in modules:
            owner = _submodule(module, prefix)
            if owner is not None and owner._buffers.get(leaf) is old:
                owner._buffers[leaf] = new
        bound.append(name)
    return bound


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _kind(t: torch.Tensor) -> tuple:
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.layout, t.requires_grad)


@contextlib.contextmanager
def training_as(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` (every submodule) in the given training mode for the duration, then as it was:
    the converted module's graph fixed its mode, which the model may have left since.

    >>> model = nn.Sequential(nn.Dropout()).eval()
    >>> with training_as(model, True):
    ...     assert model[0].training
    >>> assert not model[0].training
    """
    saved = [(m, m.training) for m in model.modules()]
    if any(flag != training for _, flag in saved):
        model.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def signed_forward(dispatch: Callable[..., Any], model: nn.Module | None) -> Callable[..., Any]:
    """``dispatch`` (AmpModule.forward) as a function of its own, showing the model's forward's
    signature (HF Trainer drops the dataset columns it does not name).

    >>> class Model(nn.Module):
    ...     def forward(self, input_ids, attention_mask=None):
    ...         return input_ids
    >>> forward = signed_forward(lambda self, *args, **kwargs: args, Model())
    >>> assert list(inspect.signature(forward).parameters) == ["self", "input_ids", "attention_mask"]
    """

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return dispatch(self, *args, **kwargs)

    forward.__doc__ = dispatch.__doc__
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
