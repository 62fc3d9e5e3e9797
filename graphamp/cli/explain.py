"""``graphamp explain``: argparse front end of :func:`graphamp.explain` over a built-in or user model."""

from __future__ import annotations

import argparse

import graphamp
from graphamp.cli.common import add_model_arguments, load_model

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="every cast decision and its reason, and the numerics against fp32 (first inf/nan, per-module errors)",
        description="Convert a model with graphamp and explain it: per op node the ATen op, module, dtype and why, "
        "and the casts on its inputs; per module a roll-up; the converted graph run node by node beside an fp32 run "
        "(max abs/rel error, SQNR, overflow and flush-to-zero counts, the first node producing inf/nan). "
        "Exit status 1 when an output holds inf/nan the fp32 model does not.",
    )
    add_model_arguments(p, train_help="explain the training-mode graph (default: eval)")
    p.add_argument("--from-model", action="store_true", help="keep the modules the model declares fp32 (transformers' _keep_in_fp32_modules): Config.from_model")
    p.add_argument("--fp32-module", action="append", default=[], metavar="GLOB", help="keep modules matching GLOB in fp32 (repeatable)")
    p.add_argument("--grads", action="store_true", help="also report per-parameter gradient underflow, without and with GradScaler's 65536")
    p.add_argument("--no-numerics", action="store_true", help="decisions only; do not run the model")
    p.add_argument("--html", metavar="PATH", help="write the self-contained HTML report")
    p.add_argument("--json", metavar="PATH", help="write everything as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    model, inputs, kwargs = load_model(args)
    modules = tuple(args.fp32_module)
    if args.from_model:
        modules += graphamp.Config.from_model(model, dtype=args.dtype or "bf16").fp32_modules
    config = graphamp.Config(fp32_modules=modules)
    e = graphamp.explain(model, inputs, kwargs, dtype=args.dtype, config=config, numerics=not args.no_numerics, grads=args.grads)
    print(e)
    if args.html:
        e.to_html(args.html)
        print(f"wrote {args.html}")
    if args.json:
        e.to_json(args.json)
        print(f"wrote {args.json}")
    return 0 if e.ok else 1
