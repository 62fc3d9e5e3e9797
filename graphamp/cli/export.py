"""``graphamp export``: write a mixed-precision ExportedProgram, or an AOTInductor package, for a model."""

from __future__ import annotations

import argparse
import os
import sys

import graphamp
from graphamp.cli.common import add_model_arguments, load_model

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a model in mixed precision (torch.export program or AOTInductor package), runnable without graphamp",
        description="Export a model with graphamp.export: a torch.export ExportedProgram equal to eager "
        "torch.autocast, with weights used only in low precision stored low, and no graphamp call in it. "
        "--aoti compiles it with AOTInductor into a .pt2 package (load with torch._inductor.aoti_load_package).",
    )
    add_model_arguments(p)
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the program (torch.export.save) or, with --aoti, the package")
    p.add_argument("--aoti", action="store_true", help="compile with AOTInductor (torch._inductor.aoti_compile_and_package)")
    p.add_argument("--keep-io-types", action="store_true", help="take floating inputs in fp32 and return low-precision floating outputs in fp32")
    p.add_argument("--static", action="store_true", help="fix every input size to the example's (default: dynamic where the model allows)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import torch
    model, inputs, kwargs = load_model(args)  # eval: export is for inference
    try:
        ep = graphamp.export(model, inputs, kwargs, dtype=args.dtype, keep_io_types=args.keep_io_types, dynamic=not args.static)
    except graphamp.GraphampError as e:
        print(f"graphamp export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.aoti:
        torch._inductor.aoti_compile_and_package(ep, package_path=args.out)
    else:
        torch.export.save(ep, args.out)
    kind = "AOTInductor package" if args.aoti else "ExportedProgram"
    print(f"wrote {kind} {args.out} ({os.path.getsize(args.out) / 2**20:.2f} MiB) for {args.model}")
    return 0
