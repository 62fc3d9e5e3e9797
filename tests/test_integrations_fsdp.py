"""graphamp on FSDP2 (fully_shard) models: 2 CPU processes on gloo, against eager autocast + FSDP2."""

from __future__ import annotations

import copy
import datetime
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
STEPS = 5
TIMEOUT = 240  # seconds for the whole spawn, imports and conversions included
VOCAB = 64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False, attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg).train()


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList([_Block(width) for _ in range(2)])
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _shard(model: nn.Module, units: list[nn.Module]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return model


def _lm_loss(out, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _eager_loop(model: nn.Module, opt, loss_fn, batches, *, clip: float | None) -> list[torch.Tensor]:
    """The AMP docs' bf16 loop on an FSDP2 model: forward and loss under autocast, backward, step."""
    losses = []
    for args, kwargs, target in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(*args, **kwargs), target)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.detach())
    return losses


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _compare(eager: nn.Module, ours: nn.Module, initial: dict, want: list, got: list, extra: dict | None = None) -> dict:
    eager_params, our_params = _gathered(eager), _gathered(ours)
    return {
        "want": torch.stack(want), "got": torch.stack(got),
        "eager": eager_params, "ours": our_params, "initial": initial,
        "forward_restored": all("forward" not in m.__dict__ for m in ours.modules()),
        **(extra or {}),
    }


def _llama_batches(rank: int) -> list[tuple]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as FSDP trains
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        out.append(((), {"input_ids": ids}, ids.clone()))
    return out


def _mlp_batches(rank: int) -> list[tuple]:
    g = torch.Generator().manual_seed(200 + rank)
    return [((torch.randn(4, 8, generator=g),), {}, torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _scenario_llama_trainstep(rank: int) -> dict:
    import graphamp

    base = _llama()
    eager = copy.deepcopy(base)
    _shard(eager, list(eager.model.layers))
    ours = copy.deepcopy(base)
    _shard(ours, list(ours.model.layers))
    initial = _gathered(ours)
    batches = _llama_batches(rank)
    want = _eager_loop(eager, _adamw(eager), _lm_loss, batches, clip=1.0)
    step = graphamp.TrainStep(ours, _lm_loss, _adamw(ours), dtype=torch.bfloat16, max_grad_norm=1.0)  # self_check="raise"
    got = [step(*args, target=target, **kwargs) for args, kwargs, target in batches]
    result = _compare(eager, ours, initial, want, got, {
        "self_check": step.module.meta["graphamp"].self_check.ok,
        "units": step.module.meta["graphamp"].fsdp_units,
        "code": step.module.code,
    })
    # Other sizes, on every rank at once: run as eager does, or refused with a typed error (a unit
    # captured with static sizes cannot convert again inside FSDP's forward, on one rank alone).
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(300 + rank))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        result["other_sizes_eager"] = _lm_loss(eager(input_ids=ids), ids)
    try:
        result["other_sizes"] = step(input_ids=ids, target=ids)
    except Exception as e:  # noqa: BLE001 (the type is what the test checks)
        result["other_sizes"] = (type(e).__name__, isinstance(e, graphamp.InputMismatchError), str(e))
    return result


def _scenario_mlp_convert(rank: int) -> dict:
    import graphamp
    from graphamp.integrations import fsdp
    from graphamp.spec import AmpSpec

    torch.manual_seed(0)
    base = _MLP().train()
    eager = copy.deepcopy(base)
    _shard(eager, list(eager.blocks))
    ours = copy.deepcopy(base)
    _shard(ours, list(ours.blocks))
    initial = _gathered(ours)
    batches = _mlp_batches(rank)
    # Optimizers are built while every parameter is sharded: after a forward without backward, the
    # root keeps its gathered parameters (reshard_after_forward=False), which parameters() lists.
    eager_opt, our_opt = _adamw(eager), _adamw(ours)
    want = _eager_loop(eager, eager_opt, F.mse_loss, batches, clip=None)
    (x0,), _, _ = batches[0]
    # convert's default self-check on a sharded model is FSDP's (backward through FSDP, shards compared).
    amp = graphamp.convert(ours, (x0,), dtype=torch.bfloat16)
    check = amp.meta["graphamp"].self_check
    # The same loop: the loss outside the graph runs under autocast, as eager's; amp switches it off inside.
    got = _eager_loop(amp, our_opt, F.mse_loss, batches, clip=None)
    result = _compare(eager, ours, initial, want, got, {
        "self_check": check.ok,
        "units": amp.meta["graphamp"].fsdp_units,
        "amp_params_are_model_params": [id(p) for p in amp.parameters()] == [id(p) for p in ours.parameters()],
        "not_stale": fsdp.sharded_after_conversion(amp) is None,
    })
    # A forward without grad (casts of weights that need no grad path may be kept across calls, and
    # FSDP refills the gathered parameters' storage each forward), a training step, and again.
    evals = []
    for _ in range(2):
        with torch.no_grad():
            ours_out = amp(x0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                eager_out = eager(x0)
        evals.append((ours_out, eager_out))
        _eager_loop(amp, our_opt, F.mse_loss, batches[1:2], clip=None)
        _eager_loop(eager, eager_opt, F.mse_loss, batches[1:2], clip=None)
    result["evals"] = evals
    return result


def _scenario_errors(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    import graphamp
    from graphamp.errors import GraphampError
    from graphamp.integrations import fsdp

    out = {}
    # Converted first, sharded after: the graph reads the pre-shard parameters.
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    _shard(model, list(model.blocks))
    out["detected"] = fsdp.sharded_after_conversion(amp)
    try:
        amp(x)
        out["call"] = None
    except Exception as e:  # noqa: BLE001 (the type is what the test checks)
        out["call"] = (isinstance(e, GraphampError), type(e).__name__, str(e))
    # Modules sharded as one group (fully_shard([a, b])): FSDP's hooks treat their forwards as one.
    torch.manual_seed(0)
    grouped = _MLP()
    fully_shard(list(grouped.blocks))
    fully_shard(grouped)
    opt = torch.optim.AdamW(grouped.parameters(), lr=1e-2)
    step = graphamp.TrainStep(grouped, F.mse_loss, opt, dtype=torch.bfloat16)
    try:
        step(x, target=torch.randn(4, 1))
        out["grouped"] = None
    except Exception as e:  # noqa: BLE001
        out["grouped"] = (isinstance(e, graphamp.CaptureError), type(e).__name__, str(e))
    return out


def _refused(call) -> tuple | None:
    """None if ``call()`` ran, else the error's type name, whether it is the typed refusal, its message."""
    from graphamp.errors import UnsupportedShardingError

    try:
        call()
    except Exception as e:  # noqa: BLE001 (the type is what the test checks)
        return (type(e).__name__, isinstance(e, UnsupportedShardingError), str(e))
    return None


def _scenario_unsupported(rank: int) -> dict:
    """Options graphamp's unit-by-unit conversion refuses, each before any capture or collective (so
    every rank refuses alike and none waits in a collective): compile=True, FSDP's own mixed
    precision, activation checkpointing."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import graphamp

    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def mlp(prepare=None, unit_policy=None, root_policy=None) -> nn.Module:
        torch.manual_seed(0)
        model = _MLP().train()
        if prepare is not None:
            prepare(model)
        for block in model.blocks:
            fully_shard(block, **({"mp_policy": unit_policy} if unit_policy is not None else {}))
        fully_shard(model, **({"mp_policy": root_policy} if root_policy is not None else {}))
        return model

    def convert(model: nn.Module, **options):
        return lambda: graphamp.convert(model, (x,), dtype=torch.bfloat16, **options)

    def train(model: nn.Module, target=y, args=(x,), kwargs=None, loss=F.mse_loss, **options):
        def run() -> None:
            step = graphamp.TrainStep(model, loss, _adamw(model), dtype=torch.bfloat16, **options)
            step(*args, target=target, **(kwargs or {}))
        return run

    def wrap_up(model: nn.Module) -> None:
        for block in model.blocks:
            block.up = checkpoint_wrapper(block.up)

    def wrap_blocks(model: nn.Module) -> None:
        for i in range(len(model.blocks)):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i])

    def llama_checkpointed() -> nn.Module:
        model = _llama()
        model.gradient_checkpointing_enable()
        return _shard(model, list(model.model.layers))

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(400 + rank))
    bf16 = torch.bfloat16
    return {
        "compile": {
            "convert": _refused(convert(mlp(), compile=True)),
            "TrainStep": _refused(train(mlp(), compile=True)),
        },
        "mp_policy": {
            "param_dtype": _refused(convert(mlp(unit_policy=MixedPrecisionPolicy(param_dtype=bf16)))),
            "reduce_dtype": _refused(convert(mlp(unit_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)))),
            "output_dtype": _refused(train(mlp(root_policy=MixedPrecisionPolicy(output_dtype=torch.float32)))),
            "cast_forward_inputs": _refused(convert(mlp(unit_policy=MixedPrecisionPolicy(cast_forward_inputs=False)))),
            # FSDP's default policy casts nothing: converted as without one.
            "default": _refused(convert(mlp(unit_policy=MixedPrecisionPolicy(), root_policy=MixedPrecisionPolicy()), self_check="off")),
        },
        "checkpoint": {
            "checkpoint_wrapper": _refused(convert(mlp(wrap_up))),
            "checkpoint_wrapper unit": _refused(train(mlp(wrap_blocks))),
            "composable": _refused(convert(mlp(lambda m: [checkpoint(b.up) for b in m.blocks]))),
            "composable unit": _refused(convert(mlp(lambda m: [checkpoint(b) for b in m.blocks]))),
            "gradient_checkpointing": _refused(train(llama_checkpointed(), target=ids, args=(), kwargs={"input_ids": ids}, loss=_lm_loss)),
        },
    }


SCENARIOS = {
    "llama-trainstep": _scenario_llama_trainstep,
    "mlp-convert": _scenario_mlp_convert,
    "errors": _scenario_errors,
    "unsupported": _scenario_unsupported,
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for name, scenario in SCENARIOS.items():
            try:
                start = time.perf_counter()
                results[name] = scenario(rank)
                results[name]["seconds"] = time.perf_counter() - start
            except Exception:  # noqa: BLE001 (reported by the test that reads it)
                results[name] = {"error": traceback.format_exc()}
                break  # the other rank may be waiting in a collective: stop both
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fsdp")
    context = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the FSDP workers did not finish within {TIMEOUT} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _result(fsdp_results: list[dict], rank: int, scenario: str) -> dict:
    r = fsdp_results[rank].get(scenario)
    assert r is not None, f"rank {rank} did not reach {scenario}: {fsdp_results[rank]}"
    assert "error" not in r, f"rank {rank}, {scenario}:\n{r['error']}"
    return r


@pytest.mark.parametrize("scenario", ["llama-trainstep", "mlp-convert"])
def test_bitwise_to_eager_autocast_fsdp(fsdp_results, scenario):
    for rank in range(WORLD):
        r = _result(fsdp_results, rank, scenario)
        assert len(r["got"]) == STEPS
        assert torch.equal(r["got"], r["want"]), f"rank {rank}: losses {r['got']} != eager {r['want']}"
        assert r["eager"].keys() == r["ours"].keys()
        for key, value in r["eager"].items():
            assert torch.equal(r["ours"][key], value), f"rank {rank}: gathered {key} differs from eager FSDP2"
        # The failure this replaces trained nothing: every parameter moved.
        assert all(not torch.equal(r["ours"][k], r["initial"][k]) for k in r["ours"]), "a parameter did not move"
        assert r["self_check"] is True
        assert r["forward_restored"], "a unit's forward is still bound to its graph after the call"
    # Each rank trained on its own data; equal gathered parameters then need the reduce-scatter.
    assert not torch.equal(_result(fsdp_results, 0, scenario)["got"], _result(fsdp_results, 1, scenario)["got"])


def test_other_sizes_run_or_are_refused_typed(fsdp_results):
    for rank in range(WORLD):
        r = _result(fsdp_results, rank, "llama-trainstep")
        if isinstance(r["other_sizes"], torch.Tensor):
            assert torch.equal(r["other_sizes"], r["other_sizes_eager"])
        else:
            name, typed, message = r["other_sizes"]
            assert typed and name == "UnitInputError", f"{name}: {message}"
            assert "pad inputs" in message and "cannot convert again" not in message


def test_llama_units_converted_each(fsdp_results):
    # TrainStep converts the model with its loss: paths are under the loss module's "model".
    r = _result(fsdp_results, 0, "llama-trainstep")
    assert sorted(r["units"]) == ["model", "model.model.layers.0", "model.model.layers.1"]
    assert "autocast" not in r["code"]
    assert "fsdp_unit_call" in r["code"]  # the root is called as a module, through FSDP's hooks
    r = _result(fsdp_results, 0, "mlp-convert")
    assert sorted(r["units"]) == ["", "blocks.0", "blocks.1"]
    assert r["amp_params_are_model_params"]  # an optimizer on model.parameters() trains amp
    assert r["not_stale"]


def test_no_grad_forward_follows_the_weights(fsdp_results):
    for rank in range(WORLD):
        evals = _result(fsdp_results, rank, "mlp-convert")["evals"]
        assert len(evals) == 2
        for ours, eager in evals:
            assert ours.dtype == eager.dtype == torch.bfloat16
            assert torch.equal(ours, eager), f"rank {rank}: no_grad output differs from eager autocast + FSDP2"
        assert not torch.equal(evals[0][0], evals[1][0]), "the weights did not change between the forwards"


def test_converted_then_sharded_raises_typed_error(fsdp_results):
    for rank in range(WORLD):
        r = _result(fsdp_results, rank, "errors")
        assert r["detected"] is not None and "fully_shard" in r["detected"]
        assert r["call"] is not None, "the stale converted module ran on a sharded model"
        typed, name, message = r["call"]
        assert typed, f"{name}: {message}"
        assert "shard" in message and "Way out" in message


def test_grouped_units_refused_with_way_out(fsdp_results):
    for rank in range(WORLD):
        typed, name, message = _result(fsdp_results, rank, "errors")["grouped"]
        assert typed, f"{name}: {message}"
        assert "fully_shard([a, b, ...])" in message and 'backend="graphamp"' in message


def _refusals(fsdp_results: list[dict], option: str) -> list[tuple[int, str, tuple | None]]:
    return [(rank, case, got) for rank in range(WORLD) for case, got in _result(fsdp_results, rank, "unsupported")[option].items()]


def _assert_refused(rank: int, case: str, got: tuple | None, *needles: str) -> str:
    assert got is not None, f"rank {rank}, {case}: converted instead of refused"
    name, typed, message = got
    assert typed and name == "UnsupportedShardingError", f"rank {rank}, {case}: {name}: {message}"
    assert "Way out:" in message, message
    for needle in needles:
        assert needle in message, f"rank {rank}, {case}: {needle!r} not in: {message}"
    return message


def test_compile_true_refused_for_sharded_models(fsdp_results):
    # Before: convert returned a CompiledAmpModule and TrainStep trained, drifting from eager + FSDP2.
    refusals = _refusals(fsdp_results, "compile")
    assert {case for _, case, _ in refusals} == {"convert", "TrainStep"}
    for rank, case, got in refusals:
        message = _assert_refused(rank, case, got, f"graphamp.{case}(compile=True)", "blocks.0", "without compile=True")
        assert message.startswith(f"graphamp.{case}(compile=True)")


def test_fsdp_mixed_precision_policy_refused(fsdp_results):
    # Before: each converted (param_dtype even passed the self-check against eager + the same policy;
    # output_dtype on the root made convert's module fail its first call with a UnitInputError).
    for rank, case, got in _refusals(fsdp_results, "mp_policy"):
        if case == "default":
            assert got is None, f"rank {rank}: the default MixedPrecisionPolicy() was refused: {got}"
            continue
        unit = "the FSDP unit model (" if case == "output_dtype" else "the FSDP unit blocks.0 ("  # TrainStep: under its loss module
        _assert_refused(rank, case, got, "mp_policy=MixedPrecisionPolicy(", f"{case}=", unit, "shard without mp_policy")


def test_activation_checkpointing_in_sharded_model_refused(fsdp_results):
    # Before: checkpoints inside a unit were traced through (no recompute: the activations of a model
    # without checkpointing saved), a composable checkpoint on a unit recomputed the unit's eager
    # forward for tensors its graph saved, and a CheckpointWrapper unit failed to capture.
    where = {
        "checkpoint_wrapper": ("blocks.0.up (CheckpointWrapper", "the FSDP unit blocks.0"),
        "checkpoint_wrapper unit": ("model.blocks.0 (CheckpointWrapper", "the FSDP unit model.blocks.0"),
        "composable": ("blocks.0.up (torch.distributed._composable.checkpoint", "the FSDP unit blocks.0"),
        "composable unit": ("blocks.0 (torch.distributed._composable.checkpoint", "the FSDP unit blocks.0"),
        "gradient_checkpointing": ("model.model.layers.0 (gradient_checkpointing", "the FSDP unit model.model.layers.0"),
    }
    refusals = _refusals(fsdp_results, "checkpoint")
    assert {case for _, case, _ in refusals} == set(where)
    for rank, case, got in refusals:
        _assert_refused(rank, case, got, "activation checkpointing", *where[case], "without activation checkpointing")


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.seen.append(mask)
        return x


def test_eager_view_gives_eager_inputs_to_real_calls_only():
    # While a unit converts, the runs that observe eager see eager's inputs (a traced decoder passes
    # an explicit mask where eager passes None); the capture, on fake tensors, sees its own.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphamp.integrations.fsdp import _eager_view

    m, x = _Masked(), torch.randn(2, 3)
    with _eager_view(m, ((x,), {"mask": None})):
        m(x, mask=torch.ones(2, 3))
        with FakeTensorMode() as mode:
            m(mode.from_tensor(x), mask=mode.from_tensor(torch.ones(2, 3)))
    assert m.seen[0] is None
    assert m.seen[1] is not None
    assert "forward" not in m.__dict__


def test_plain_models_are_not_sharded():
    import graphamp
    from graphamp.integrations import fsdp

    model = _MLP()
    assert not fsdp.is_sharded(model)
    amp = graphamp.convert(model, (torch.randn(4, 8),), dtype=torch.bfloat16, self_check="off")
    assert amp.meta["graphamp"].fsdp_units is None
    assert fsdp.sharded_after_conversion(amp) is None
