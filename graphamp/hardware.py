"""What this machine computes natively: bf16/fp16 matmul support per device, for ``graphamp bench``,
the exact-mode emulation warning and the autotune measurement cache key.

Low precision is only faster where the hardware has it. On a CPU without ``avx512_bf16`` or AMX,
oneDNN emulates bf16 matmuls by converting to fp32, so eager autocast runs 2-4x slower than fp32.
The CPU flags come from ``/proc/cpuinfo`` (Linux), else from ``torch.cpu``'s own probes; tests fake
them with :func:`assume_cpu_flags`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import platform
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from graphamp.errors import EmulatedPrecisionWarning

__all__ = [
    "Capability",
    "EmulatedPrecisionWarning",
    "assume_cpu_flags",
    "capability",
    "cpu_flags",
    "cpu_model",
    "FAULTS_SAID",
    "faults_of",
    "minor_page_faults",
    "missing_feature",
    "parse_cpuinfo",
    "warn_if_emulated",
]

# The flags that make a CPU's low-precision matmuls native (x86 and Arm names).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "svebf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16", "fphp", "asimdhp")
_RELEVANT = BF16_FLAGS + FP16_FLAGS
T = TypeVar("T")

_FAKE_FLAGS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("graphamp_fake_cpu_flags", default=None)
# (device, dtype, missing feature) already warned about in this process: the warning is once each.
_WARNED: set[tuple[str, torch.dtype, str]] = set()


@functools.cache
def _proc_cpuinfo() -> tuple[str | None, frozenset[str] | None]:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return None, None


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str] | None]:
    """(model name, flags) of the first CPU in ``/proc/cpuinfo`` text (x86 "flags", Arm "Features").

    >>> model, flags = parse_cpuinfo("model name : Xeon\\nflags : fpu avx512f\\n")
    >>> assert model == "Xeon" and flags == {"fpu", "avx512f"}
    """
    model = flags = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
    return model, flags


def _torch_flags() -> frozenset[str]:
    probes = {
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",  # AMX tiles come with AMX-BF16 on every part that has them
        "amx_fp16": "_is_amx_fp16_supported",
    }
    return frozenset(flag for flag, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)())


def cpu_flags() -> frozenset[str]:
    """The low-precision CPU flags of this machine (or those :func:`assume_cpu_flags` fakes).

    >>> with assume_cpu_flags(["avx512f"]):
    ...     assert "avx512_bf16" not in cpu_flags()
    """
    fake = _FAKE_FLAGS.get()
    if fake is not None:
        return fake
    flags = _proc_cpuinfo()[1]
    return frozenset(flags & set(_RELEVANT)) if flags is not None else _torch_flags()


def minor_page_faults() -> int | None:
    """The minor page faults this process has taken so far (None where the OS does not count them).

    Timings read it around their calls: glibc's malloc gives freed memory back to the OS once its
    free top exceeds a threshold it raises and lowers by the process's history, so a compiled
    program that allocates its buffers per call may fault in fresh pages on every call, at one
    time and not at another. On this project's Intel Xeon, the bench's conv net compiled anew from
    the same plan took 2.6 ms per call with no faults, then 4.6 and 4.2 ms with 992 faults per call.
    """
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# Minor page faults per call from which the bench and autotune say a program faulted (a call that
# allocates nothing new faults none; one whose buffers malloc gave back to the OS faults hundreds).
FAULTS_SAID = 10


def faults_of(run: Callable[[], T]) -> tuple[T, int | None]:
    """``run()``'s result and the minor page faults the process took while it ran (None where the
    OS does not count them)."""
    before = minor_page_faults()
    result = run()
    return result, None if before is None else minor_page_faults() - before


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9B14"), else the platform's processor string."""
    return _proc_cpuinfo()[0] or platform.processor() or platform.machine() or "unknown CPU"


@contextlib.contextmanager
def assume_cpu_flags(flags: Iterable[str]) -> Iterator[None]:
    """Pretend, for the duration (this thread or task only), that the CPU has exactly ``flags``.

    >>> with assume_cpu_flags([]):
    ...     assert not capability("cpu").native(torch.bfloat16)
    """
    token = _FAKE_FLAGS.set(frozenset(flags))
    try:
        yield
    finally:
        _FAKE_FLAGS.reset(token)


@dataclasses.dataclass(frozen=True)
class Capability:
    """A device's native low-precision support.

    >>> with assume_cpu_flags(["avx512_bf16"]):
    ...     cap = capability("cpu")
    >>> assert cap.native(torch.bfloat16) and not cap.native(torch.float16)
    """

    device_type: str
    # CPU model or CUDA device name.
    name: str
    # CPU: the low-precision flags present; CUDA: empty.
    flags: frozenset[str] = frozenset()
    # CUDA: (major, minor) compute capability; CPU: None.
    compute_capability: tuple[int, int] | None = None

    def native(self, dtype: torch.dtype) -> bool | None:
        """Whether ``dtype`` matmuls are native here; None where graphamp cannot tell."""
        if self.device_type == "cpu":
            return bool(self.flags & set(BF16_FLAGS if dtype is torch.bfloat16 else FP16_FLAGS))
        if self.compute_capability is not None:
            # bf16 tensor cores arrived with Ampere (8.0), fp16 ones with Volta (7.0).
            return self.compute_capability >= ((8, 0) if dtype is torch.bfloat16 else (7, 0))
        return None

    def line(self) -> str:
        """One line for a benchmark header."""
        if self.device_type == "cpu":
            have = [f for f in _RELEVANT[:2] + FP16_FLAGS[:2] if f in self.flags]
            lacks = [f for f in _RELEVANT[:2] + FP16_FLAGS[:2] if f not in self.flags]
            return (
                f"{self.name}: bf16 matmul {'native' if self.native(torch.bfloat16) else 'emulated'}, "
                f"fp16 matmul {'native' if self.native(torch.float16) else 'emulated'} "
                f"(has {', '.join(have) or 'none'}; lacks {', '.join(lacks) or 'none'})"
            )
        cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else "unknown"
        return f"{self.name}: compute capability {cc}, bf16 {'native' if self.native(torch.bfloat16) else 'emulated'}"

    def key(self) -> str:
        """What identifies this machine's measurements (device, flags, torch, threads)."""
        flags = ",".join(sorted(self.flags)) or "-"
        cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else "-"
        return f"{self.device_type}|{self.name}|{flags}|{cc}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def capability(device_type: str = "cpu") -> Capability:
    """The native low-precision support of ``device_type`` ("cpu", or "cuda" for the current device)."""
    if device_type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
        return Capability("cuda", torch.cuda.get_device_name(index), compute_capability=torch.cuda.get_device_capability(index))
    if device_type == "cpu":
        return Capability("cpu", cpu_model(), cpu_flags())
    return Capability(device_type, device_type)


def missing_feature(device_type: str, dtype: torch.dtype) -> str | None:
    """The feature whose absence makes ``dtype`` emulated on ``device_type``; None if native or unknown.

    >>> with assume_cpu_flags(["avx512f"]):
    ...     assert missing_feature("cpu", torch.bfloat16) == "avx512_bf16 or amx_bf16"
    >>> with assume_cpu_flags(["amx_bf16"]):
    ...     assert missing_feature("cpu", torch.bfloat16) is None
    """
    cap = capability(device_type)
    if cap.native(dtype) is not False:
        return None
    if device_type == "cpu":
        return "avx512_bf16 or amx_bf16" if dtype is torch.bfloat16 else "avx512_fp16 or amx_fp16"
    return "compute capability 8.0 (bf16 tensor cores)" if dtype is torch.bfloat16 else "compute capability 7.0 (fp16 tensor cores)"


def warn_if_emulated(device_type: str, dtype: torch.dtype, *, stacklevel: int = 3) -> bool:
    """Warn once per process (per device, dtype and missing feature) that ``dtype`` is emulated;
    returns whether it warned."""
    missing = missing_feature(device_type, dtype)
    if missing is None or (device_type, dtype, missing) in _WARNED:
        return False
    _WARNED.add((device_type, dtype, missing))
    name = "bf16" if dtype is torch.bfloat16 else "fp16"
    warnings.warn(
        f"{name} is emulated on this {device_type} ({capability(device_type).name} lacks {missing}): "
        f"mode='exact' reproduces eager autocast, which here is typically 2-4x slower than fp32. "
        "Way out: graphamp.convert(..., mode='autotune') measures each op and keeps the faster of "
        f"{name} and fp32 (never less precise than autocast); or run in fp32.",
        EmulatedPrecisionWarning,
        stacklevel=stacklevel,
    )
    return True
