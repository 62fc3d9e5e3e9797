"""``convert(..., compile=True)``: graphamp's graph, with its casts, through AOTAutograd and inductor.

A converted :class:`~graphamp.AmpModule` runs op by op. On a CPU that computes bf16 natively,
``torch.compile`` + autocast beats it, because inductor fuses the elementwise work around the
matmuls. So the compiled path hands the converted graph to ``torch.compile`` with autocast off:
every cast is graphamp's, and inductor fuses them into its kernels. Dynamo traces the graph alone
(:func:`flat_program`, over flat tensors and the module's own parameters): the converted module's
input checks and pytree flattening run in Python around it, since traced they add guards that
dynamo evaluates on every call (on the bench's conv net, 468 guard lines against 236). A parameter
replaced on the model after conversion raises ``ModelChangedError``, as uncompiled. With
``inference=True`` inductor's freezing folds the weights, already cast low, and prepacks them for oneDNN.

It is opt-in and not bitwise: inductor computes fused elementwise chains, reductions (layer_norm,
softmax) and bf16 roundings its own way. :attr:`CompiledAmpModule.drift` records, on the example,
the largest difference from eager autocast; :func:`measure_drift` measures it on other inputs.
A failure to compile at conversion raises :class:`CompileError`; a later one (dynamo recompiling
for new inputs) warns :class:`CompileFallbackWarning` and runs the converted module uncompiled,
which is exact.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from graphamp.capture.kernels import eager_kernel_metas
from graphamp.emit import AmpModule
from graphamp.model_binding import graph_reads
from graphamp.model_state import Versions
from graphamp.node_info import GRAPHAMP, GraphInfo, graph_info, peek_graph_info
from graphamp.errors import CompileError, CompileFallbackWarning, GraphampError, InputMismatchError, InputShapeError, InputValueError, ModelChangedError
from graphamp.runtime import compiled_guards, restored_on_refusal
from graphamp.passes.fuse_encoder_layers import opaque_fused_layers
from graphamp.shared_state import compile_scoped
from graphamp.spec import autocast_off
from graphamp.eager import autocast_call, outcome, state_restored
from graphamp.backend.inductor import Inductor, freezing_patch, inductor_patches
from graphamp.probe import attribute_bound

__all__ = [
    "CompileError", "CompileFallbackWarning", "CompiledAmpModule", "CompiledOptimizerStep", "Drift", "compile_converted",
    "compiled_for_training", "measure_drift",
]

_log = logging.getLogger("graphamp")

# Ops whose values come from a random generator: inductor draws them from its own, so a compiled
# training forward with dropout cannot be compared value by value with eager.
_RANDOM_OPS = ("dropout", "native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "randperm", "multinomial", "normal", "uniform")


@dataclasses.dataclass(frozen=True)
class Drift:
    """How far a compiled module's outputs (and gradients) are from eager autocast's, on one input.

    ``max_abs`` is the largest absolute difference over every floating output; ``max_rel`` the
    largest difference relative to the largest magnitude of that output in eager; ``grads_max_abs``
    the same over parameter gradients of verify's fixed loss and ``grads_max_rel`` it relative to
    the largest gradient magnitude over all parameters (None when not compared): one scale for the
    gradients, since a gradient that is zero in exact arithmetic (a convolution's bias before batch
    norm: eager gives 1e-5-sized noise) would make its own ratio meaningless. ``bitwise`` is True
    when every compared value is equal. ``comparable`` is False when the module draws random numbers
    (dropout in training), which inductor draws from its own generator: then no value was compared
    and ``note`` says so.
    """

    max_abs: float | None
    max_rel: float | None
    dtypes_match: bool
    bitwise: bool
    grads_max_abs: float | None = None
    grads_max_rel: float | None = None
    comparable: bool = True
    note: str = ""
    # The output dtypes differ from eager autocast's by design: an autotune plan's raised ops
    # return fp32, as the uncompiled converted module's do.
    dtypes_by_plan: bool = False

    def line(self) -> str:
        if not self.comparable:
            return f"drift not measured: {self.note}"
        out = f"outputs max abs {self.max_abs:.3g} (rel {self.max_rel:.3g})"
        if self.grads_max_abs is not None:
            out += f", gradients max abs {self.grads_max_abs:.3g} (rel {self.grads_max_rel:.3g})"
        if not self.dtypes_match and self.dtypes_by_plan:
            out += f", output dtypes as the autotune plan makes them ({self.note})"
        elif not self.dtypes_match:
            out += ", OUTPUT DTYPES DIFFER" + (f" ({self.note})" if self.note else "")
        return out + (" (bitwise)" if self.bitwise else "")


class CompiledAmpModule(nn.Module):
    """A converted module compiled by inductor: what ``graphamp.convert(..., compile=True)`` returns.

    Its parameters, buffers and ``state_dict`` keys are those of the converted module, so the
    model's own ``Parameter`` objects: an optimizer on ``model.parameters()`` trains it. ``.amp``
    is the converted module (``print(cm.amp.code)`` shows every cast inductor compiles);
    ``.drift`` what conversion measured against eager autocast on the example.

    >>> import torch, graphamp
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16))
    >>> x = torch.randn(4, 16)
    >>> cm = graphamp.convert(model, (x,), compile=True)
    >>> assert isinstance(cm, graphamp.CompiledAmpModule) and cm.get_parameter("0.weight") is model[0].weight
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     expected = model(x)
    >>> y = cm(x)
    >>> assert y.dtype == expected.dtype and float((y.float() - expected.float()).abs().max()) < 0.1
    >>> assert cm.drift.max_abs < 0.1 and cm.drift.dtypes_match
    """

    __module__ = "graphamp"

    def __init__(
        self, amp: AmpModule, *, freezing: bool | None = None, inductor_mode: str | None = None, options: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        if not isinstance(amp, AmpModule):
            raise TypeError(f"CompiledAmpModule compiles a graphamp.AmpModule, got {type(amp).__name__}")
        info = amp.graphamp_info
        # The converted module's own state containers: the same parameters under the same names.
        self.__dict__["_parameters"] = amp._parameters
        self.__dict__["_buffers"] = amp._buffers
        self.__dict__["_modules"] = amp._modules
        self.__dict__["_non_persistent_buffers_set"] = amp._non_persistent_buffers_set
        self.__dict__["amp"] = amp
        self.__dict__["_freezing"] = info.inference if freezing is None else bool(freezing)
        self.__dict__["_inductor_mode"] = inductor_mode
        self.__dict__["_options"] = dict(options or {})  # more inductor config patches (cpp_wrapper)
        self.__dict__["_compiled"] = None
        self.__dict__["_fallback_warned"] = False
        self.__dict__["_lock"] = threading.Lock()
        self.training = amp.training
        self.meta: dict[str, Any] = {}  # graphamp's record of it, a GraphInfo (drift, compile_s), as on an AmpModule

    @property
    def graphamp_info(self) -> Any:
        return self.amp.graphamp_info

    @property
    def code(self) -> str:
        """The converted graph's code: the casts inductor compiles."""
        return self.amp.code

    @property
    def options(self) -> dict[str, Any]:
        """Inductor config patches beyond graphamp's own (a copy): ``{"cpp_wrapper": True}`` where autotune kept it."""
        return dict(self.__dict__.get("_options", {}))

    @property
    def freezing(self) -> bool:
        """Whether inductor's freezing folds the weights into the code (inference, unless autotune timed it slower)."""
        return self.__dict__["_freezing"]

    @property
    def runs_compiled(self) -> bool:
        """False once the module fell back to its converted graph uncompiled (see ``CompileFallbackWarning``)."""
        return not self.__dict__.get("_fallback")

    @property
    def drift(self) -> Drift | None:
        """What conversion measured against eager autocast on the example (None if not measured)."""
        return (peek_graph_info(self) or GraphInfo()).drift

    def _compiled_fn(self) -> Callable[..., Any]:
        compiled = self.__dict__["_compiled"]
        if compiled is None:
            with self.__dict__["_lock"]:
                compiled = self.__dict__["_compiled"]
                if compiled is None:
                    patches = inductor_patches(freezing=self.__dict__["_freezing"])
                    if self.__dict__["_inductor_mode"] is not None:
                        from torch._inductor import list_mode_options

                        patches.update(list_mode_options(self.__dict__["_inductor_mode"]))
                    patches.update(self.__dict__.get("_options", {}))
                    compiled = torch.compile(_own_function(flat_program(self.amp)), backend=Inductor(patches))
                    # Freezing folds the values of what the graph reads, and does not write, into its code.
                    self.__dict__["_folded"] = Versions(graph_reads(self.amp).values()) if self.__dict__["_freezing"] else None
                    self.__dict__["_settled"] = False
                    self.__dict__["_compiled"] = compiled
        return compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_fallback"):
            return self.amp(*args, **kwargs)
        # Shapes that failed to compile run uncompiled from then on, without tracing again.
        refused = self.__dict__.get("_refused_shapes")
        if refused and _shapes_of(args, kwargs) in refused:
            return self.amp(*args, **kwargs)
        try:
            return self._call_compiled(args, kwargs)
        except InputShapeError as e:  # another shape class: the uncompiled module converts for it
            self.__dict__.setdefault("_refused_shapes", set()).add(_shapes_of(args, kwargs))
            self._warn_fallback(e)
            return self.amp(*args, **kwargs)
        except InputValueError as e:  # values the model branches on another way: converted again, uncompiled
            if not self.__dict__.get("_value_warned"):
                self.__dict__["_value_warned"] = True
                warnings.warn(
                    f"graphamp: these inputs take another path through the model's code than the example ({_first_line(e)}); "
                    "they run in the uncompiled module, which converts again for them (exact, slower). Inputs that take "
                    "the example's path stay compiled.",
                    CompileFallbackWarning,
                    stacklevel=2,
                )
            return self.amp(*args, **kwargs)
        except (InputMismatchError, ModelChangedError):
            raise  # another dtype or structure, or a replaced parameter: the uncompiled module refuses it too
        except Exception as e:
            if not _is_compile_failure(e):
                raise
            self.__dict__.setdefault("_refused_shapes", set()).add(_shapes_of(args, kwargs))
            self._warn_fallback(e)
            return self.amp(*args, **kwargs)

    def _call_compiled(self, args: tuple, kwargs: dict) -> Any:
        info = self.amp.graphamp_info
        # Outside the compiled code, so that dynamo traces (and inductor freezes) the program as it
        # runs: no autocast (the graph holds every cast) and, for inference, no grad.
        ambient = torch.is_autocast_enabled(info.device_type)
        restore = (peek_graph_info(self.amp) or GraphInfo()).restore_on_refusal
        # The structure and flattening the converted module's forward does, here in Python: dynamo
        # traces the graph alone, so its guards are the graph's.
        followed = self.amp._check_parameters()  # a parameter replaced on the model: ModelChangedError, as uncompiled
        folded = self.__dict__.get("_folded")
        if (followed and self.__dict__["_freezing"]) or (folded is not None and folded.moved()):  # freezing folded the old
            self._compile_again_for_new_weights()
        flat_in, out_spec = flat_io(self.amp)
        if self.amp.plain_call(args, kwargs):
            flat = args
        else:
            self.amp.check_structure(args, kwargs)
            flat = fx_pytree.tree_flatten_spec((list(args), dict(kwargs)), flat_in) if flat_in is not None else list(args)
        with (
            restored_on_refusal(self.amp, *restore) if restore else _nothing(),
            compiled_guards(),
            autocast_off((info.device_type,)) if ambient else _nothing(),
            torch.no_grad() if info.inference and torch.is_grad_enabled() else _nothing(),
            compile_scoped(*self._compile_settings()),
        ):
            out = self._compiled_fn()(*flat)
        if not self.__dict__.get("_settled", True):  # the first run: what it wrote in place is not folded
            self.__dict__["_settled"], self.__dict__["_folded"] = True, self.__dict__["_folded"] and self.__dict__["_folded"].unmoved()
        return pytree.tree_unflatten(list(out), out_spec) if out_spec is not None else out

    def _compile_settings(self) -> tuple[Callable[[], contextlib.AbstractContextManager], ...]:
        """What the compiles of this module's calls run under (and nothing else does): inductor's
        freezing where it freezes; the widened fake kernel where the graph calls ``_grouped_mm``."""
        return (*((freezing_patch,) if self.__dict__["_freezing"] else ()), *((eager_kernel_metas,) if self._calls_grouped_mm() else ()))

    def _calls_grouped_mm(self) -> bool:
        """Whether the graph calls ``aten._grouped_mm`` (MoE experts), whose fake kernel refuses the fp32 operands
        its CPU kernel takes: compiles trace with :func:`eager_kernel_metas` then, as capture does."""
        found = self.__dict__.get("_grouped_mm")
        if found is None:
            found = self.__dict__["_grouped_mm"] = any(n.target is torch.ops.aten._grouped_mm.default for n in self.amp.graph.nodes)
        return found

    def _warn_fallback(self, e: BaseException) -> None:
        if not self.__dict__["_fallback_warned"]:
            self.__dict__["_fallback_warned"] = True
            warnings.warn(
                f"graphamp: compiling the converted module for these inputs failed ({type(e).__name__}: "
                f"{_first_line(e)}); it ran uncompiled (exact, slower). Inputs of other shape classes are "
                "converted again by the uncompiled module; pad inputs to the example's shape class to stay compiled.",
                CompileFallbackWarning, stacklevel=3,
            )

    def refresh(self) -> None:
        """Re-cast the weights from the model (``AmpModule.refresh``); compile again on the next call (freezing folded them)."""
        self.amp.refresh()
        self.__dict__["_compiled"] = None

    def _compile_again_for_new_weights(self) -> None:
        """A tensor freezing folded was updated in place since: its old value is in the compiled code."""
        again = self.__dict__.get("_compiled_again", 0)
        self.__dict__["_compiled_again"] = again + 1
        _log.log(
            logging.WARNING if again == 0 else logging.INFO, "graphamp: the weights of the compiled %s changed since inductor's freezing folded them into its code: "
            "compiling again (%d time(s)). For weights that change between calls, convert with inference=False.",
            type(self.amp).__name__.removesuffix("Amp"), again + 1,
        )
        self.refresh()

    def train(self, mode: bool = True) -> CompiledAmpModule:
        self.amp.train(mode)  # raises on a change: the mode is part of the graph
        return self

    def cast_summary(self) -> dict[str, Any]:
        return self.amp.cast_summary()

    def extra_repr(self) -> str:
        info = self.amp.graphamp_info
        options = "".join(f", {k}={v!r}" for k, v in self.__dict__.get("_options", {}).items())
        return f"inductor{' (freezing)' if self.__dict__['_freezing'] else ''}{options}, {info.device_type} {info.dtype}, mode={info.mode!r}"

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_compiled"] = None  # compiled code does not pickle: compiled again after loading
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__["_lock"] = threading.Lock()

    def __deepcopy__(self, memo: dict) -> CompiledAmpModule:
        import copy

        amp = copy.deepcopy(self.amp, memo)  # AmpModule's deepcopy keeps the conversion's record
        new = CompiledAmpModule(amp, freezing=self.__dict__["_freezing"], inductor_mode=self.__dict__["_inductor_mode"], options=self.__dict__.get("_options"))
        new.meta = dict(self.meta)
        if (record := peek_graph_info(self)) is not None:
            new.meta[GRAPHAMP] = dataclasses.replace(record)  # its own record, not the original's
        memo[id(self)] = new
        return new


_nothing = contextlib.nullcontext


_COUNTER = itertools.count()


def _own_function(target: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``target``, with a code object of its own. Dynamo keeps compiled code per
    code object, at most ``torch._dynamo.config.recompile_limit`` (8) entries, and past that runs the
    frame uncompiled: one shared wrapper for every compiled module would silently stop compiling
    at the ninth."""
    source = "def graphamp_compiled(*args, **kwargs):\n    return target(*args, **kwargs)\n"
    namespace: dict[str, Any] = {"target": target}
    exec(compile(source, f"<graphamp compiled {next(_COUNTER)}>", "exec"), namespace)  # noqa: S102
    return namespace["graphamp_compiled"]


def flat_program(amp: AmpModule) -> GraphModule:
    """``amp``'s graph as a GraphModule over its flat tensor inputs, returning its flat outputs, that
    reads ``amp``'s own submodules, parameters and buffers (the model's objects, as they are at each
    call): what :class:`CompiledAmpModule` compiles."""
    # Graph.__deepcopy__ less its codegen's copy: the plain CodeGen replaces it, and deep-copying the
    # pytree specs it holds warns (FutureWarning, LeafSpec) in torch 2.13.
    graph = torch.fx.Graph()
    output, old_output = graph.graph_copy(amp.graph, {}, return_output_node=True)
    graph.output(output, type_expr=getattr(old_output, "type", None)).meta = copy.copy(old_output.meta)
    opaque_fused_layers(graph)
    program = GraphModule(amp, graph, class_name="GraphampFlatProgram")
    # Not the copies GraphModule makes of the attributes the graph reads: the converted module's own.
    for name in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        program.__dict__[name] = amp.__dict__[name]
    return program


def flat_io(amp: AmpModule) -> tuple[Any, Any]:
    """The pytree specs of ``amp``'s inputs and outputs (None, None where its graph takes and returns
    flat values)."""
    info = getattr(amp.graph._codegen, "pytree_info", None)
    return (info.in_spec, info.out_spec) if info is not None else (None, None)


def _shapes_of(args: tuple, kwargs: dict) -> tuple:
    return tuple(tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message; for dynamo's ``BackendCompilerFailed``, whose first line
    only names the backend, that of the error inductor raised, after its type."""
    inner = getattr(e, "inner_exception", None)
    if isinstance(inner, BaseException):
        return f"{type(inner).__name__}: {_first_line(inner)}"
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


def _is_compile_failure(e: BaseException) -> bool:
    """Whether ``e`` is dynamo or inductor failing, not the model's own error at run time."""
    from torch._dynamo import exc

    failures = tuple(
        getattr(exc, name) for name in ("BackendCompilerFailed", "Unsupported", "InternalTorchDynamoError", "TorchRuntimeError", "UserError")
        if hasattr(exc, name)
    )
    return isinstance(e, (*failures, GraphampError))


def _random_ops(amp: AmpModule) -> list[str]:
    found = []
    for node in amp.graph.nodes:
        if node.op == "call_function":
            name = getattr(getattr(node.target, "_schema", None), "name", "") or getattr(node.target, "__name__", "")
            short = name.split("::")[-1]
            p = node.args[1] if short in ("dropout", "native_dropout") and len(node.args) > 1 else None
            if short in _RANDOM_OPS and not (isinstance(p, (int, float)) and p == 0):  # dropout(p=0) draws nothing
                found.append(short)
    return found


def measure_drift(cm: CompiledAmpModule, model: nn.Module, args: tuple = (), kwargs: dict | None = None, *, grads: bool | None = None) -> Drift:
    """The compiled module's difference from eager autocast on these inputs, outputs and (``grads``,
    default: where the conversion keeps a gradient path) parameter gradients of verify's fixed loss.

    Both sides start from the same random state with buffers restored. A module that draws random
    numbers in its forward (dropout in training mode) is not comparable value by value: inductor
    draws them from its own generator; the result says so instead of reporting a meaningless error.
    """
    kwargs = dict(kwargs or {})
    info = cm.amp.graphamp_info
    random = _random_ops(cm.amp) if info.training else []
    if grads is None:
        grads = not info.inference and not random and any(p.requires_grad for p in model.parameters())
    spec = info.spec()
    ref = outcome(lambda: autocast_call(model, args, kwargs, spec), model, grads=grads, no_grad=info.inference, inputs=(args, kwargs))
    got = outcome(lambda: cm(*args, **kwargs), model, grads=grads, no_grad=info.inference, inputs=(args, kwargs))
    out_abs, out_rel, same_dtypes, bitwise = _tree_errors(pytree.tree_leaves(got.outputs), pytree.tree_leaves(ref.outputs))
    if random:  # output dtypes and shapes still compare
        return Drift(None, None, same_dtypes, False, comparable=False, note=(
            f"the module draws random numbers ({', '.join(sorted(set(random)))}) in training mode, which inductor "
            "draws from its own generator; measure drift with dropout off (p=0) or in eval mode"
        ))
    g_abs = g_rel = None
    if grads:
        names = [n for n in ref.grads if ref.grads[n] is not None and got.grads.get(n) is not None]
        g_abs, g_rel, _, g_bitwise = _tree_errors([got.grads[n] for n in names], [ref.grads[n] for n in names], one_scale=True)
        bitwise = bitwise and g_bitwise
    return Drift(out_abs, out_rel, same_dtypes, bitwise, g_abs, g_rel)


def _tree_errors(got: list[Any], ref: list[Any], *, one_scale: bool = False) -> tuple[float, float, bool, bool]:
    """(largest absolute difference, largest relative difference, same dtypes and shapes, bitwise).
    Relative to each tensor's largest magnitude in ``ref``, or with ``one_scale`` to the largest
    magnitude over all of ``ref``."""
    worst_abs = worst_rel = 0.0
    def magnitude(b: torch.Tensor) -> float:
        return float(b.double().abs().nan_to_num(0.0).max())

    overall = max(
        (magnitude(b) for b in ref if isinstance(b, torch.Tensor) and b.is_floating_point() and b.numel()), default=0.0
    ) if one_scale else 0.0
    same_dtypes = len(got) == len(ref)
    bitwise = same_dtypes
    for a, b in zip(got, ref):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        same_dtypes = same_dtypes and a.dtype == b.dtype and a.shape == b.shape
        if not (a.is_floating_point() and b.is_floating_point()) or a.shape != b.shape or not a.numel():
            bitwise = bitwise and a.shape == b.shape and torch.equal(a, b)
            continue
        diff = (a.double() - b.double()).abs()
        if bool((diff.isnan() & ~b.isnan()).any()):
            return math.inf, math.inf, same_dtypes, False
        err = float(diff.nan_to_num(0.0).max())
        scale = overall if one_scale else magnitude(b)
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / scale if scale else (0.0 if err == 0 else math.inf))
        bitwise = bitwise and err == 0.0
    return worst_abs, worst_rel, same_dtypes, bitwise


def compile_converted(
    amp: nn.Module, model: nn.Module, args: tuple, kwargs: dict, *, inductor_mode: str | None = None, options: dict[str, Any] | None = None,
    freezing: bool | None = None,
) -> nn.Module:
    """``amp`` compiled (inductor's ``freezing`` for inference unless ``freezing`` says), and compiled
    now: the example runs through it once (model state restored after), which is where a failure to
    compile raises :class:`CompileError`; its difference from eager autocast is kept in ``.drift``."""
    if not isinstance(amp, AmpModule):  # the dynamo fallback (graph breaks): already torch.compile'd
        warnings.warn(
            f"graphamp.convert(compile=True): {type(model).__name__} needed dynamo's graph breaks, so it runs "
            "as torch.compile(model, backend=\"graphamp\") with eager inner graphs, not through inductor.",
            CompileFallbackWarning,
            stacklevel=3,
        )
        return amp
    cm = CompiledAmpModule(amp, freezing=freezing, inductor_mode=inductor_mode, options=options)
    start = time.perf_counter()
    try:
        with state_restored(model), torch.inference_mode(False), torch.enable_grad():
            cm._call_compiled(args, kwargs)
    except InputMismatchError:
        raise
    except Exception as e:
        raise CompileError(
            f"graphamp.convert(compile=True): inductor could not compile the converted {type(model).__name__} "
            f"({type(e).__name__}: {_first_line(e)}). The converted graph itself is fine. Way out: "
            "convert(..., compile=False) for the exact, uncompiled module, or torch.compile(model, "
            "backend=\"graphamp\")."
        ) from e
    graph_info(cm).compile_s = time.perf_counter() - start
    try:
        drift = measure_drift(cm, model, args, kwargs)
    except Exception as e:  # the drift is a report; eager that cannot run leaves it unmeasured
        drift = Drift(None, None, True, False, comparable=False, note=f"eager autocast could not run the example ({type(e).__name__}: {_first_line(e)})")
    graph_info(cm).drift = drift
    if not drift.dtypes_match and _dtypes_follow_converted(cm, amp, model, args, kwargs):
        drift = graph_info(cm).drift = dataclasses.replace(drift, dtypes_by_plan=True, note=(
            "raised ops return fp32 where eager autocast returns the low dtype, as the uncompiled module's do"))
    elif not drift.dtypes_match:
        # Inductor ran another program, not the converted graph rounded differently (the autocast
        # state a fused kernel's call sets inside the graph, lost in compilation): never return that.
        cm.__dict__["_fallback"] = True
        warnings.warn(
            f"graphamp.convert(compile=True): the compiled {type(model).__name__} returns other output dtypes or "
            "shapes than eager autocast on the example, so it runs uncompiled (exact). This is a torch.compile "
            "limitation on this model (a fused kernel graphamp runs under autocast, such as an eval "
            "nn.TransformerEncoderLayer's with inference=True); convert with inference=False to compile it.",
            CompileFallbackWarning,
            stacklevel=3,
        )
    return cm


def _dtypes_follow_converted(cm: CompiledAmpModule, amp: AmpModule, model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the compiled module returns the output dtypes and shapes of the uncompiled converted
    module on the example. In exact mode those are eager autocast's; ``mode="autotune"`` may
    return others by design (a raised ``lm_head`` returns fp32 logits), which
    is the converted program, not inductor running another one."""
    if amp.graphamp_info.mode == "exact":
        return False  # the converted module's dtypes are eager autocast's, which the compiled ones miss
    no_grad = amp.graphamp_info.inference
    got = outcome(lambda: cm(*args, **kwargs), model, grads=False, no_grad=no_grad, inputs=(args, kwargs))
    ref = outcome(lambda: amp(*args, **kwargs), model, grads=False, no_grad=no_grad, inputs=(args, kwargs))
    return _tree_errors(pytree.tree_leaves(got.outputs), pytree.tree_leaves(ref.outputs))[2]


def compiled_for_training(amp: nn.Module) -> nn.Module:
    """``TrainStep(compile=True)``'s model-and-loss: the converted module compiled by inductor,
    compiled on its first call (the first training step)."""
    if not isinstance(amp, AmpModule):
        warnings.warn(
            f"graphamp.TrainStep(compile=True): the model was converted as a {type(amp).__name__}, which is "
            "not one graph inductor can take; it runs uncompiled.",
            CompileFallbackWarning,
            stacklevel=3,
        )
        return amp
    return CompiledAmpModule(amp, freezing=False)


class CompiledOptimizerStep:
    """An optimizer's ``step`` compiled by inductor: one fused kernel over every parameter instead of
    a Python loop of small ops (AdamW on CPU runs its default single-tensor loop otherwise).

    :meth:`bound` makes ``optimizer.step`` the compiled step for its duration, so that
    ``GradScaler.step`` and graph-mode selection call it unchanged. A fused optimizer
    (``fused=True``), a step with a closure, and a step that fails to compile (warning
    :class:`CompileFallbackWarning` once) run the optimizer's own step. Inductor computes the
    update in another order than the eager loop: parameters differ from it by rounding. A
    learning rate given as a Python float recompiles when a scheduler changes it; pass it as a
    tensor (``lr=torch.tensor(1e-3)``) to keep one compiled step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        fused = any(group.get("fused") for group in optimizer.param_groups)
        self.enabled = not fused and not getattr(optimizer, "_step_supports_amp_scaling", False)
        eager = type(optimizer).step
        self._eager = eager
        self._compiled = torch.compile(_own_function(functools.partial(eager, optimizer)))
        self._warned = False

    def __call__(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if not self.enabled or closure is not None or kwargs:
            return self._eager(self.optimizer, closure, **kwargs) if closure is not None else self._eager(self.optimizer, **kwargs)
        try:
            return self._compiled()
        except Exception as e:
            if not _is_compile_failure(e):
                raise
            self.enabled = False
            warnings.warn(
                f"graphamp.TrainStep(compile=True): compiling {type(self.optimizer).__name__}.step failed "
                f"({type(e).__name__}: {_first_line(e)}); it runs uncompiled.",
                CompileFallbackWarning,
                stacklevel=2,
            )
            return self._eager(self.optimizer)

    def bound(self) -> Any:
        """A context in which ``optimizer.step`` is this compiled step."""
        return attribute_bound(self.optimizer, "step", self)
