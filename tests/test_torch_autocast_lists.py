"""PyTorch's own autocast test lists, run through graphamp: an external suite nobody here wrote.

``torch/testing/_internal/autocast_test_lists.py`` ships in the wheel; ``test/test_autocast.py``
and ``test/test_cuda.py`` run its entries under eager autocast. Here every entry becomes a tiny
module (the op call, with the entry's tensors as inputs) converted by ``graphamp.convert``, and
must give eager autocast's result:

* ``AutocastCPUTestLists``, under bf16 and fp16: output dtype and value, bitwise;
* ``AutocastTestLists`` (the CUDA lists), fp16, on fake CUDA tensors: output dtypes and shapes
  (fake tensors hold no values).

As upstream, an op is called both as ``torch.<op>`` (or ``torch._C._nn.<op>``...) and as a
``Tensor`` method where one exists. Entries graphamp cannot run are listed in ``EXCEPTIONS`` with
the reason; they are strict xfails, so one that starts passing fails the suite until removed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

import graphamp
from graphamp.verify.fake_cuda import fake_cuda_bindings
from graphamp.capture import ambient_autocast

# Importing torch.testing._internal.common_utils (which the lists import) freezes torch.backends
# flags and wraps TorchScript calls for the whole process, as PyTorch's own test runner wants; the
# rest of graphamp's suite sets those flags, so the import's side effects are undone.
_flags_frozen = torch.backends.flags_frozen()
_script_calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
try:
    from torch.testing._internal import autocast_test_lists
except Exception as e:  # noqa: BLE001 (any import failure of a private module means: skip)
    pytest.skip(
        f"torch.testing._internal.autocast_test_lists cannot be imported ({type(e).__name__}: {e}); "
        "it ships with torch and needs expecttest: pip install expecttest",
        allow_module_level=True,
    )
finally:
    if not _flags_frozen:
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = _script_calls

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Entry:
    device: str  # "cpu" or "cuda" (fake)
    dtype: str  # the autocast dtype: "bf16" or "fp16"
    list_name: str
    index: int  # position in the list
    op: str
    variant: str  # "function" (torch.op, torch._C._nn.op...) or "method" (Tensor.op)
    args: tuple
    kwargs: dict
    fn: Callable[..., Any]
    expected: torch.dtype | None  # the output dtype the list expects under autocast
    expect_banned: bool = False

    @property
    def key(self) -> str:
        return f"{self.device}-{self.dtype}-{self.list_name}[{self.index}]-{self.op}-{self.variant}"


def _variants(op: str, module: Any) -> Iterator[tuple[str, Callable]]:
    """The call forms upstream's _run_autocast_outofplace tries: module function, Tensor method."""
    if module is not None and hasattr(module, op):
        yield "function", getattr(module, op)
    if hasattr(torch.Tensor, op):
        yield "method", lambda *a, **k: getattr(a[0], op)(*a[1:], **k)


def _entries_of(device: str, dtype: str, list_name: str, items: list, module: Any) -> Iterator[Entry]:
    for index, item in enumerate(items):
        op, args, kwargs = item[0], item[1], {}
        if device == "cpu" and list_name.endswith("expect_builtin_promote"):
            args = item[1] if dtype == "bf16" else item[2]  # (op, bf16 args, fp16 args, out_type)
        elif device == "cpu" and list_name == "torch_need_autocast_promote":
            args = item[1] if dtype == "bf16" else item[2]
        elif len(item) == 3 and isinstance(item[2], dict):
            kwargs = item[2]
        elif list_name == "banned":
            module = item[2]
        if list_name == "torch_fp16" and len(item) == 3 and item[2] is True:
            continue  # upstream's ROCm skip flag
        for variant, fn in _variants(op, module):
            expected = _expected_dtype(device, dtype, list_name, item)
            yield Entry(device, dtype, list_name, index, op, variant, tuple(args), dict(kwargs), fn, expected, list_name == "banned")


def _expected_dtype(device: str, dtype: str, list_name: str, item: tuple) -> torch.dtype | None:
    if list_name.endswith("expect_builtin_promote"):
        return item[-1]
    if list_name.endswith(("_16", "_fp16")):
        return LOW[dtype]
    if list_name.endswith("_fp32") or list_name == "torch_need_autocast_promote":
        return torch.float32
    return None


def _modules(list_name: str) -> Any:
    if list_name.startswith("nn_") or list_name == "banned":
        return torch._C._nn
    if list_name.startswith("linalg_"):
        return torch._C._linalg
    if list_name.startswith("methods_"):
        return None
    return torch


def _collect() -> list[Entry]:
    entries: list[Entry] = []
    torch.manual_seed(0)
    cpu_lists = autocast_test_lists.AutocastCPUTestLists(torch.device("cpu"))
    for dtype in LOW:
        for list_name, items in vars(cpu_lists).items():
            entries += _entries_of("cpu", dtype, list_name, items, _modules(list_name))
    with FAKE, fake_cuda_bindings():
        cuda_lists = autocast_test_lists.AutocastTestLists(torch.device("cuda"))
    for list_name, items in vars(cuda_lists).items():
        entries += _entries_of("cuda", "fp16", list_name, items, _modules(list_name))
    return entries


# One fake mode for the CUDA lists' tensors and every conversion over them.
FAKE = FakeTensorMode(allow_non_fake_inputs=True)
ENTRIES = _collect()

_NO_FAKE_KERNEL = (
    "torch has no fake (meta) kernel for {op}, so eager CUDA autocast itself cannot run it on fake "
    "tensors without a GPU; there is nothing to compare against"
)
_EXPORT_BOOL = "returns a Python bool computed from tensor values, which torch.export cannot capture (data-dependent)"
_EINSUM = (
    "upstream's entry is malformed: ('einsum', equation, tensors) puts the tensors where the ROCm "
    "skip flag goes (test_cuda.py therefore skips it), and its 2-D operands do not fit the 4-index equation"
)
# Entries graphamp does not run, with the reason. Each is a strict xfail: fixing one fails the
# suite until it is removed here.
EXCEPTIONS: dict[str, str] = {
    "cuda-fp16-torch_expect_builtin_promote[10]-equal-function": _EXPORT_BOOL,
    "cuda-fp16-torch_expect_builtin_promote[10]-equal-method": _EXPORT_BOOL,
    "cuda-fp16-torch_fp16[17]-einsum-function": _EINSUM,
    "cuda-fp16-torch_fp16[10]-cudnn_convolution-function": _NO_FAKE_KERNEL.format(op="aten::cudnn_convolution"),
    "cuda-fp16-torch_fp16[11]-cudnn_convolution_transpose-function": _NO_FAKE_KERNEL.format(op="aten::cudnn_convolution_transpose"),
    "cuda-fp16-torch_fp16[25]-gru_cell-function": _NO_FAKE_KERNEL.format(op="aten::_thnn_fused_gru_cell (which gru_cell calls on CUDA)"),
}


class Call(nn.Module):
    """One op call; the entry's tensors are the inputs, everything else is a constant."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.fn = fn
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.constants = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def tensors(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        return tuple(v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor))

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if c is None else c for c in self.constants]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


def _check_expected(entry: Entry, eager: Any) -> None:
    # The list's own expectation, as upstream checks it: for ops returning one tensor.
    if isinstance(eager, torch.Tensor) and entry.expected is not None:
        assert eager.dtype == entry.expected, f"eager autocast gave {eager.dtype}, the list expects {entry.expected}"


def _compare(got: Any, want: Any, *, values: bool) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"output structure {got_spec} != eager {want_spec}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(w, torch.Tensor):
            assert g == w, f"output {i}: {g!r} != eager {w!r}"
            continue
        assert g.dtype == w.dtype, f"output {i}: dtype {g.dtype} != eager {w.dtype}"
        assert g.shape == w.shape, f"output {i}: shape {tuple(g.shape)} != eager {tuple(w.shape)}"
        if values:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def run_entry(entry: Entry) -> None:
    module = Call(entry.fn, entry.args, entry.kwargs)
    inputs = module.tensors(entry.args, entry.kwargs)
    dtype = LOW[entry.dtype]
    if entry.device == "cpu":
        with torch.autocast("cpu", dtype=dtype):
            eager = module(*inputs)
        _check_expected(entry, eager)
        amp = graphamp.convert(module, inputs, dtype=dtype, device_type="cpu")
        _compare(amp(*inputs), eager, values=True)
        return
    with FAKE, fake_cuda_bindings(), torch.no_grad():
        if entry.expect_banned:
            with pytest.raises(RuntimeError, match="unsafe to autocast"), ambient_autocast("cuda", dtype):
                module(*inputs)
            with pytest.raises(graphamp.BannedOpError):
                graphamp.convert(module, inputs, dtype=dtype, device_type="cuda")
            return
        with ambient_autocast("cuda", dtype):
            eager = module(*inputs)
        _check_expected(entry, eager)
        amp = graphamp.convert(module, inputs, dtype=dtype, device_type="cuda")
        _compare(amp(*inputs), eager, values=False)


def _params() -> list:
    params = []
    for entry in ENTRIES:
        marks = [pytest.mark.xfail(strict=True, reason=EXCEPTIONS[entry.key])] if entry.key in EXCEPTIONS else []
        params.append(pytest.param(entry, id=entry.key, marks=marks))
    return params


@pytest.mark.parametrize("entry", _params())
def test_entry_matches_eager_autocast(entry: Entry) -> None:
    run_entry(entry)


def test_exceptions_name_existing_entries():
    keys = {e.key for e in ENTRIES}
    assert set(EXCEPTIONS) <= keys, sorted(set(EXCEPTIONS) - keys)


def test_every_list_is_covered():
    cpu = {(e.dtype, e.list_name) for e in ENTRIES if e.device == "cpu"}
    cuda = {e.list_name for e in ENTRIES if e.device == "cuda"}
    assert {lst for _, lst in cpu} == set(vars(autocast_test_lists.AutocastCPUTestLists(torch.device("cpu"))))
    assert {d for d, _ in cpu} == set(LOW)
    with FAKE, fake_cuda_bindings():
        assert cuda == set(vars(autocast_test_lists.AutocastTestLists(torch.device("cuda"))))


def test_importing_the_lists_leaves_torch_backends_flags_settable():
    assert not torch.backends.flags_frozen()
