"""graphamp.verify.fake_cuda patches FakeTensor only while one of its contexts is open.

Every check compares the ``__dict__`` of each class in FakeTensor's MRO (FakeTensor, Tensor,
TensorBase, ...) before and after, by identity, so a new patch, on any of these classes, is
covered without editing this file. Inside a session the attributes that differ must be exactly
``_fake_cuda.PATCHES``: a patch missing from that table fails here too.
"""

import threading

import pytest
import torch

import graphamp
from graphamp.verify import fake_cuda as _fake_cuda
from graphamp.verify.fake_cuda import fake_cuda_bindings, fake_cuda_session
from torch._subclasses.fake_tensor import FakeTensor

_ABSENT = object()


def _snapshot() -> dict[tuple[str, str], object]:
    return {(cls.__qualname__, name): value for cls in FakeTensor.__mro__ for name, value in vars(cls).items()}


def _changed(before: dict, after: dict) -> set[tuple[str, str]]:
    return {key for key in before.keys() | after.keys() if before.get(key, _ABSENT) is not after.get(key, _ABSENT)}


def _assert_patched(before: dict) -> None:
    assert _changed(before, _snapshot()) == {("FakeTensor", name) for name in _fake_cuda.PATCHES}
    for name, fn in _fake_cuda.PATCHES.items():
        assert getattr(FakeTensor, name) is fn


def _assert_restored(before: dict) -> None:
    assert _changed(before, _snapshot()) == set()
    assert _fake_cuda._depth == 0


def _fake_slice_works() -> None:
    x = torch.empty(2, 4, device="cuda")
    y = x[:, :2].contiguous().to("cuda", torch.float16)
    assert y.device.type == "cuda" and y.dtype is torch.float16 and tuple(y.shape) == (2, 2)


def test_patches_are_gone_after_the_session():
    before = _snapshot()
    with fake_cuda_session():
        _assert_patched(before)
        _fake_slice_works()
    _assert_restored(before)


def test_patches_are_gone_after_an_exception():
    before = _snapshot()
    with pytest.raises(ZeroDivisionError):
        with fake_cuda_session():
            _assert_patched(before)
            1 / 0
    _assert_restored(before)
    with pytest.raises(KeyError):
        with fake_cuda_bindings():
            raise KeyError("inside")
    _assert_restored(before)


def test_nested_sessions_restore_only_at_the_outermost_exit():
    before = _snapshot()
    with fake_cuda_session():
        with fake_cuda_bindings():
            _assert_patched(before)
        _assert_patched(before)
        _fake_slice_works()
        with pytest.raises(RuntimeError):
            with fake_cuda_session():
                raise RuntimeError("inner")
        _assert_patched(before)
        _fake_slice_works()
    _assert_restored(before)
    with fake_cuda_session():
        _assert_patched(before)
        _fake_slice_works()
    _assert_restored(before)


def test_overlapping_sessions_in_threads_restore_at_the_last_exit():
    before = _snapshot()
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with fake_cuda_session():
                entered.set()
                release.wait(timeout=30)
                _fake_slice_works()
        except BaseException as e:
            errors.append(e)
            entered.set()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        with fake_cuda_session():
            _fake_slice_works()
        # The other thread's session is still open: the patch stays for it.
        _assert_patched(before)
    finally:
        release.set()
        thread.join(timeout=30)
    assert not errors
    _assert_restored(before)


def test_threads_without_a_session_get_torch_behaviour():
    before = _snapshot()
    errors: dict[str, BaseException | None] = {}

    with fake_cuda_session():
        x = torch.empty(2, 4, device="cuda")

        def other() -> None:
            # The class attributes are the patched functions, but this thread opened no session,
            # so torch's own bindings run and open a CUDA guard a CPU-only build does not have.
            for name, call in [("contiguous", lambda: x.t().contiguous()), ("getitem", lambda: x[:, :2])]:
                try:
                    call()
                    errors[name] = None
                except RuntimeError as e:
                    errors[name] = e

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=30)
        assert x.t().contiguous().device.type == "cuda" and x[:, :2].device.type == "cuda"
    _assert_restored(before)
    assert set(errors) == {"contiguous", "getitem"}
    for name, error in errors.items():
        assert error is not None and "not linked with support for cuda" in str(error), name


def test_cuda_policy_check_runs_and_restores():
    before = _snapshot()
    report = graphamp.verify(torch.nn.Linear(4, 4), (torch.randn(2, 4),), device_type="cuda")
    assert report.ok
    _assert_restored(before)
    with fake_cuda_bindings():
        assert graphamp.verify(torch.nn.Linear(4, 4), (torch.randn(2, 4),), device_type="cuda").ok
        _assert_patched(before)
    _assert_restored(before)
