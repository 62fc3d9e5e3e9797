"""Typed errors. Each names the problem and the way out."""

from __future__ import annotations

__all__ = ["GraphampError", "CaptureError", "UnsupportedFunctionError", "BannedOpError", "PromoteTypeError", "PolicyDriftError", "PolicyDriftWarning", "InputMismatchError", "InputShapeError", "InputValueError", "OptionError", "DeviceMismatchError", "EagerPathWarning", "CheckSkippedWarning", "SearchError", "SearchWarning", "ExportError", "ScriptCaptureError", "CompileError", "CompileFallbackWarning", "GraphBreakError", "UnitInputError", "UnsupportedShardingError", "InputStructureError", "ModelChangedError", "ModelMethodError", "EmulatedPrecisionWarning", "PlanMismatchError"]


class GraphampError(Exception):
    """Base class of every error graphamp raises on purpose."""


class CaptureError(GraphampError, RuntimeError):
    """The model could not be captured as a graph."""


class UnsupportedFunctionError(CaptureError):
    """A custom ``torch.autograd.Function`` in the model cannot be kept whole with its own backward
    (its forward does not run on fake tensors, or it hides tensors from graphamp)."""


class ScriptCaptureError(CaptureError):
    """A ``torch.jit.ScriptModule`` could not be traced into a graph (TorchScript control flow on values, ...)."""


class ExportError(GraphampError, RuntimeError):
    """The converted graph cannot become an ExportedProgram that runs without graphamp."""


class BannedOpError(GraphampError, RuntimeError):
    """An op that autocast bans (``binary_cross_entropy`` under CUDA autocast) is in the graph.

    It is a ``RuntimeError``, as eager autocast's own error is.
    """


class PromoteTypeError(GraphampError, RuntimeError):
    """A promote-list op sees two different lower-precision dtypes, which eager autocast rejects."""


class PolicyDriftError(GraphampError, RuntimeError):
    """In exact mode, the conversion disagrees with eager autocast: a node's dtype differs from what
    eager gave it during capture, or convert's self-check finds an output, output dtype or gradient
    that differs on the example."""

    # True where the self-check raised without locating the difference (convert then tries other
    # conversions, and locates it only if none is exact).
    undiagnosed: bool = False


class PolicyDriftWarning(UserWarning):
    """``convert(..., self_check="warn")`` found a difference from eager autocast on the example (the
    module is returned anyway), or could not run the check."""


class InputMismatchError(GraphampError, ValueError):
    """A converted module was called with inputs its graph was not converted for."""


class InputShapeError(InputMismatchError):
    """An input's size is outside the shape class a converted graph holds (a size the capture made
    static, or a range the model's code bounds). A converted module converts again for a new shape
    class on first use; this is raised where it cannot (the model runs no such shape, the module
    was loaded without its model, or it holds as many shape classes as it may)."""


class InputStructureError(InputMismatchError):
    """Inputs differ from the example in structure (positional count, keyword names, nesting) or in a
    non-tensor value, which a converted graph bakes in; the module converts again for them, within
    its bound on conversions, and raises this beyond it."""


class InputValueError(InputMismatchError):
    """Inputs whose values take another branch of the model's code than the example's: a graph
    captured by following the example's values (where torch.export cannot trace the model's eager
    program) checks each tensor value the model's Python read, and each data-dependent size, as it
    runs. The module converts again for them, within its bound on conversions, and raises this
    beyond it."""


class DeviceMismatchError(GraphampError, ValueError):
    """The policy's device holds none of the model's floating tensors, so autocast would cast nothing."""


class OptionError(GraphampError, ValueError):
    """An option of ``torch.compile(backend="graphamp", options=...)`` is unknown or has a bad value."""


class EagerPathWarning(UserWarning):
    """The model's eager code chooses its program by tensor values, which one graph cannot: the
    converted graph holds one choice (the example's, or the path torch.export takes), so inputs
    that would take another path in eager may get gradients that round differently."""


class CheckSkippedWarning(UserWarning):
    """A check against eager autocast could not run, in whole or in part, so nothing was said about
    what it would have compared. The backend's check of a compiled graph warns it, once per frame
    and reason, naming what was not checked, why, and the way out (``graphamp.verify``, or
    ``graphamp.convert``, which checks its module itself).

    ``reason`` says why: ``"graph_break"`` (the graph holds only part of the frame),
    ``"random"`` (the graph draws random numbers: dropout in training), ``"error"`` (a run of the
    check raised), ``"unpaired"`` (the graph's outputs could not be paired with the frame's return
    value), ``"unread"`` (the outputs returned inside an object whose contents the backend cannot
    locate were not compared; the others were), ``"no_frame"`` (dynamo's frame could not be rebuilt), ``"gradients"`` (the outputs were
    compared, the gradients not), ``"break_instruction"`` (the instruction dynamo runs eagerly at a
    graph break could not be observed, so its torch calls were not compared with eager autocast's).
    """

    reason: str = ""


class SearchError(GraphampError, RuntimeError):
    """``graphamp.search`` found no set of fp32 modules that passes ``validate`` within ``max_trials``."""


class SearchWarning(UserWarning):
    """``graphamp.search`` has nothing to keep in fp32: the model already passes with autocast's policy."""


class ModelChangedError(GraphampError, RuntimeError):
    """The model a converted module shares its parameters with no longer holds them (its parameters
    were re-registered, or ``fully_shard`` sharded it after conversion): the graph would compute
    with, and train, tensors the model and its optimizer no longer see. Also raised where the graph
    fails after the model's tensors changed dtype or device (``model.half()``)."""


class ModelMethodError(GraphampError, AttributeError):
    """A method of the model that a converted module does not pass through: it would run the model's
    own unconverted code (an ``AttributeError``, so ``hasattr`` stays False)."""


class CompileError(GraphampError, RuntimeError):
    """``compile=True``: inductor (or dynamo) could not compile the converted module."""


class GraphBreakError(GraphampError, RuntimeError):
    """``torch.compile(backend="graphamp")`` called outside ``torch.autocast``: dynamo traces and runs
    the code after a graph break without autocast, and that code fails on the values graphamp's graph
    hands over in autocast's dtypes (``scaled_dot_product_attention`` meeting an fp32 query and a
    bf16 value, which autocast would have cast to one dtype). Raised when the graph before the break
    compiles, naming the break and the failing call; the way out is to call the compiled model inside
    ``torch.autocast``. Also raised where code dynamo skips (a graph break inside a loop) fails, run
    without autocast, on the values graphamp's graphs hand over."""


class CompileFallbackWarning(UserWarning):
    """A compiled module could not compile for some inputs and ran its converted graph uncompiled."""


class UnitInputError(InputMismatchError):
    """A sharded unit's graph was called with inputs it was not converted for (other sizes or
    structure). Unlike a plain converted module, the model does not convert again for them: that
    gathers parameters, a collective that one rank cannot run alone in the middle of a forward."""


class UnsupportedShardingError(GraphampError, RuntimeError):
    """A model sharded with FSDP2's ``fully_shard`` uses an option that graphamp's unit-by-unit
    conversion does not support: ``compile=True``, a unit sharded with a non-default
    ``MixedPrecisionPolicy`` (FSDP's own casts), or activation checkpointing in the sharded model
    (``checkpoint_wrapper``, the composable ``checkpoint``, Hugging Face's gradient checkpointing).
    Raised before any capture or collective, on every rank alike, naming the option, the unit and
    the way out."""


class EmulatedPrecisionWarning(UserWarning):
    """The conversion's low dtype is emulated on this machine, so exact mode is slower than fp32."""

    __module__ = "graphamp"


class PlanMismatchError(GraphampError, ValueError):
    """A ``Config(plan=...)`` was made for another model, dtype or device than this conversion."""

    __module__ = "graphamp"
