"""spec: arguments resolved once, and the pipeline built from the spec alone."""

import pytest
import torch
from torch import nn

import graphamp
from graphamp.passes import Pass, build_pipeline, run_passes
from graphamp.policy import DTYPE_ALIASES
from graphamp.spec import AmpSpec, autocast_off
from helpers import captured


def test_resolve_fills_every_field_and_checks_them():
    spec = AmpSpec.resolve(nn.Linear(2, 2), (torch.randn(1, 2),), dtype="bf16")
    assert (spec.device_type, spec.dtype, spec.mode, spec.inference, spec.target) == ("cpu", torch.bfloat16, "exact", False, "module")
    assert spec.check and spec.policy.category("linear") is graphamp.Category.LOWER_PRECISION_FP
    assert not AmpSpec("cpu", torch.bfloat16, config=graphamp.Config(op_overrides={"gelu": "fp32"})).check
    with pytest.raises(ValueError, match="not supported"):
        AmpSpec.resolve(nn.Linear(2, 2), (), mode="fast")
    with pytest.raises(TypeError, match="inference must be True or False"):
        AmpSpec.resolve(nn.Linear(2, 2), (), inference="yes")
    assert DTYPE_ALIASES["half"] is torch.float16


def test_pipeline_follows_the_spec():
    names = lambda spec: [p.name for p in build_pipeline(spec)]  # noqa: E731
    exact = names(AmpSpec("cpu", torch.bfloat16))
    assert exact[-2:] == ["check_dtypes", "cache_weights"] and "freeze_weights" not in exact
    assert "freeze_weights" in names(AmpSpec("cpu", torch.bfloat16, inference=True))
    aot = names(AmpSpec("cpu", torch.bfloat16, target="aot"))
    assert "cache_weights" not in aot and "freeze_weights" not in aot


def test_a_failing_pass_is_named_with_the_passes_before_it():
    gm = captured(nn.Linear(2, 2), (torch.randn(1, 2),))

    def broken(gm, spec):
        raise RuntimeError("boom")

    passes = [p for p in build_pipeline(AmpSpec("cpu", torch.bfloat16))[:2]] + [Pass("broken", broken)]
    with pytest.raises(RuntimeError, match="boom") as info:
        run_passes(gm, AmpSpec("cpu", torch.bfloat16), passes)
    assert "in graphamp pass broken (passes run before it: record_dtypes, inline_regions)" in info.value.__notes__


def test_autocast_off_restores_the_ambient_state():
    with torch.autocast("cpu", dtype=torch.float16):
        with autocast_off():
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.float16


def test_every_public_error_and_warning_lives_in_errors_and_is_exported():
    import inspect

    import graphamp
    import graphamp.errors as errors

    def is_error(value: object) -> bool:
        return inspect.isclass(value) and issubclass(value, Warning | Exception)

    defined = {n for n, v in vars(errors).items() if is_error(v) and v.__module__ in ("graphamp", "graphamp.errors")}
    assert defined == set(errors.__all__)
    public = {n for n in graphamp.__all__ if is_error(getattr(graphamp, n))}
    assert public == set(errors.__all__), public ^ set(errors.__all__)
    assert all(getattr(graphamp, n) is getattr(errors, n) for n in errors.__all__)
