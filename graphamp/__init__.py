"""graphamp: autocast as a compiler pass.

``graphamp.convert`` captures a model as a pre-dispatch ATen graph, inserts the casts eager
``torch.autocast`` would make, prunes redundant ones and returns an inspectable module that runs
in mixed precision with no runtime autocast.
"""

from graphamp.backend.fallback import DynamoAmpModule
from graphamp.compiled import CompiledAmpModule, Drift
from graphamp.config import Config
from graphamp.convert import convert
from graphamp.emit import AmpInfo, AmpModule
from graphamp.export import export, verify_export
from graphamp.errors import (
    BannedOpError,
    CaptureError,
    CheckSkippedWarning,
    CompileError,
    CompileFallbackWarning,
    DeviceMismatchError,
    EmulatedPrecisionWarning,
    GraphampError,
    GraphBreakError,
    InputMismatchError,
    InputShapeError,
    InputStructureError,
    InputValueError,
    ModelChangedError,
    ModelMethodError,
    OptionError,
    PlanMismatchError,
    EagerPathWarning,
    ExportError,
    PolicyDriftError,
    PolicyDriftWarning,
    PromoteTypeError,
    ScriptCaptureError,
    SearchError,
    SearchWarning,
    UnitInputError,
    UnsupportedFunctionError,
    UnsupportedShardingError,
)
from graphamp.autotune.plan import AutotunePlan, BudgetPlan, BudgetStep
from graphamp.policy import Category, Policy, get_policy
from graphamp.train import TrainStep
from graphamp.verify import Report, verify
from graphamp.explain import Explanation, explain
from graphamp.search import SearchReport, search

__all__ = [
    "AmpInfo",
    "AmpModule",
    "AutotunePlan",
    "BudgetPlan",
    "BudgetStep",
    "BannedOpError",
    "CaptureError",
    "Category",
    "CheckSkippedWarning",
    "CompileError",
    "CompileFallbackWarning",
    "UnitInputError",
    "CompiledAmpModule",
    "Config",
    "DeviceMismatchError",
    "Drift",
    "DynamoAmpModule",
    "GraphampError",
    "GraphBreakError",
    "InputMismatchError",
    "InputShapeError",
    "InputStructureError",
    "InputValueError",
    "ModelChangedError",
    "ModelMethodError",
    "OptionError",
    "EagerPathWarning",
    "EmulatedPrecisionWarning",
    "Explanation",
    "ExportError",
    "PlanMismatchError",
    "Policy",
    "PolicyDriftError",
    "PolicyDriftWarning",
    "PromoteTypeError",
    "Report",
    "ScriptCaptureError",
    "SearchError",
    "SearchReport",
    "SearchWarning",
    "TrainStep",
    "UnsupportedFunctionError",
    "UnsupportedShardingError",
    "convert",
    "explain",
    "export",
    "verify_export",
    "get_policy",
    "search",
    "verify",
]

__version__ = "0.1.0"
