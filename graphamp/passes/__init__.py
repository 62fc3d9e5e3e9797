"""graphamp's graph passes, one verb-named module each, and the pipeline that runs them in order."""

from __future__ import annotations

from torch.fx import GraphModule

from graphamp.config import Config
from graphamp.passes.cache_weights import cache_weights, freeze_weights
from graphamp.passes.check_dtypes import check_dtypes, record_dtypes
from graphamp.passes.dedupe_casts import dedupe_casts
from graphamp.passes.fold_casts import fold_casts
from graphamp.passes.follow_eager_attention import follow_eager_attention
from graphamp.passes.inline_regions import inline_regions
from graphamp.passes.insert_casts import insert_casts
from graphamp.passes.strip_asserts import strip_asserts
from graphamp.policy import Policy

__all__ = [
    "cache_weights",
    "check_dtypes",
    "freeze_weights",
    "dedupe_casts",
    "fold_casts",
    "follow_eager_attention",
    "inline_regions",
    "insert_casts",
    "record_dtypes",
    "strip_asserts",
    "run_pipeline",
]


def run_pipeline(
    gm: GraphModule, policy: Policy, config: Config, *, check: bool, inference: bool = False, cache: bool = True,
    freeze: bool | None = None, kernel_paths: bool = True,
) -> GraphModule:
    """Run the rewrite on a captured graph.

    ``check`` compares every dtype with eager's; ``inference`` declares no gradient will ever be
    taken (casts are shared freely and, unless ``freeze=False``, weights frozen to low precision);
    ``cache`` keeps weights' low-precision copies across calls; ``kernel_paths`` follows eager's
    oneDNN kernel path for nn.LSTM (off where AOTAutograd traces the graph).
    """
    record_dtypes(gm)
    inline_regions(gm)
    strip_asserts(gm)
    follow_eager_attention(gm)
    insert_casts(gm, policy, config, kernel_paths=kernel_paths)
    dedupe_casts(gm, no_grad=inference)
    fold_casts(gm, no_grad=inference)
    if check:
        check_dtypes(gm)
    if inference if freeze is None else freeze:
        freeze_weights(gm)
    if cache:
        cache_weights(gm)
    return gm
