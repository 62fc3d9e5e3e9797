"""What a saved AmpModule refers to: only ``graphamp.runtime`` and the package's top level, and
files saved in the committed format still load and run bitwise equal to eager autocast."""

from __future__ import annotations

import dataclasses
import io
import pickle
import pickletools
import re
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import graphamp
from graphamp import runtime
from fixtures.make_saved_modules import CASES, FIXTURES, build_case

# Where a saved module may point: the stable runtime module and the package's top level.
STABLE_MODULES = {"graphamp": graphamp, "graphamp.runtime": runtime}
_IMPORT = re.compile(r"^\s*(?:from\s+(graphamp[\w.]*)\s+import\s+(\w+)|import\s+(graphamp[\w.]*))", re.M)


class Triple(torch.autograd.Function):
    """Module level, so a converted module that keeps it can be saved."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 5  # not autograd's own derivative, so it shows the Function was kept


class Everything(nn.Module):
    """One model whose converted graph calls every runtime function generated code may call."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():  # set_grad_enabled
            f = self.frozen(x)
        # x is cast twice: the second cast is autocast_cached; head's weights go through cached_cast.
        return self.head(x) + x @ x.T + Triple.apply(x) + f


def _saved(amp: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(amp, buffer)
    return buffer.getvalue()


def _pickle_bytes(saved: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(saved)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"))


def referenced_names(saved: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a saved file makes the loader import: the pickle's globals, found by
    loading it with a recording unpickler, and the imports of the generated code it carries."""
    found: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            found.add((module, name))
            return super().find_class(module, name)

    recording = types.ModuleType("recording_pickle")
    recording.Unpickler = Recorder
    torch.load(io.BytesIO(saved), weights_only=False, pickle_module=recording)
    for op, arg, _ in pickletools.genops(_pickle_bytes(saved)):
        if isinstance(arg, str):
            for m in _IMPORT.finditer(arg):
                found.add((m[1], m[2]) if m[1] else (m[3], ""))
    return found


def _graphamp_names(saved: bytes) -> set[tuple[str, str]]:
    return {(m, n) for m, n in referenced_names(saved) if m == "graphamp" or m.startswith("graphamp.")}


def _targets(amp: nn.Module) -> set:
    return {n.target for n in amp.graph.nodes if n.op == "call_function"}


def _converted(inference: bool) -> nn.Module:
    model, x = Everything(), torch.randn(4, 4, requires_grad=True)
    amp = graphamp.convert(model, (x,), inference=inference)
    if not inference:  # the graph exercises everything the scan is meant to cover
        assert {runtime.set_grad_enabled, runtime.cached_cast, runtime.autocast_cached, runtime.apply_function} <= _targets(amp)
    return amp


@pytest.mark.parametrize("inference", [False, True], ids=["exact", "inference"])
def test_saved_module_names_only_the_runtime_and_the_top_level(inference):
    names = _graphamp_names(_saved(_converted(inference)))
    assert ("graphamp.runtime", "rebuild_amp_module") in names  # the scan sees the pickle's globals
    outside = sorted(f"{m}.{n}" for m, n in names if m not in STABLE_MODULES)
    assert not outside, f"a saved module refers to graphamp's private modules: {outside}"
    for module, name in names:
        if name:  # "" for a plain `import graphamp` in the code
            # Stable names are public: listed in the module's __all__, so a rename shows in review.
            assert name in STABLE_MODULES[module].__all__, f"{module}.{name} is not in {module}.__all__"
            assert getattr(sys.modules[module], name) is not None


@pytest.mark.parametrize("name", ["AmpModule", "AmpInfo", "Config"])
def test_public_classes_are_named_by_their_public_path(name):
    # As numpy's set_module: pickle and reprs name the path users import, not the defining file.
    cls = getattr(graphamp, name)
    assert cls.__module__ == "graphamp" and cls.__qualname__ == name and name in graphamp.__all__


def test_runtime_imports_no_compile_time_module():
    # Loading a saved module imports the runtime; it stays light (torch, graphamp's errors and the
    # runtime's own graphamp.runtime_* modules), so that capture, policy and the passes can move freely.
    source = Path(runtime.__file__).read_text()
    imported = set(re.findall(r"^\s*(?:from|import)\s+(graphamp[\w.]*)", source, re.M))
    allowed = {"graphamp", "graphamp.errors"}
    assert all(m in allowed or re.fullmatch(r"graphamp\.runtime_\w+", m) for m in imported), imported
    assert {"graphamp.runtime_autocast", "graphamp.runtime_guards", "graphamp.runtime_saved"} <= imported  # the scan sees them


def test_saved_module_round_trips_with_every_runtime_call():
    amp = _converted(inference=False)
    x = torch.randn(4, 4, requires_grad=True)
    loaded = torch.load(io.BytesIO(_saved(amp)), weights_only=False)
    assert _targets(loaded) >= {runtime.set_grad_enabled, runtime.cached_cast, runtime.autocast_cached, runtime.apply_function}
    out, ref = loaded(x), amp(x)
    assert torch.equal(out, ref)
    assert loaded.cast_summary() == amp.cast_summary()
    out.float().sum().backward()
    assert loaded.get_parameter("frozen.weight").grad is None
    assert loaded.get_parameter("head.weight").grad is not None


def test_saved_module_keeps_its_graph_record():
    # The module's GraphInfo travels as a plain dict (the saved file names no compile-time class:
    # see above) and is a GraphInfo again once loaded, with the self-check convert ran.
    amp = _converted(inference=False)
    loaded = torch.load(io.BytesIO(_saved(amp)), weights_only=False)
    assert loaded.meta["graphamp"].self_check == amp.meta["graphamp"].self_check
    assert loaded.meta["graphamp"].self_check.ok


def test_module_saved_with_the_old_meta_keys_loads_them_into_its_record():
    # Files saved before GraphInfo kept each field under a key of its own (the self-check as a dict).
    amp = _converted(inference=False)
    rebuild, (body, import_block) = amp.__reduce__()
    check = amp.meta["graphamp"].self_check
    body["meta"] = {
        "graphamp.self_check": dataclasses.asdict(check), "graphamp_captured_static": True, "graphamp.fsdp": ["model"],
    }
    record = rebuild(body, import_block).meta["graphamp"]
    assert record.self_check == check and record.captured_static and record.fsdp_units == ["model"]


def test_saved_config_overrides_name_only_the_top_level():
    config = graphamp.Config(op_overrides={"gelu": "fp32"})
    amp = graphamp.convert(nn.Sequential(nn.Linear(4, 4), nn.GELU()), (torch.randn(2, 4),), config=config)
    outside = sorted(f"{m}.{n}" for m, n in _graphamp_names(_saved(amp)) if m not in STABLE_MODULES)
    assert not outside, outside


@pytest.mark.parametrize("name", CASES)
def test_committed_saved_module_still_loads(name):
    """Guards the saved-file format from now on.

    ``tests/fixtures/saved_<name>.pt`` was written by an earlier graphamp (see
    ``make_saved_modules.py``) as users' files are. It must keep loading, run bitwise equal to eager
    autocast, keep its ``no_grad`` region and report its casts. If this fails, a change broke the
    files users have saved: restore the moved or renamed name, or add a loader shim in
    ``graphamp/runtime.py``. Do not regenerate the fixture to make it pass.
    """
    saved = torch.load(FIXTURES / f"saved_{name}.pt", weights_only=False)
    amp, x = saved["module"], saved["input"]
    assert isinstance(amp, graphamp.AmpModule) and amp.graphamp_info.inference == (name == "inference")
    # Saved when AmpInfo.no_grad was named grad_free.
    assert amp.graphamp_info.no_grad is False and "grad_free" not in vars(amp.graphamp_info)
    out = amp(x)
    assert out.dtype is torch.bfloat16 and torch.equal(out, saved["expected"])
    assert amp.cast_summary() == saved["cast_summary"] and amp.cast_summary()["casts"] > 0

    # Eager autocast today, on the architecture rebuilt with the loaded weights, agrees too.
    model, _ = build_case(name)
    model.load_state_dict(amp.state_dict())
    x_eager, x = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x_eager)
    out = amp(x)
    assert torch.equal(out, expected)
    if name == "inference":
        assert not out.requires_grad  # calls run under no_grad
    else:
        out.float().sum().backward()
        expected.float().sum().backward()
        assert torch.equal(x.grad, x_eager.grad)
        for path, param in model.named_parameters():
            got = amp.get_parameter(path).grad
            assert (got is None) == (param.grad is None) and (got is None or torch.equal(got, param.grad)), path
        assert amp.get_parameter("stem.weight").grad is None  # the no_grad region survived
    torch.save(amp, io.BytesIO())  # and saves again
