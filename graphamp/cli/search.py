"""``graphamp search``: argparse front end of :func:`graphamp.search` over a built-in or user model."""

from __future__ import annotations

import argparse
import logging
import sys

import graphamp
from graphamp.cli.common import add_model_arguments, load_model

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="find a small set of modules to keep in fp32 so the converted model's outputs pass (finite, near fp32)",
        description="Search the module tree, guided by explain's per-module error ranking, for a small set of "
        "fp32_modules with which the converted model's outputs are finite and within atol + rtol * max|fp32| of "
        "the fp32 model. Prints each trial, the result, its accuracy and speed. Exit status 1 if nothing passes.",
    )
    add_model_arguments(p, dtype_default="fp16", dtype_help="default: fp16, whose range overflows", train_help="search on the training-mode graph (default: eval)")
    p.add_argument("--atol", type=float, default=None)
    p.add_argument("--rtol", type=float, default=None, help="default: 1e-2 for fp16, 4e-2 for bf16")
    p.add_argument("--max-trials", type=int, default=32)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import warnings
    model, inputs, kwargs = load_model(args)
    log = logging.getLogger("graphamp.search")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", graphamp.SearchWarning)  # the report says so
            config = graphamp.search(model, inputs, kwargs, dtype=args.dtype, atol=args.atol, rtol=args.rtol, max_trials=args.max_trials)
    except graphamp.SearchError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    print(f"graphamp.Config(fp32_modules={tuple(str(m) for m in config.fp32_modules)!r})")
    return 0
