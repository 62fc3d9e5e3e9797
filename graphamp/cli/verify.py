"""``graphamp verify``: argparse front end of :func:`graphamp.verify` over a built-in or user model."""

from __future__ import annotations

import argparse

import graphamp
from graphamp.cli.common import add_model_arguments, load_model

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="convert a model and check it against eager autocast, op by op (exit 1 on divergence)",
        description="Convert a model with graphamp and compare it with eager torch.autocast: output "
        "dtypes and values, and the sequence of (op, input dtypes, output dtype); with --grads, every "
        "gradient too. Exit status 0 when all are bitwise equal, 1 otherwise. "
        "--device-type cuda without a GPU runs both sides on fake CUDA tensors (values not compared).",
    )
    add_model_arguments(p, train_help="verify in training mode (default: eval)")
    p.add_argument("--device-type", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--grads", action="store_true",
        help="also backpropagate a fixed loss through both sides and compare every parameter's and "
        "floating input's gradient, naming the first divergent backward node (needs --device-type cpu, or a GPU)",
    )
    p.add_argument(
        "--compile", action="store_true",
        help="also measure the drift of convert(..., compile=True) (inductor, not bitwise) from eager autocast",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    model, inputs, kwargs = load_model(args)
    report = graphamp.verify(model, inputs, kwargs, dtype=args.dtype, device_type=args.device_type, grads=args.grads, compile=args.compile)
    print(report)
    if args.json:
        report.to_json(args.json)
    return 0 if report.ok else 1
