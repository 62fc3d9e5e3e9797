"""graphamp's graph passes, one verb-named module each, and the pipeline that runs them in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch  # noqa: F401  (the doctests' namespace)
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.autotune import autotune
from graphamp.passes.cache_weights import cache_weights, freeze_weights
from graphamp.passes.check_dtypes import check_dtypes, record_dtypes
from graphamp.passes.dedupe_casts import dedupe_casts
from graphamp.passes.fold_casts import fold_casts
from graphamp.passes.follow_eager_attention import follow_eager_attention
from graphamp.passes.fuse_encoder_layers import fuse_encoder_layers
from graphamp.passes.inline_regions import inline_regions
from graphamp.passes.insert_casts import insert_casts
from graphamp.passes.keep_io_types import keep_io_types
from graphamp.passes.strip_asserts import strip_asserts
from graphamp.spec import AmpSpec

__all__ = [
    "autotune",
    "cache_weights",
    "check_dtypes",
    "freeze_weights",
    "dedupe_casts",
    "fold_casts",
    "fuse_encoder_layers",
    "follow_eager_attention",
    "inline_regions",
    "insert_casts",
    "keep_io_types",
    "record_dtypes",
    "strip_asserts",
    "Pass",
    "build_pipeline",
    "run_passes",
]


@dataclasses.dataclass(frozen=True)
class Pass:
    """One step of the pipeline: a name and a function ``(gm, spec) -> PassResult``."""

    name: str
    run: Callable[[GraphModule, AmpSpec], PassResult]


def build_pipeline(spec: AmpSpec, *, check: bool | None = None) -> list[Pass]:
    """The passes a conversion runs, in order, for what ``spec`` asks.

    ``check`` overrides ``spec.check`` (compare every dtype with eager's).

    >>> spec = AmpSpec("cpu", torch.bfloat16, inference=True)
    >>> assert [p.name for p in build_pipeline(spec)][-2:] == ["freeze_weights", "cache_weights"]
    >>> spec = AmpSpec("cpu", torch.bfloat16, inference=True, target="export", keep_io_types=True)
    >>> assert [p.name for p in build_pipeline(spec)][-2:] == ["keep_io_types", "freeze_weights"]
    """
    steps = [
        Pass("record_dtypes", record_dtypes),
        Pass("inline_regions", inline_regions),
        Pass("strip_asserts", strip_asserts),
        Pass("follow_eager_attention", follow_eager_attention),
        Pass("fuse_encoder_layers", fuse_encoder_layers),
        Pass("insert_casts", insert_casts),
        Pass("dedupe_casts", dedupe_casts),
        Pass("fold_casts", fold_casts),
    ]
    if spec.mode == "autotune":
        steps.append(Pass("autotune", autotune))
    if spec.check if check is None else check:
        steps.append(Pass("check_dtypes", check_dtypes))
    if spec.keep_io_types:
        steps.append(Pass("keep_io_types", keep_io_types))
    if spec.target in ("module", "export"):
        # AOTAutograd and inductor take the casts as they are (freezing folds them there).
        if spec.inference:
            steps.append(Pass("freeze_weights", freeze_weights))
        if spec.target == "module":
            steps.append(Pass("cache_weights", cache_weights))
    return steps


def run_passes(gm: GraphModule, spec: AmpSpec, passes: list[Pass], *, lint: bool = False) -> GraphModule:
    """Run ``passes`` on ``gm`` in order. Any exception names the pass that raised it and the
    passes before it (as a note: its type and message stay what the pass raised); ``lint``
    checks the graph after every pass."""
    for i, step in enumerate(passes):
        try:
            step.run(gm, spec)
            if lint:
                gm.graph.lint()
        except Exception as e:
            done = ", ".join(p.name for p in passes[:i]) or "none"
            e.add_note(f"in graphamp pass {step.name} (passes run before it: {done})")
            raise
    return gm
