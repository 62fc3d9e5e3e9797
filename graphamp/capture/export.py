"""Capture with torch.export: dynamic shapes, eager flags, quiet failures and the ranges a model imposes."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.export import Dim, ShapesCollection
from torch.utils import _pytree as pytree

from graphamp.capture.functions import _FunctionKeeper
from graphamp.capture.kernels import eager_kernel_metas
from graphamp.eager import host_draws_found
from graphamp.errors import CaptureError
from graphamp.runtime import size_condition_holds
from graphamp.shared_state import capture_lock, printed_output_held
from graphamp.spec import ambient_autocast


def dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> Any:
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
    output_type = _unregistered_output(text)
    if output_type is not None:
        return _describe_output_type(output_type)
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


_UNREGISTERED_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _unregistered_output(text: str) -> str | None:
    """The qualified name of an output type torch.export cannot flatten, if that is what failed."""
    found = _UNREGISTERED_OUTPUT.search(text)
    return found.group(1) if found else None


def _describe_output_type(qualified: str) -> tuple[str, str]:
    name = qualified.rsplit(".", 1)[-1]
    if qualified.startswith("transformers.") and "cache" in qualified.lower():
        return (
            f"the model returns a {name} (a Hugging Face key/value cache) in its outputs, which a "
            "converted graph cannot return: torch.export flattens outputs with pytree, and the cache is "
            "an object whose tensors it does not know",
            "pass use_cache=False (in kwargs, or set model.config.use_cache = False before converting); "
            "the converted module then returns the same outputs as eager without the cache",
        )
    return (
        f"the model returns a {qualified} in its outputs, which torch.export cannot flatten (the type "
        "is not registered with pytree)",
        f"return tensors, tuples, lists or dicts instead, or register {name} with "
        "torch.utils._pytree.register_pytree_node",
    )


def _is_retryable(e: BaseException) -> bool:
    """Whether another way of capturing (static shapes, the compile path) could succeed where ``e``
    stopped the capture: not for an output type or an op autocast itself rejects."""
    return not _is_autocast_rejection(e) and _unregistered_output(str(e)) is None


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
    by_model: dict = {}
    for expr, line in _model_guards(ep):
        for sym in expr.free_symbols:
            by_model.setdefault(sym, f"{expr} at {line}")
    reasons = {}
    for sym, vr in ranges.items():
        if sym in by_model:
            reasons[str(sym)] = by_model[sym]
        elif getattr(vr.lower, "is_Integer", False) and int(vr.lower) > 1:
            ranges[sym] = ValueRanges(1, vr.upper)
    return ranges, reasons


def _shape_env(ep: torch.export.ExportedProgram | torch.fx.GraphModule) -> Any:
    vals = pytree.tree_leaves([n.meta.get("val") for n in ep.graph.nodes])
    fake = next((v for v in vals if isinstance(v, torch._subclasses.fake_tensor.FakeTensor)), None)
    return fake.fake_mode.shape_env if fake is not None else None


def size_guard_count(gm: torch.fx.GraphModule) -> int:
    """How many size guards the shape environment of ``gm``'s values holds (0 without one)."""
    env = _shape_env(gm)
    return len(env.guards) if env is not None else 0


def size_conditions_since(gm: torch.fx.GraphModule, start: int, by: str) -> list[tuple[str, tuple[str, ...], str]]:
    """The size conditions ``by`` (graphamp's passes) took on ``gm``'s symbolic sizes after the
    environment held ``start`` guards, as :func:`_model_conditions` gives them.

    A pass that traces a composite op's decomposition on the graph's fake values can fix a symbolic
    size to the example's (a kernel that reads a size as an int): the decomposed graph then
    holds that size as a constant, so the converted module must check it, and convert again for
    inputs of another size, instead of failing inside the graph or computing on a wrong view.
    """
    import sympy

    env = _shape_env(gm)
    if env is None:
        return []
    # Only the guards that fix a size (Eq): the ones a traced decomposition turns into constants.
    # Size-oblivious checks (a size is not 1) leave the decomposed graph valid at other sizes.
    fixed = [(guard.expr, by) for guard in env.guards[start:] if isinstance(guard.expr, sympy.Eq)]
    return _conditions(env, fixed, ranges_known=False)


def _model_guards(ep: torch.export.ExportedProgram) -> list[tuple[Any, str]]:
    """The conditions on sizes the model's code (not torch's kernels) took while exporting, each
    with where it is (file:line)."""
    shape_env = _shape_env(ep)
    found = []
    for guard in shape_env.guards if shape_env is not None else ():
        where = getattr(guard.sloc, "framework_loc", None)
        filename = str(getattr(where, "filename", where) or "")
        if not filename.startswith(_KERNEL_FILES):
            line = f"{os.path.basename(filename)}:{getattr(where, 'lineno', '?')}" if filename else "the model's code"
            found.append((guard.expr, line))
    return found


def _model_conditions(ep: torch.export.ExportedProgram) -> list[tuple[str, tuple[str, ...], str]]:
    """The model's size conditions that a range cannot say (``batch != 1``, ``n % 2 == 0``), as
    Python source over the size symbols, with the symbols and where the condition is.

    Under ``backed_size_oblivious`` a condition such as ``x.shape[0] != 1`` leaves the size's range
    open at 1, so the converted module checks the condition itself: an input that breaks it takes
    another branch in eager, and gets its own conversion.
    """
    return _conditions(_shape_env(ep), _model_guards(ep))


def _conditions(env: Any, guards: list[tuple[Any, str]], *, ranges_known: bool = True) -> list[tuple[str, tuple[str, ...], str]]:
    """Size guards (expression, where) as run-time conditions: Python source over the size symbols,
    the symbols, and the guard with where it was taken; ``ranges_known``: a bound on one size is
    left out, as export's ``range_constraints`` hold it."""
    from torch.utils._sympy.printers import PythonPrinter

    # torch 2.13 renamed var_to_val (now a deprecated alias that warns) to backed_var_to_val.
    example = getattr(env, "backed_var_to_val", None) if env is not None else None
    if example is None:
        example = getattr(env, "var_to_val", {})
    conditions = []
    for expr, line in guards:
        if ranges_known and len(expr.free_symbols) == 1 and _is_range(expr):
            continue  # a bound on one size: in range_constraints already
        symbols = sorted(expr.free_symbols, key=str)
        source, sizes = PythonPrinter().doprint(expr), tuple(str(s) for s in symbols)
        # Only what the run-time check can evaluate, and which the example itself passes.
        if all(s in example for s in symbols) and size_condition_holds(source, sizes, [int(example[s]) for s in symbols]):
            conditions.append((source, sizes, f"{expr} at {line}"))
    return conditions


def _is_range(expr: Any) -> bool:
    import sympy

    return isinstance(expr, (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan, sympy.GreaterThan)) and any(
        side.is_number for side in expr.args
    )


def _is_autocast_rejection(e: BaseException) -> bool:
    return "unsafe to autocast" in str(e) or "at::autocast::prioritize" in str(e)


def _export(
    model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, device_type: str, dtype: torch.dtype,
    *, eager_flags: bool, keep_functions: bool = True,
) -> tuple[torch.export.ExportedProgram, _FunctionKeeper]:
    keeper = _FunctionKeeper(keep=keep_functions)
    # backed_size_oblivious lets a dim traced at size >= 2 also accept size 1 at run time
    # (batch 1 inference) instead of pinning the range to [2, inf).
    with (
        capture_lock(),  # export's patches below are process-wide: no other thread traces meanwhile
        fx_config.patch(backed_size_oblivious=True),
        ambient_autocast(device_type, dtype),
        warnings.catch_warnings(),
        # torch.export prints the partial graph before raising; graphamp's CaptureError says what failed.
        printed_output_held(_partial_graphs),
        _eager_flags(model) if eager_flags else contextlib.nullcontext(),
        _dim_marks_restored((args, kwargs)),
        _containers_kept(model),
        _failure_logs_dropped(),
        eager_kernel_metas(),
        keeper,
    ):
        # nn.RNN* re-assign _flat_weights during tracing; export warns about it, harmlessly.
        warnings.filterwarnings("ignore", message=".*were assigned during export.*")
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    return ep, keeper


_MODULE_TABLES = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, the hook dicts, ...


@contextlib.contextmanager
def _containers_kept(model: nn.Module) -> Iterator[None]:
    """Non-strict export swaps a module's list, dict and set attributes for copies while it traces
    and leaves the copies behind; put the model's own objects back (code and users hold them:
    Lightning's ``self.outputs.append(...)``), so conversion never changes the model."""
    held = [
        (m, key, value, copy.copy(value))
        for m in model.modules()
        for key, value in list(vars(m).items())
        if key not in _MODULE_TABLES and type(value) in (list, dict, set)
    ]
    try:
        yield
    finally:
        for m, key, value, before in held:
            if m.__dict__.get(key) is not value:
                m.__dict__[key] = value
            # What the trace put in (timm's LeViT caches a fake attention bias per device) goes too.
            if _refilled(value, before):
                value.clear()
                value.update(before) if not isinstance(value, list) else value.extend(before)


def _refilled(value: list | dict | set, before: list | dict | set) -> bool:
    """Whether a container holds other objects than its copy from before (compared by identity)."""
    if isinstance(value, dict):
        return value.keys() != before.keys() or any(value[k] is not before[k] for k in before)
    if isinstance(value, set):
        return {id(x) for x in value} != {id(x) for x in before}
    return len(value) != len(before) or any(a is not b for a, b in zip(value, before))


# What torch logs (to stderr) on the way to an exception that reaches graphamp, which raises it
# with the construct and the way out: every failing meta kernel with its traceback, and each
# data-dependent size it cannot trace back to the model's code.
_FAILURE_LOGS = {
    "torch._subclasses.fake_tensor": "failed while attempting to run meta",
    "torch.fx.experimental.symbolic_shapes": "Unable to find user code corresponding to",
}


def _drop_failure_log(record: logging.LogRecord) -> bool:
    return not any(record.getMessage().startswith(prefix) for prefix in _FAILURE_LOGS.values())


@contextlib.contextmanager
def _failure_logs_dropped() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _FAILURE_LOGS]
    for logger in loggers:
        logger.addFilter(_drop_failure_log)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_drop_failure_log)


_DIM_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_dynamo_dynamic_range",
              "_dynamo_static_indices", "_dynamo_unbacked_indices", "_has_dynamo_dim_marking")


@contextlib.contextmanager
def _dim_marks_restored(inputs: Any) -> Iterator[None]:
    """The inputs' dynamo dim marks as they were, after an export.

    torch.export marks each ``Dim.AUTO`` size on the input tensor itself and drops the marks only
    when it succeeds: after a failure the user's tensors would stay marked, and a later static
    export of them would trace symbolic sizes all the same.
    """
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    saved = [{k: v for k, v in vars(t).items() if k in _DIM_MARKS} for t in tensors]
    try:
        yield
    finally:
        for t, marks in zip(tensors, saved):
            for k in _DIM_MARKS:
                vars(t).pop(k, None)
            vars(t).update(marks)


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


def _partial_graphs(e: BaseException | None) -> set[str]:
    dumps: set[str] = set()
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if hasattr(e, "partial_fx_graph"):
            dumps.add(str(e.partial_fx_graph))
        e = e.__cause__ or e.__context__
    return dumps


@contextlib.contextmanager
def host_draws_refused(model: nn.Module) -> Iterator[None]:
    """A :class:`CaptureError` after the block where the model's code drew from Python's or numpy's
    global random generator while traced (the generators are put back): a graph holds the draw as
    constants, so every call would repeat it where eager draws anew. convert then compiles the
    model with graph breaks instead (``graphamp.capture.dynamo``), whose Python draws on each call."""
    with host_draws_found() as drew:
        yield
    if drew[0]:
        raise CaptureError(
            f"graphamp could not capture {type(model).__name__} as one graph: its code draws from Python's or "
            "numpy's global random generator (np.random.permutation, random.random, ...; BigBird's random "
            "attention blocks and wav2vec2's SpecAugment masks do in training), and a graph would hold this one "
            "draw as constants, repeated on every call where eager draws anew. Way out: graphamp.convert compiles "
            "such a model with torch.compile(backend=\"graphamp\") instead, whose Python draws on every call; "
            "graphamp.export cannot keep the draw: export the model in eval mode or with that randomness off, "
            "or draw with torch (torch.randperm), which a graph keeps as a random op"
        )

