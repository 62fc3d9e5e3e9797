"""The ``graphamp`` command line: bench, verify and convert-demo."""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils import _pytree as pytree

import graphamp
from graphamp.cli import bench as bench_cli
from graphamp.policy import DTYPE_ALIASES
from graphamp.cli import verify as verify_cli
from graphamp.cli import explain as explain_cli
from graphamp.cli import search as search_cli
from graphamp.cli import export as export_cli
from graphamp.policy import short_dtype
from graphamp.testing import zoo



def _default_model() -> str:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformer_encoder"
    return "bert"


def convert_demo(args: argparse.Namespace) -> int:
    """Convert a built-in model, print its cast summary, and check it against eager autocast."""
    dtype = DTYPE_ALIASES[args.dtype]
    case = zoo.build(args.model)
    model = case.model.train() if args.train else case.model.eval()
    inputs, kwargs = case.inputs
    start = time.perf_counter()
    amp = graphamp.convert(model, inputs, kwargs, dtype=dtype, device_type="cpu")
    seconds = time.perf_counter() - start
    summary = amp.cast_summary()
    nodes = sum(1 for n in amp.graph.nodes if n.op == "call_function")
    print(f"model {case.name} ({type(model).__name__}, {'train' if args.train else 'eval'} mode), cpu/{args.dtype}")
    print(f"converted in {seconds:.2f} s: {nodes} op nodes, {summary['casts']} casts in the graph")
    for kind, n in sorted(summary["by_dtype"].items()):
        print(f"  cast {kind:<10} x{n}")
    print(f"  of which weight casts kept across calls: {summary['cached_weight_casts']}")
    for category, n in sorted(summary["ops_by_category"].items()):
        print(f"  ops {category:<20} x{n}")
    if args.print_graph:
        print(amp.code)
    ok = True
    for b, s in [(case.batch, case.seq), (case.batch + 1, case.seq)]:
        call_args, call_kwargs = case.make_inputs(b, s)
        # Grad mode on: in eval under no_grad, eager nn.TransformerEncoder/MultiheadAttention take a
        # fused fast path that no traced graph takes (see README, Known limits).
        with torch.enable_grad():
            with torch.autocast("cpu", dtype=dtype):
                ref = model(*call_args, **call_kwargs)
            out = amp(*call_args, **call_kwargs)
        pairs = list(zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)))
        equal = all(
            not isinstance(b_, torch.Tensor) or (a.dtype == b_.dtype and torch.equal(a, b_)) for a, b_ in pairs
        )
        dtypes = ", ".join(short_dtype(a.dtype) for a, _ in pairs if isinstance(a, torch.Tensor))
        print(f"inputs batch={b} seq={s}: {len(pairs)} outputs ({dtypes}) bitwise equal to eager autocast: {equal}")
        ok &= equal
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphamp", description="Autocast as a compiler pass.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("convert-demo", help="convert a built-in model and check it against eager autocast")
    demo.add_argument("--model", default=None, help="built-in model name or module:factory (default: bert, or transformer_encoder without transformers)")
    demo.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    demo.add_argument("--train", action="store_true", help="convert in training mode")
    demo.add_argument("--print-graph", action="store_true", help="print the rewritten graph's code")
    demo.set_defaults(func=convert_demo)
    bench_cli.add_parser(sub)
    verify_cli.add_parser(sub)
    explain_cli.add_parser(sub)
    search_cli.add_parser(sub)
    export_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if argv is None and args.command == "bench" and not args.malloc_defaults:  # the graphamp command's own process
        bench_cli.rerun_with_steady_malloc(sys.argv[1:])
    if getattr(args, "model", "") is None:
        args.model = _default_model()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
