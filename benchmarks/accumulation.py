"""Gradient accumulation: each weight's low-precision cast once per window (TrainStep) or per
micro-batch (eager autocast, and TrainStep with the kept casts switched off), issue 18.

    .venv/bin/python benchmarks/accumulation.py [--models bert_base gpt2] [--accumulate 4]
        [--batch 2] [--seq 32] [--dtype bf16] [--rounds 7] [--threads N]

Each variant trains its own copy of the model with AdamW: ``accumulate`` micro-batches (forward,
loss / accumulate, backward), then the optimizer step. One measurement is one window; variants run
in interleaved rounds (one window each, the order alternating) in one process, and the table gives
the median window time and its ratio to eager autocast; the last column is the median over rounds of
kept / recast. ``trainstep_recast`` is TrainStep with ``TrainStep._casts_kept`` replaced by a null
context (the per-micro-batch casts of before 2026-11-28), so the two TrainStep rows differ only in
the kept casts. Small micro-batches on wide layers are where weight casts weigh most.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import graphamp
from graphamp.hardware import capability
from graphamp.testing import zoo

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = {
    "bert_base": lambda: zoo.bert(layers=12, hidden=768, heads=12, classify=True),
    "bert": lambda: zoo.bert(layers=4, hidden=256, heads=4, classify=True),
    "gpt2": lambda: zoo.gpt2(layers=4, hidden=256, heads=4),
}


def _task(name: str, batch: int, seq: int) -> tuple[torch.nn.Module, Callable, list]:
    case = SIZES[name]()
    case.batch, case.seq = batch, seq
    model = case.model.train()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(8):
        args, kwargs = case.inputs
        kwargs = {**kwargs, "input_ids": torch.randint(0, 1000, kwargs["input_ids"].shape, generator=g)}
        target = torch.randint(0, 3, (batch,), generator=g) if name.startswith("bert") else kwargs["input_ids"]
        batches.append((args, kwargs, target))
    if name.startswith("bert"):
        return model, lambda out, t: F.cross_entropy(out.logits, t), batches
    return model, lambda out, t: F.cross_entropy(out.logits[:, :-1].flatten(0, 1), t[:, 1:].flatten()), batches


def _eager(model, loss_fn, batches, dtype, k) -> Callable[[int], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def window(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        for j in range(k):
            args, kwargs, target = batches[(i * k + j) % len(batches)]
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(model(*args, **kwargs), target)
            (loss / k).backward()
        opt.step()
    return window


def _trainstep(model, loss_fn, batches, dtype, k, *, kept: bool) -> Callable[[int], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = graphamp.TrainStep(model, loss_fn, opt, dtype=dtype, accumulate=k)
    if not kept:
        step._casts_kept = contextlib.nullcontext  # the per-micro-batch casts

    def window(i: int) -> None:
        for j in range(k):
            args, kwargs, target = batches[(i * k + j) % len(batches)]
            step(*args, target=target, **kwargs)
        assert step.stepped
    return window


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert_base", "gpt2"], choices=sorted(SIZES))
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype, k = DTYPES[a.dtype], a.accumulate
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} | {capability('cpu').line()} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__} | {a.dtype} | accumulate {k} | micro-batch {a.batch}x{a.seq}\n")
    print("| model | eager autocast (ms/window) | trainstep_recast | trainstep (kept casts) | kept / recast |")
    print("|---|---:|---:|---:|---:|")
    for name in a.models:
        model, loss_fn, batches = _task(name, a.batch, a.seq)
        variants = {
            "eager": _eager(copy.deepcopy(model), loss_fn, batches, dtype, k),
            "recast": _trainstep(copy.deepcopy(model), loss_fn, batches, dtype, k, kept=False),
            "kept": _trainstep(copy.deepcopy(model), loss_fn, batches, dtype, k, kept=True),
        }
        for fn in variants.values():  # conversion, self-check, optimizer state
            fn(0)
            fn(1)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(a.rounds):
            order = list(variants.items())
            for v, fn in order if r % 2 else reversed(order):  # the order alternates between rounds
                start = time.perf_counter()
                fn(r)
                times[v].append((time.perf_counter() - start) * 1e3)
        med = {v: statistics.median(t) for v, t in times.items()}
        ratio = statistics.median([kt / rt for kt, rt in zip(times["kept"], times["recast"])])
        print(f"| {name} | {med['eager']:.1f} | {med['recast']:.1f} ({med['recast'] / med['eager']:.2f}) | "
              f"{med['kept']:.1f} ({med['kept'] / med['eager']:.2f}) | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
