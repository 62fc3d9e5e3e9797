"""Time one training step: the eager canonical AMP loop vs graphamp.TrainStep (GradScaler, and "graph").

    .venv/bin/python benchmarks/train_step.py [--models transformer_encoder bert] [--dtype fp16]
                                              [--rounds 7] [--number 10] [--threads N]

Each variant trains its own copy of the model with AdamW and ``max_grad_norm=1.0``: forward and
loss, scaled backward, unscale, clip, step, scale update. Variants are timed in interleaved rounds
(``torch.utils.benchmark.Timer``, ``number`` steps per measurement) so machine noise hits them
alike; the table shows the median per-step time over the rounds. This is a benchmark, not a test:
on a CPU, ``.item()`` is not a device sync, so the sync that ``scaler="graph"`` removes costs
little here, while its select (a copy of parameters and optimizer state per step) does cost.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark

import graphamp
from graphamp.testing import zoo

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _task(name: str) -> tuple[torch.nn.Module, Callable, tuple, dict, object]:
    if name == "bert":
        case = zoo.bert(classify=True)
        args, kwargs = case.inputs
        return case.model.train(), lambda out, t: F.cross_entropy(out.logits, t), args, kwargs, torch.randint(0, 3, (case.batch,))
    case = zoo.build(name)
    model = case.model.train()
    args, kwargs = case.inputs
    with torch.no_grad():
        target = torch.randn(model(*args, **kwargs).shape)
    return model, F.mse_loss, args, kwargs, target


def _eager_step(model, loss_fn, dtype, args, kwargs, target) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model(*args, **kwargs), target)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return step


def _graphamp_step(model, loss_fn, dtype, args, kwargs, target, scaler: str) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step = graphamp.TrainStep(model, loss_fn, opt, dtype=dtype, scaler=scaler, max_grad_norm=1.0)
    return lambda: train_step(*args, target=target, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer_encoder", "bert"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=10, help="steps per measurement")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"cpu/{args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}; median of "
          f"{args.rounds} interleaved rounds of {args.number} steps; AdamW, max_grad_norm=1.0\n")
    print("| model | eager canonical loop | TrainStep (GradScaler) | TrainStep (scaler=\"graph\") |")
    print("|---|---:|---:|---:|")
    for name in args.models:
        model, loss_fn, call_args, call_kwargs, target = _task(name)
        variants = {
            "eager": _eager_step(copy.deepcopy(model), loss_fn, dtype, call_args, call_kwargs, target),
            "gradscaler": _graphamp_step(copy.deepcopy(model), loss_fn, dtype, call_args, call_kwargs, target, "auto"),
            "graph": _graphamp_step(copy.deepcopy(model), loss_fn, dtype, call_args, call_kwargs, target, "graph"),
        }
        timers = {}
        for key, fn in variants.items():
            for _ in range(3):  # conversion, first-call allocations, optimizer state
                fn()
            timers[key] = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        times: dict[str, list[float]] = {key: [] for key in variants}
        for _ in range(args.rounds):
            for key, timer in timers.items():
                times[key].append(timer.timeit(args.number).median)
        med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        cells = [f"{med['eager']:.2f} ms"] + [
            f"{med[k]:.2f} ms ({med[k] / med['eager']:.2f}x)" for k in ("gradscaler", "graph")
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
