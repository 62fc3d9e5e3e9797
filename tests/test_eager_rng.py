"""The user's random state is theirs (issue 35): no graphamp call changes a generator the user has.

graphamp seeds and restores generators only through ``graphamp.eager`` (``rng_kept``, ``RngState``):
the CPU generator and each device's of an initialized accelerator. These tests run on the CPU
with a fake CUDA (``torch.cuda``'s generator API replaced) where a GPU would be needed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import graphamp
from graphamp import runtime
from graphamp.eager import RngState, rng_kept
from graphamp.errors import InputValueError

PACKAGE = Path(graphamp.__file__).parent


class FakeCuda:
    """``torch.cuda`` as an initialized (or, with ``initialized=False``, a present but not yet
    initialized) CUDA with ``count`` devices: each device's generator state is a one-element
    tensor, seeding sets it to ``1000 + seed``. ``calls`` records every CUDA function called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, initialized: bool = True, count: int = 2) -> None:
        self.states = {i: torch.tensor([i + 1]) for i in range(count)}
        self.calls: list[str] = []
        self.initialized = initialized
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "device_count", self._cuda("device_count", lambda: count))
        monkeypatch.setattr(torch.cuda, "get_rng_state", self._cuda("get_rng_state", lambda device="cuda": self.states[device].clone()))
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._cuda("set_rng_state", self._set))
        monkeypatch.setattr(torch.cuda, "manual_seed_all", self._cuda("manual_seed_all", self._seed_all))
        monkeypatch.setattr(torch.cuda, "manual_seed", self._cuda("manual_seed", lambda seed: self._set(torch.tensor([1000 + seed]), 0)))
        for name in ("get_rng_state_all", "set_rng_state_all", "seed", "seed_all", "init", "_lazy_init", "current_device"):
            monkeypatch.setattr(torch.cuda, name, self._cuda(name, lambda *a, **k: pytest.fail(f"torch.cuda.{name} called")))

    def _cuda(self, name, fn):
        def called(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return called

    def _set(self, state: torch.Tensor, device: int = 0) -> None:
        self.states[device] = state.clone()

    def _seed_all(self, seed: int) -> None:
        for i in self.states:
            self._set(torch.tensor([1000 + seed]), i)

    def values(self) -> list[int]:
        return [int(s) for s in self.states.values()]


@pytest.fixture
def no_accelerator_seed(monkeypatch):
    """Records every seeding of a device generator (``torch.manual_seed`` seeds CUDA lazily on a
    CPU-only build too: the seed is queued and lands when CUDA initializes)."""
    seeded: list[str] = []
    for module, name in ((torch.cuda, "manual_seed_all"), (torch.cuda, "manual_seed"), (torch.mps, "manual_seed"), (torch.xpu, "manual_seed_all")):
        monkeypatch.setattr(module, name, lambda seed, _n=f"{module.__name__}.{name}": seeded.append(_n))
    return seeded


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 4)).train()


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def unprobed(monkeypatch):
    """Emission's binding probes (``graphamp.codegen``) run each op once per argument kinds and
    keep the answer for the process: emptied, so this test's ops are probed again."""
    from graphamp import codegen

    monkeypatch.setattr(codegen, "_BINDINGS", {})


# (1) The CPU generator as the user left it, and no device generator seeded.


@pytest.mark.parametrize("call", ["convert", "verify"])
def test_convert_and_verify_leave_the_generators(call, no_accelerator_seed, unprobed):
    model, x = _dropout_model(), _x()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    no_accelerator_seed.clear()
    if call == "convert":
        graphamp.convert(model, (x,), dtype=torch.bfloat16)
    else:
        graphamp.verify(model, (x,), dtype=torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), before)
    assert no_accelerator_seed == []


class DrawsNoise(nn.Module):
    """Draws its own noise when given none (UnivNet's vocoder does), at a size that follows the
    batch; its code branches on the batch size, so a converted graph holds one batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape[0], 8)
        y = self.proj(x + noise)
        return y * 2 if x.shape[0] == 2 else y


def test_a_conversion_for_new_inputs_leaves_the_draws_of_the_call_it_makes(unprobed):
    # UnivNet converted at batch 2 and called at batch 1 differed from eager autocast: the call
    # converted again, and probing the new randn's binding drew from the user's generator.
    model = DrawsNoise().eval()
    example, x = torch.randn(2, 8), torch.randn(1, 8)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    amp = graphamp.convert(model, (example,), dtype=torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    with torch.no_grad():
        got = amp(x)  # converts again for batch 1, then runs
    assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), after)


def test_train_step_first_call_draws_what_an_eager_step_draws(no_accelerator_seed):
    model, x = _dropout_model(), _x()
    y = torch.zeros(4, 4)
    torch.manual_seed(1234)
    with torch.no_grad():
        model(x)  # one eager forward draws the dropout mask
    after_eager = torch.get_rng_state()
    step = graphamp.TrainStep(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.0), dtype=torch.bfloat16)
    torch.manual_seed(1234)
    no_accelerator_seed.clear()
    step(x, target=y)  # converts (capture, self-check) and steps: only the step's own draw may remain
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert no_accelerator_seed == []


# (2) Every device generator of an initialized accelerator is kept and seeded; a present one not
# initialized is left alone.


def test_rng_kept_forks_and_seeds_an_initialized_cuda(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    cpu = torch.get_rng_state()
    with rng_kept(seed=0) as start:
        assert cuda.values() == [1000, 1000]  # seeded: every device
        first = torch.rand(3)
        cuda._seed_all(7)  # the run draws (here: moves every device's generator)
        start.restore()  # back to the seeded start, on every device
        assert cuda.values() == [1000, 1000]
        assert torch.equal(torch.rand(3), first)
    assert cuda.values() == [1, 2]  # the user's states again
    assert torch.equal(torch.get_rng_state(), cpu)
    with pytest.raises(RuntimeError), rng_kept(seed=5):
        cuda._seed_all(9)
        raise RuntimeError("the run failed")
    assert cuda.values() == [1, 2]
    assert torch.equal(torch.get_rng_state(), cpu)


def test_an_uninitialized_cuda_is_not_touched(monkeypatch):
    cuda = FakeCuda(monkeypatch, initialized=False)
    cpu = torch.get_rng_state()
    with rng_kept(seed=0):
        torch.rand(3)
    state = RngState()
    state.seed(3)
    state.restore()
    runtime._random_state()()
    assert cuda.calls == []
    assert torch.equal(torch.get_rng_state(), cpu)


@pytest.mark.parametrize("call", ["convert", "verify", "explain"])
def test_conversion_forks_an_initialized_cuda(call, monkeypatch):
    model, x = _dropout_model(), _x()
    cuda = FakeCuda(monkeypatch)
    seeds: list[list[int]] = []
    seed_all = torch.cuda.manual_seed_all

    def seed_and_see(seed: int) -> None:
        seed_all(seed)
        seeds.append(cuda.values())

    monkeypatch.setattr(torch.cuda, "manual_seed_all", seed_and_see)
    cpu = torch.get_rng_state()
    getattr(graphamp, call)(model, (x,), dtype=torch.bfloat16)
    assert seeds or call == "verify", f"{call} seeds its runs (the self-check; explain's sides)"
    assert all(s == [1000, 1000] for s in seeds)  # seeded with 0 on every device
    assert cuda.values() == [1, 2]  # and put back
    assert torch.equal(torch.get_rng_state(), cpu)


def test_runtime_restores_the_same_generators(monkeypatch):
    # runtime.restored_on_refusal cannot import graphamp.eager: it reads the generators itself.
    cuda = FakeCuda(monkeypatch)
    bn = nn.BatchNorm1d(2)
    cpu = torch.get_rng_state()
    with pytest.raises(InputValueError), runtime.restored_on_refusal(bn, [], True):
        torch.rand(3)
        cuda._seed_all(4)
        raise InputValueError("refused")
    assert cuda.values() == [1, 2]
    assert torch.equal(torch.get_rng_state(), cpu)
    assert cuda.calls.count("get_rng_state") == 2 and cuda.calls.count("set_rng_state") == 2


# (3) No graphamp code outside graphamp/eager.py reads, seeds or forks a generator.

_RNG_NAMES = {
    "manual_seed", "manual_seed_all", "seed", "seed_all", "fork_rng", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "default_generator", "default_generators",
}
_ALLOWED = {
    "eager.py": "the one place",
    "testing/zoo.py": "builds test models, seeded on purpose",
    "runtime.py": "restored_on_refusal: the runtime imports no compile-time module, graphamp.eager included",
}
# Sites this change could not edit: each must still hold a call (so that the entry goes when it is converted).
_PENDING: dict[str, str] = {}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _rng_uses(source: str) -> list[str]:
    """Every use of torch's generator API in the code (not in strings: doctests are the user's)."""
    found, tree = [], ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node)
            if name and name.split(".")[0] == "torch" and _RNG_NAMES & set(name.split(".")[1:]):
                found.append(f"{node.lineno}: {name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name in _RNG_NAMES]
    return found


def test_the_scan_finds_the_old_spellings():
    old = "with torch.random.fork_rng(devices=[]):\n    torch.manual_seed(0)\ns = torch.cuda.get_rng_state_all()\n"
    old += "torch.default_generator.set_state(s)\nfrom torch.random import fork_rng\nw = torch.Generator().manual_seed(0)\n"
    old += '"""\n>>> torch.manual_seed(0)\n"""\n'
    assert [u.split(": ")[1] for u in sorted(_rng_uses(old), key=lambda u: int(u.split(":")[0]))] == [
        "torch.random.fork_rng", "torch.manual_seed", "torch.cuda.get_rng_state_all", "torch.default_generator.set_state",
        "from torch.random import fork_rng",
    ]


def test_only_graphamp_eager_touches_generators():
    offenders, pending = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in _ALLOWED:
            continue
        uses = _rng_uses(path.read_text(encoding="utf-8"))
        (pending if rel in _PENDING else offenders).update({rel: uses} if uses else {})
    assert not offenders, f"use graphamp.eager.rng_kept / RngState instead: {offenders}"
    assert set(pending) == set(_PENDING), f"converted: remove from _PENDING: {set(_PENDING) - set(pending)}"


# (5) Python's and numpy's global generators: restored, never seeded; a draw from them is not
# captured into a graph.


class DrawsFromNumpy(nn.Module):
    """Picks columns with numpy's global generator, as BigBird's random attention blocks and
    wav2vec2's SpecAugment masks do in training."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import numpy as np

        return self.lin(x[:, torch.from_numpy(np.random.permutation(x.shape[1])[:4])])


def _host_state():
    import random

    import numpy as np

    return random.getstate(), np.random.get_state()[1].copy(), np.random.get_state()[2]


def test_convert_leaves_pythons_and_numpys_generators():
    import random

    import numpy as np

    random.seed(7)
    np.random.seed(7)
    before = _host_state()
    graphamp.convert(DrawsFromNumpy(), (torch.randn(2, 8),), dtype=torch.bfloat16)
    after = _host_state()
    assert after[0] == before[0] and (after[1] == before[1]).all() and after[2] == before[2]


def test_a_model_that_draws_from_numpy_draws_anew_on_every_call():
    import numpy as np

    model, x = DrawsFromNumpy(), torch.randn(2, 8)
    amp = graphamp.convert(model, (x,), dtype=torch.bfloat16)
    assert isinstance(amp, graphamp.DynamoAmpModule)  # one graph would repeat the conversion's draw
    np.random.seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = [model(x) for _ in range(3)]
    np.random.seed(5)
    got = [amp(x) for _ in range(3)]
    assert not torch.equal(want[0], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_export_refuses_a_draw_from_numpy_and_names_it():
    with pytest.raises(graphamp.CaptureError, match="numpy's global random generator"):
        graphamp.export(DrawsFromNumpy(), (torch.randn(2, 8),), dtype=torch.bfloat16)


def test_inputs_copied_keeps_values_views_and_lazy_bits():
    from graphamp.eager import inputs_copied

    base = torch.randn(4, 4)
    conj = torch.randn(3, dtype=torch.complex64).conj()  # a lazy conjugate: a bit of the view
    (b, t, c), _ = inputs_copied(((base, base.t(), conj), {}))
    assert torch.equal(b, base) and torch.equal(t, base.t()) and t.stride() == base.t().stride()
    assert torch.equal(c, conj)
    b.add_(1)  # the transposed copy views the copied base
    assert torch.equal(t, b.t()) and not torch.equal(b, base)
