"""graphamp.TrainStep under DistributedDataParallel: 2 CPU processes on gloo, against the eager DDP loop."""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphamp
from graphamp.testing import zoo

WORLD = 2
STEPS = 10
TIMEOUT = 240  # seconds for the whole spawn, imports and conversions included

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

# (name, dtype, scaler, accumulate, steps at which rank 1 alone sees an inf target)
SCENARIOS = [
    ("fp16-gradscaler", torch.float16, "auto", 1, (4,)),
    ("fp16-graph-accumulate", torch.float16, "graph", 2, (9,)),
    ("bf16", torch.bfloat16, "auto", 1, ()),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(rank: int, steps: int, inf_at: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Each rank trains on its own data, as DDP does; rank 1's inf reaches rank 0 through the all-reduce.
    g = torch.Generator().manual_seed(100 + rank)
    lin = torch.linspace(-1, 1, 8)
    grid = torch.stack(torch.meshgrid(lin, lin, indexing="ij")).expand(4, 2, 8, 8)
    out = []
    for i in range(steps):
        x = grid + 0.1 * torch.randn(grid.shape, generator=g)
        y = torch.randn(4, 1, 8, 8, generator=g)
        if rank == 1 and i in inf_at:
            y[0, 0, 0, 0] = float("inf")
        out.append((x, y))
    return out


def _eager_ddp_loop(ddp: DDP, optimizer, batches, *, dtype, scaler, accumulate) -> list[torch.Tensor]:
    """The AMP docs' loop on a DDP model; accumulation windows all-reduce once, under no_sync()."""
    losses = []
    for i, (x, y) in enumerate(batches):
        if i % accumulate == 0:
            optimizer.zero_grad(set_to_none=True)
        last = (i + 1) % accumulate == 0
        with ddp.no_sync() if not last else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(ddp(x), y)
                to_backward = loss / accumulate if accumulate > 1 else loss
            (scaler.scale(to_backward) if scaler is not None else to_backward).backward()
        losses.append(loss.detach())
        if last:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
    return losses


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        # Gloo otherwise picks the interface the hostname resolves to, which may not be loopback.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # Every weight's cast kept through an accumulation window (by default only large ones are), so
    # the accumulating scenario runs DDP's gradient hooks behind the kept casts' backward.
    graphamp.runtime.KEEP_CAST_MIN_NUMEL = 0
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for name, dtype, scaler, accumulate, inf_at in SCENARIOS:
            torch.manual_seed(0)
            # Rank-dependent init: DDP's broadcast from rank 0 must make the replicas agree.
            model = zoo.Checkerboard(width=16, depth=2).train()
            if rank == 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
            eager_model, our_model = copy.deepcopy(model), copy.deepcopy(model)
            eager, ours = DDP(eager_model), DDP(our_model)
            eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
            our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
            batches = _batches(rank, STEPS, inf_at)
            eager_scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
            want = _eager_ddp_loop(eager, eager_opt, batches, dtype=dtype, scaler=eager_scaler, accumulate=accumulate)
            step = graphamp.TrainStep(ours, F.mse_loss, our_opt, dtype=dtype, scaler=scaler,
                                      max_grad_norm=1.0, accumulate=accumulate)
            got, skipped = [], []
            for x, y in batches:
                got.append(step(x, target=y))
                if step.stepped:
                    skipped.append(step.last_step_skipped)
            results[name] = {
                "want": torch.stack(want), "got": torch.stack(got), "skipped": skipped,
                "eager_state": eager_model.state_dict(), "our_state": our_model.state_dict(),
                "eager_scale": eager_scaler.get_scale() if eager_scaler else None,
                "our_scale": step.scaler.get_scale() if step.scaler else None,
                "graph_code": step.module.code,
                "param_names": [n for n, _ in our_model.named_parameters()],
                # The inner module's forward is the graph only during a call.
                "forward_restored": "forward" not in our_model.__dict__,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp")
    context = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the DDP workers did not finish within {TIMEOUT} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", [s[0] for s in SCENARIOS])
def test_ddp_matches_eager_ddp_loop(ddp_results, scenario):
    for rank, results in enumerate(ddp_results):
        r = results[scenario]
        assert len(r["got"]) == STEPS
        assert torch.equal(r["got"], r["want"]), f"rank {rank}: losses {r['got']} != eager {r['want']}"
        assert r["our_scale"] == r["eager_scale"]
        assert r["eager_state"].keys() == r["our_state"].keys()
        for key, value in r["eager_state"].items():
            assert torch.equal(r["our_state"][key], value), f"rank {rank}: {key} differs from eager DDP"
        assert "autocast" not in r["graph_code"]
        assert r["forward_restored"]
    # DDP keeps the parameters equal across ranks: the all-reduce ran on the graph's gradients.
    # (Batch-norm statistics differ: DDP broadcasts them before each forward, which then updates
    # them with each rank's own batch, in eager DDP too.)
    first, second = (results[scenario]["our_state"] for results in ddp_results)
    assert ddp_results[0][scenario]["param_names"]
    for key in ddp_results[0][scenario]["param_names"]:
        assert torch.equal(first[key], second[key]), f"{key} differs between ranks"
    assert not torch.equal(ddp_results[0][scenario]["got"], ddp_results[1][scenario]["got"]), "ranks saw the same data"


@pytest.mark.parametrize("scenario, skipped_step", [("fp16-gradscaler", 4), ("fp16-graph-accumulate", 4)])
def test_inf_on_one_rank_skips_the_step_on_both(ddp_results, scenario, skipped_step):
    # Rank 1 alone sees the inf (at call 4, or call 9 = window 4 of 2 calls); the all-reduce
    # spreads it, so both ranks skip that step, as eager DDP with GradScaler does.
    for results in ddp_results:
        skipped = results[scenario]["skipped"]
        assert skipped == [i == skipped_step for i in range(len(skipped))]
