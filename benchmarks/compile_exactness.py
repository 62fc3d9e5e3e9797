"""Which zoo models are bitwise eager autocast behind inductor (backend="graphamp", inner="inductor").

For each model and each setting of torch._inductor.config.emulate_precision_casts, compiles the
model with graphamp's backend and compares the output and every parameter gradient with eager
torch.autocast (CPU). Prints one row per model: bitwise or the largest difference. With
inner="eager" every model here is bitwise (tests/test_backend.py); inductor differs where it
generates its own reductions (layer_norm, softmax, the bias-gradient sums).

    .venv/bin/python benchmarks/compile_exactness.py [--dtype bf16|fp16] [--models ...]
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from torch.utils import _pytree as pytree

from graphamp.testing import zoo

MODELS = {"bert": False, "gpt2": False, "vit": False, "resnet": False, "transformer_encoder": True, "mha": True}


def _loss(out: object) -> torch.Tensor:
    total = torch.zeros(())
    for i, t in enumerate(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()):
        w = torch.linspace(-1, 1, t.numel()).reshape(t.shape) * (i + 1)
        total = total + (t.float() * w).sum()
    return total


def _run(model: torch.nn.Module, call, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = call(*args, **kwargs)
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return leaves, grads


def compare(name: str, dtype: torch.dtype, emulate: bool) -> str:
    case = zoo.build(name)
    model = case.model.train(MODELS[name])
    args, kwargs = case.inputs

    def eager(*a, **k):
        with torch.autocast("cpu", dtype=dtype):
            return model(*a, **k)

    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=emulate):
        compiled = torch.compile(model, backend="graphamp", options={"dtype": dtype})
        out, grads = _run(model, compiled, args, kwargs)
    ref, ref_grads = _run(model, eager, args, kwargs)
    out_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
    bitwise = [n for n in ref_grads if torch.equal(grads[n], ref_grads[n])]
    grad_diff = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    out_text = "bitwise" if out_diff == 0 else f"max|diff| {out_diff:.2g}"
    return f"| {name} | {'on' if emulate else 'off'} | {out_text} | {len(bitwise)}/{len(ref_grads)} | {grad_diff:.2g} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    a = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    warnings.filterwarnings("ignore")
    print(f"inductor vs eager autocast, {a.dtype}, CPU, torch {torch.__version__}")
    print("| model | emulate_precision_casts | output | grads bitwise | max grad |diff| |")
    print("|---|---|---|---:|---:|")
    for name in a.models:
        for emulate in (False, True):
            print(compare(name, dtype, emulate), flush=True)


if __name__ == "__main__":
    sys.exit(main())
