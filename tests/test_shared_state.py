"""graphamp inside someone else's process: no hang, conversions from threads, no leaked global state.

Every result is compared with eager autocast computed in the test, never with the converted
module's own output; every thread is joined with a limit, and a thread still running then fails
the test with every thread's stack printed.
"""

from __future__ import annotations

import faulthandler
import io
import sys
import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphamp
from graphamp.runtime_guards import traced
from graphamp.shared_state import capture_lock, compile_scoped, in_capture, printed_output_held

BF16 = torch.bfloat16
JOIN_S = 600  # a conversion takes seconds here; a hang never ends


def run_threads(*works: Callable[[], object], timeout: float = JOIN_S) -> list[object]:
    """Run each work in a thread of its own and return their results in order; raise the first
    error a thread raised, or fail, with every thread's stack, if one is still running after
    ``timeout`` seconds."""
    results: list[object] = [None] * len(works)
    errors: list[BaseException] = []

    def run(i: int, work: Callable[[], object]) -> None:
        try:
            results[i] = work()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, w), daemon=True) for i, w in enumerate(works)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail(f"a thread did not finish within {timeout} s (a hang: the stacks are above)")
    if errors:
        raise errors[0]
    return results


def _eager(model: nn.Module, x: torch.Tensor, *, grad: bool = True) -> torch.Tensor:
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=BF16):
        return model(x).detach()


class AttentionBlock(nn.Module):
    """The smallest model that hung: an nn.MultiheadAttention (eager's fused kernel without grad
    in eval) whose forward branches on the batch size, so batch 1 is another shape class."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        if x.shape[0] == 1:
            y = y * 2
        return self.fc(y)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_reconverting_for_a_new_shape_class_with_fused_attention_does_not_hang(grad):
    # Converting again for batch 1 checks the new variant by calling it without grad, which converts
    # that variant for calls without grad (the fused kernel's program) while the first conversion
    # still holds its lock: it waited on itself for ever.
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    amp = graphamp.convert(model, (torch.randn(2, 5, 16),))
    ones, threes = torch.randn(1, 5, 16), torch.randn(3, 5, 16)

    def call() -> list[torch.Tensor]:
        with torch.set_grad_enabled(grad):
            return [amp(ones).detach(), amp(threes).detach()]

    (got,) = run_threads(call)
    assert torch.equal(got[0], _eager(model, ones, grad=grad)) and torch.equal(got[1], _eager(model, threes, grad=grad))


def _torchvision():
    """torchvision's pure-Python part (its C++ ops cannot load against the CPU torch; the census
    site skips their fake-kernel registration), or a skip saying why."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "benchmarks"))
    try:
        import census_models

        if not census_models.enable_census_site():
            pytest.skip("torchvision is not installed in .venv/census-site (scripts/census-site installs it)")
        import torchvision
    except Exception as e:  # ImportError, or torchvision's RuntimeError on import
        pytest.skip(f"torchvision cannot be imported here ({type(e).__name__}: {e})")
    finally:
        sys.path.pop(0)
    return torchvision


def test_torchvision_vit_converted_at_batch_2_runs_at_batch_1_and_3():
    # torchvision's VisionTransformer (nn.MultiheadAttention with need_weights=False), where the
    # hang was found: model code nobody here wrote.
    torchvision = _torchvision()
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
    ).eval()
    amp = graphamp.convert(model, (torch.randn(2, 3, 32, 32),))
    inputs = [torch.randn(b, 3, 32, 32) for b in (1, 3)]

    def call(grad: bool) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            with torch.set_grad_enabled(grad):
                return [amp(x).detach() for x in inputs]

        return run

    for grad in (False, True):
        (got,) = run_threads(call(grad))
        for x, out in zip(inputs, got):
            want = _eager(model, x, grad=grad)
            assert out.dtype == want.dtype and torch.equal(out, want)


def _sequential(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def test_threads_convert_at_once():
    # torch.export cannot trace from two threads at once (its pre-dispatch mode stack is a Python
    # global): graphamp serializes its captures, and each thread gets its own model's conversion.
    models = [_sequential(seed) for seed in range(3)]
    x = torch.randn(4, 8)
    barrier = threading.Barrier(len(models))

    def convert(model: nn.Module) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            barrier.wait()
            amp = graphamp.convert(model, (x,))
            return amp(x).detach()

        return run

    outs = run_threads(*(convert(m) for m in models))
    for model, out in zip(models, outs):
        assert torch.equal(out, _eager(model, x))


class BatchOne(nn.Module):
    """Batch 1 takes another branch: a shape class of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.softmax(-1) if x.shape[0] == 1 else h * 2


def test_threads_convert_reconvert_and_call_at_once():
    # Two threads convert their own models while two others call one converted module at a new
    # shape class at the same moment (it converts once for both) and a fifth calls it at the
    # example's shape class.
    torch.manual_seed(0)
    shared, others = BatchOne(), [_sequential(seed) for seed in (1, 2)]
    amp = graphamp.convert(shared, (torch.randn(4, 8),))
    one, four, x = torch.randn(1, 8), torch.randn(4, 8), torch.randn(4, 8)
    barrier = threading.Barrier(5)

    def call(inputs: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            barrier.wait()
            return amp(inputs).detach()

        return run

    def convert(model: nn.Module) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            barrier.wait()
            return graphamp.convert(model, (x,))(x).detach()

        return run

    outs = run_threads(call(one), call(one), call(four), *(convert(m) for m in others))
    assert torch.equal(outs[0], _eager(shared, one)) and torch.equal(outs[1], _eager(shared, one))
    assert torch.equal(outs[2], _eager(shared, four))
    for model, out in zip(others, outs[3:]):
        assert torch.equal(out, _eager(model, x))
    assert len(amp.__dict__["_graphamp_variants"]) == 1  # batch 1 converted once, not per thread


def test_a_call_while_another_thread_compiles_is_not_traced():
    # torch.compiler.is_compiling() is one flag for the process, True for the whole of another
    # thread's torch.compile (or torch.export). A converted module called for real meanwhile must
    # not read it as "being traced": it would skip its parameter checks (here: a weight updated in
    # place, which inference=True must recast) and its shape-class dispatch.
    model = _sequential(3)
    x = torch.randn(4, 8)
    amp = graphamp.convert(model, (x,), inference=True)
    with torch.no_grad():
        model[0].weight.mul_(2)
    compiling, release = threading.Event(), threading.Event()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiling.set()  # the flag is True from here until this thread's compile ends
        release.wait(JOIN_S)
        return gm

    def compile_elsewhere() -> torch.Tensor:
        return torch.compile(lambda t: t + 1, backend=backend)(torch.ones(2))

    def call() -> torch.Tensor:
        try:
            assert compiling.wait(JOIN_S) and torch.compiler.is_compiling()
            return amp(x)
        finally:
            release.set()

    _, got = run_threads(compile_elsewhere, call)
    assert torch.equal(got, _eager(model, x, grad=False))


def test_verify_export_and_trainstep_from_threads():
    models = [_sequential(seed) for seed in range(3)]
    x = torch.randn(4, 8)
    barrier = threading.Barrier(3)

    def verify() -> object:
        barrier.wait()
        return graphamp.verify(models[0], (x,))

    def export() -> torch.Tensor:
        barrier.wait()
        ep = graphamp.export(models[1], (x,))
        return ep.module()(x)

    def train() -> dict[str, torch.Tensor]:
        model = models[2]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = graphamp.TrainStep(model, lambda out, target: (out.float() - target).square().mean(), opt)
        barrier.wait()
        step(x, target=torch.zeros(4, 8))
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    # The eager reference of the training step, on a copy taken before any thread runs.
    import copy

    reference = copy.deepcopy(models[2])
    want_export = _eager(models[1], x, grad=False)
    report, exported, trained = run_threads(verify, export, train)
    assert report.ok
    assert exported.dtype == want_export.dtype and torch.equal(exported, want_export)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=BF16):
        loss = (reference(x).float() - torch.zeros(4, 8)).square().mean()
    loss.backward()
    opt.step()
    for name, p in reference.named_parameters():
        assert torch.equal(trained[name], p.detach()), name


def test_printed_output_is_held_per_thread_and_the_streams_come_back():
    out, err = sys.stdout, sys.stderr
    entered, release = threading.Event(), threading.Event()
    real = io.StringIO()

    def capture() -> None:
        with printed_output_held(lambda failure: {"dropped"}):
            print("kept")
            print("dropped", end="")
            entered.set()
            release.wait(JOIN_S)

    def other_thread_prints() -> str:
        entered.wait(JOIN_S)
        # Another thread writes while the capture holds this thread's output: it goes straight through.
        sys.stdout.write("meanwhile")
        written = real.getvalue()
        release.set()
        return written

    sys.stdout = real
    try:
        _, written = run_threads(capture, other_thread_prints)
        assert sys.stdout is real
    finally:
        sys.stdout = out
    assert written == "meanwhile" and real.getvalue() == "meanwhilekept\n"
    assert sys.stderr is err


def test_a_stream_replaced_during_a_capture_stays_replaced():
    out = sys.stdout
    mine = io.StringIO()
    try:
        with printed_output_held(lambda failure: set()):
            sys.stdout = mine  # someone else's redirect while graphamp holds the output
        assert sys.stdout is mine
    finally:
        sys.stdout = out


def test_converting_from_threads_leaves_the_streams_and_global_flags_as_they_were():
    import torch._inductor.config as inductor_config
    from torch._subclasses import fake_impls

    out, err = sys.stdout, sys.stderr
    checks = list(fake_impls.op_implementations_checks)
    jit = torch._C._jit_set_autocast_mode(True)
    torch._C._jit_set_autocast_mode(jit)
    freezing = inductor_config.freezing
    x = torch.randn(4, 8)

    def convert(seed: int) -> Callable[[], None]:
        return lambda: graphamp.convert(_sequential(seed), (x,))

    run_threads(*(convert(s) for s in range(3)))
    assert sys.stdout is out and sys.stderr is err
    assert fake_impls.op_implementations_checks == checks
    assert torch._C._jit_set_autocast_mode(jit) == jit
    assert inductor_config.freezing == freezing
    assert not in_capture()


class ScriptedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1


def test_torchscript_capture_restores_the_jit_autocast_flag():
    model = ScriptedBlock()
    x = torch.randn(4, 8)
    for setting in (True, False):
        before = torch._C._jit_set_autocast_mode(setting)
        try:
            amp = graphamp.convert(model, (x,))
            assert torch._C._jit_set_autocast_mode(setting) == setting  # as the user set it
        finally:
            torch._C._jit_set_autocast_mode(before)
    assert torch.equal(amp(x), _eager(model, x))


def test_the_capture_lock_is_reentrant_and_excludes_other_threads():
    held, waited = threading.Event(), []

    def other() -> None:
        held.wait(JOIN_S)
        with capture_lock():
            waited.append("other")

    t = threading.Thread(target=other, daemon=True)
    with capture_lock():
        t.start()
        with capture_lock():
            held.set()
            t.join(0.5)
            assert t.is_alive() and waited == []  # it waits for this thread's capture
    t.join(JOIN_S)
    assert waited == ["other"]


def test_compile_settings_apply_to_this_threads_compiles_only():
    import torch._inductor.config as inductor_config

    seen: dict[str, bool] = {}

    def backend(name: str):
        def compile_fn(gm, example_inputs):
            seen[name] = inductor_config.freezing
            return gm

        return compile_fn

    inside = threading.Event()

    def scoped() -> None:
        with compile_scoped(lambda: inductor_config.patch(freezing=True)):
            torch.compile(lambda x: x * 2, backend=backend("scoped"))(torch.ones(2))
            inside.set()

    def unrelated() -> None:
        inside.wait(JOIN_S)
        torch.compile(lambda x: x * 3, backend=backend("unrelated"))(torch.ones(2))

    run_threads(scoped, unrelated)
    assert seen == {"scoped": True, "unrelated": False} and inductor_config.freezing is False


def test_a_frozen_compiled_module_served_while_another_thread_compiles_and_trains():
    # Before, every call of a frozen CompiledAmpModule set inductor's freezing flag around the
    # call; a torch.compile meanwhile froze its model's weights into constants, and its later weight
    # updates were silently ignored. (torch 2.13 keeps config overrides per thread, so the flag did
    # not reach other threads there; torch's config module did not always.) Now the flag is set
    # only inside the module's own compiles: a call, held open here while the other thread compiles,
    # changes nothing, in its own thread or another.
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    served = _sequential(0).eval()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphamp.convert(served, (x,), inference=True, compile=True)
    want_served = _eager(served, x, grad=False)
    program = cm._compiled_fn()  # compiled by convert
    in_call, done = threading.Event(), threading.Event()

    flag_in_call = []

    def held_open(*args: object, **kwargs: object) -> torch.Tensor:
        flag_in_call.append(inductor_config.freezing)
        in_call.set()
        done.wait(JOIN_S)
        return program(*args, **kwargs)

    cm.__dict__["_compiled_fn"] = lambda: held_open

    def serve() -> torch.Tensor:
        with torch.no_grad():
            return cm(x)

    user = nn.Linear(8, 8)

    def train_elsewhere() -> tuple[bool, torch.Tensor, torch.Tensor]:
        try:
            in_call.wait(JOIN_S)
            flag = inductor_config.freezing  # while the frozen module's call runs
            compiled = torch.compile(user)
            with torch.no_grad():
                first = compiled(x)
                user.weight.add_(1.0)  # the user's update: their compiled model must see it
                second = compiled(x)
            return flag, first, second
        finally:
            done.set()

    served_out, (flag, first, second) = run_threads(serve, train_elsewhere)
    torch.testing.assert_close(served_out.float(), want_served.float(), atol=0.05, rtol=0.05)
    assert flag_in_call == [False] and flag is False and inductor_config.freezing is False
    with torch.no_grad():
        torch.testing.assert_close(second, user(x))
    assert not torch.allclose(first, second)


def test_the_widened_fake_kernel_is_seen_only_by_the_compiles_of_the_module_that_needs_it():
    # A compiled MoE graph (aten._grouped_mm in fp32) traces with a widened fake kernel, an entry in
    # FakeTensorMode's process-wide table. It used to be inserted around every call; now only the
    # module's own compiles see it, under dynamo's compile lock.
    from torch._subclasses import fake_impls

    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped_mm is None:
        pytest.skip("torch without F.grouped_mm")

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.w = nn.Parameter(torch.randn(2, 16, 16) / 4)

        def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return grouped_mm(self.proj(x).float(), self.w.transpose(-2, -1), offs=offs)

    torch.manual_seed(0)
    model, x, offs = Experts().eval(), torch.randn(8, 16), torch.tensor([3, 8], dtype=torch.int32)
    checks = list(fake_impls.op_implementations_checks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphamp.CompileFallbackWarning)
        cm = graphamp.convert(model, (x, offs), inference=True, compile=True)
    assert cm.runs_compiled
    program = cm._compiled_fn()
    in_call, done = threading.Event(), threading.Event()
    seen_in_call = []

    def held_open(*args: object, **kwargs: object) -> torch.Tensor:
        seen_in_call.append(list(fake_impls.op_implementations_checks))
        in_call.set()
        done.wait(JOIN_S)
        return program(*args, **kwargs)

    cm.__dict__["_compiled_fn"] = lambda: held_open

    def serve() -> torch.Tensor:
        with torch.no_grad():
            return cm(x, offs)

    def look() -> list:
        try:
            in_call.wait(JOIN_S)
            return list(fake_impls.op_implementations_checks)
        finally:
            done.set()

    out, seen_elsewhere = run_threads(serve, look)
    assert seen_in_call == [checks] and seen_elsewhere == checks and fake_impls.op_implementations_checks == checks
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        want = model(x, offs)
    torch.testing.assert_close(out, want, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("trace", ["compile", "export"])
def test_traced_is_true_where_this_thread_traces(trace):
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(traced())
            return x + 1

    if trace == "compile":
        torch.compile(Probe(), backend="eager")(torch.ones(2))
    else:
        torch.export.export(Probe(), (torch.ones(2),), strict=False)
    assert seen == [True] and not traced()
