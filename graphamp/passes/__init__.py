"""graphamp's graph passes, one verb-named module each, and the pipeline that runs them in order."""

from __future__ import annotations

from torch.fx import GraphModule

from graphamp.config import Config
from graphamp.passes.check_dtypes import check_dtypes, record_dtypes
from graphamp.passes.dedupe_casts import dedupe_casts
from graphamp.passes.fold_casts import fold_casts
from graphamp.passes.inline_regions import inline_regions
from graphamp.passes.insert_casts import insert_casts
from graphamp.passes.strip_asserts import strip_asserts
from graphamp.policy import Policy

__all__ = [
    "check_dtypes",
    "dedupe_casts",
    "fold_casts",
    "inline_regions",
    "insert_casts",
    "record_dtypes",
    "strip_asserts",
    "run_pipeline",
]


def run_pipeline(gm: GraphModule, policy: Policy, config: Config, *, check: bool) -> GraphModule:
    """Run the rewrite on a captured graph; ``check`` compares the result with eager's dtypes."""
    record_dtypes(gm)
    inline_regions(gm)
    strip_asserts(gm)
    insert_casts(gm, policy, config)
    dedupe_casts(gm)
    fold_casts(gm)
    if check:
        check_dtypes(gm)
    return gm
