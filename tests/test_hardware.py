"""Hardware awareness: capability, the exact-mode emulation warning (on faked CPU flags)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp import hardware
from graphamp.hardware import Capability, assume_cpu_flags, capability, missing_feature, parse_cpuinfo
from graphamp.autotune.measure import MeasurementCache, measuring


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(hardware, "_WARNED", set())


def model_and_input():
    return nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),)


def convert_caught(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = graphamp.convert(*args, **kwargs)
    return amp, [w for w in caught if issubclass(w.category, graphamp.EmulatedPrecisionWarning)]


def test_parse_cpuinfo_x86_and_arm():
    x86 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8375C\nflags\t\t: fpu avx512f avx512_vnni\n\nprocessor\t: 1\nflags\t\t: other\n"
    assert parse_cpuinfo(x86) == ("Intel(R) Xeon(R) Platinum 8375C", frozenset({"fpu", "avx512f", "avx512_vnni"}))
    arm = "processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16\n"
    assert parse_cpuinfo(arm) == (None, frozenset({"fp", "asimd", "fphp", "asimdhp", "bf16"}))


@pytest.mark.parametrize(
    "flags, bf16, fp16",
    [([], False, False), (["avx512_bf16"], True, False), (["amx_bf16", "amx_fp16"], True, True), (["avx512_fp16"], False, True)],
)
def test_cpu_capability_from_flags(flags, bf16, fp16):
    with assume_cpu_flags(flags):
        cap = capability("cpu")
    assert (cap.native(torch.bfloat16), cap.native(torch.float16)) == (bf16, fp16)
    assert ("bf16 matmul native" in cap.line()) == bf16 and ("fp16 matmul native" in cap.line()) == fp16


def test_cuda_capability_by_compute_capability():
    assert Capability("cuda", "A100", compute_capability=(8, 0)).native(torch.bfloat16)
    turing = Capability("cuda", "T4", compute_capability=(7, 5))
    assert not turing.native(torch.bfloat16) and turing.native(torch.float16)
    assert "compute capability 7.5" in turing.line()
    assert Capability("cuda", "unknown").native(torch.bfloat16) is None


def test_exact_mode_warns_once_naming_the_missing_feature_and_autotune():
    model, args = model_and_input()
    with assume_cpu_flags(["avx512f", "avx512_vnni"]):
        _, caught = convert_caught(model, args, dtype=torch.bfloat16)
        _, again = convert_caught(model, args, dtype=torch.bfloat16)
    assert len(caught) == 1 and not again
    message = str(caught[0].message)
    assert "avx512_bf16 or amx_bf16" in message and "mode='autotune'" in message


def test_fp16_names_its_own_feature():
    model, args = model_and_input()
    with assume_cpu_flags(["avx512_bf16"]):
        _, bf16 = convert_caught(model, args, dtype=torch.bfloat16)
        _, fp16 = convert_caught(model, args, dtype=torch.float16)
    assert not bf16 and len(fp16) == 1 and "avx512_fp16 or amx_fp16" in str(fp16[0].message)


def test_native_and_autotune_do_not_warn():
    model, args = model_and_input()
    with assume_cpu_flags(["amx_bf16"]):
        _, native = convert_caught(model, args, dtype=torch.bfloat16)
    with assume_cpu_flags([]), measuring(timer=lambda fn, trial: 1.0, cache=MeasurementCache()):
        _, tuned = convert_caught(model, args, dtype=torch.bfloat16, mode="autotune")
    assert not native and not tuned


def test_this_machine_matches_torch_probe():
    # /proc/cpuinfo and torch's own probe agree on avx512_bf16 wherever both exist.
    if hardware._proc_cpuinfo()[1] is None:
        pytest.skip("no /proc/cpuinfo")
    assert ("avx512_bf16" in hardware.cpu_flags()) == torch.cpu._is_avx512_bf16_supported()
    assert (missing_feature("cpu", torch.bfloat16) is None) == capability("cpu").native(torch.bfloat16)
