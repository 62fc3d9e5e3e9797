"""The drift test: every op-list fact in graphamp/policy.py against the installed torch's eager autocast.

TorchScript's autocast pass drifted from the eager lists and was abandoned; a torch upgrade that adds,
drops or re-categorizes an op must fail here, loudly, in either direction:

* membership: the ops registered under ``AutocastCPU`` / ``AutocastCUDA`` are exactly the tables' keys;
* behaviour: each listed op, run under eager autocast (CPU on real tensors, CUDA on fake CUDA
  tensors), follows exactly the table's category and no other (``tests/autocast_probe.py``);
* controls: unlisted ops show no autocast behaviour on the device where they are unlisted;
* ``policy.effective`` / ``policy.opaque``: unregistered CompositeImplicitAutograd ops that behave,
  under eager autocast, as the category the table gives them;
* ``APPEND_DTYPE_TARGETS`` name the overloads autocast redispatches to.

An op whose kernel cannot run here (no CUDA, no fp16 oneDNN) is still checked when autocast's casts,
which happen before the kernel raises, single out its category; the error is part of what is compared.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import autocast_probe as probe
from autocast_probe import NONE
from graphamp.policy import APPEND_DTYPE_TARGETS, Category, get_policy, op_key

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICES = ("cpu", "cuda")
AUTOCAST_KEY = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
POLICY = {device: get_policy(device, torch.bfloat16) for device in DEVICES}

# Listed ops whose behaviour cannot be exercised here, with the reason. Each entry must stay registered
# and listed, and the dict small: every op that can run (or cast before its kernel fails) is checked.
UNTESTABLE: dict[str, dict[str, str]] = {"cpu": {}, "cuda": {}}
MAX_UNTESTABLE = 10

# Unlisted ops, several of them listed on the other device, that must run untouched under autocast.
CONTROLS = {
    "cpu": [
        "add.Tensor", "mul.Tensor", "gelu", "relu", "tanh", "sigmoid", "_softmax", "softmax.int",
        "log_softmax.int", "layer_norm", "native_layer_norm", "group_norm", "batch_norm", "dropout",
        "embedding", "sum", "sum.dim_IntList", "mean", "exp", "log", "cumsum", "addcmul", "mv", "dot",
        "pow.Tensor_Scalar", "avg_pool2d", "max_pool2d", "where.self", "upsample_nearest2d.vec",
    ],
    "cuda": [
        "add.Tensor", "mul.Tensor", "gelu", "relu", "tanh", "sigmoid", "_softmax", "batch_norm", "dropout",
        "embedding", "mean", "avg_pool2d", "max_pool2d", "where.self", "cat", "stack", "index_copy",
        "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d", "trace", "reflection_pad2d", "replication_pad2d",
        "inverse", "_addmm_activation",
    ],
}

# Eager CPU fp16 autocast runs nn.LSTM through oneDNN (the fp32 input passes use_mkldnn) and oneDNN has
# no fp16 LSTM primitive on CPUs without native fp16 support: eager raises, so there is nothing to match.
_NO_FP16_ONEDNN_RNN = "could not create a primitive descriptor for the LSTM forward propagation primitive"


@functools.cache
def registered(device: str) -> frozenset[str]:
    return frozenset(probe.registered(AUTOCAST_KEY[device]))


def _params(device_keys: dict[str, list[str]]) -> list:
    return [
        pytest.param(device, dtype, key, id=f"{device}-{dtype}-{key}")
        for device, keys in device_keys.items()
        for dtype in LOW
        for key in sorted(keys)
    ]


def _is_composite(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(probe.resolve(key).name(), "CompositeImplicitAutograd")


def _equal(a: object, b: object) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_registered_ops_are_the_table(device: str) -> None:
    tables = {dtype: set(get_policy(device, low).ops) for dtype, low in LOW.items()}
    assert tables["bf16"] == tables["fp16"], "the op lists must not depend on the low dtype"
    missing = sorted(registered(device) - tables["bf16"])
    extra = sorted(tables["bf16"] - registered(device))
    assert not missing and not extra, (
        f"{AUTOCAST_KEY[device]} registrations of torch {torch.__version__} differ from graphamp's {device} "
        f"table: registered but not listed {missing}; listed but not registered {extra}"
    )


def test_op_key_round_trips() -> None:
    for key in ("linear", "softmax.int", "conv2d.padding", "_convolution.deprecated"):
        assert op_key(probe.resolve(key)) == key


@pytest.mark.parametrize(
    "device, dtype, key",
    _params({d: [k for k in POLICY[d].ops if k not in UNTESTABLE[d]] for d in DEVICES}),
)
def test_listed_op_behaves_as_its_category(device: str, dtype: str, key: str) -> None:
    expected = POLICY[device].ops[key]
    with probe.device_context(device):
        found, seen = probe.consistent_categories(key, device, LOW[dtype])
    evidence = "\n".join(f"  {variant}: {what}" for variant, what in seen.items())
    assert found == {expected}, (
        f"{device} {dtype} {key}: graphamp's table says {expected.value}, eager autocast is consistent with "
        f"{sorted(c.value if c else 'none' for c in found)}\n{evidence}"
    )


def test_every_listed_op_is_checked_or_explained() -> None:
    for device, untestable in UNTESTABLE.items():
        assert len(untestable) <= MAX_UNTESTABLE, f"{device}: too many untestable ops: {sorted(untestable)}"
        for key, reason in untestable.items():
            assert reason, f"{device} {key}: say why it cannot be tested"
            assert key in registered(device) and key in POLICY[device].ops, (
                f"{device} {key} is no longer a listed autocast op; drop it from UNTESTABLE"
            )
        for key in POLICY[device].ops:
            assert (key in probe.SAMPLES) != (key in untestable), (
                f"{device} {key}: give it sample inputs in tests/autocast_probe.py or a reason in UNTESTABLE, "
                "not both"
            )


@pytest.mark.parametrize("device, dtype, key", _params(CONTROLS))
def test_unlisted_op_is_untouched(device: str, dtype: str, key: str) -> None:
    policy = POLICY[device]
    assert key not in registered(device), f"{key} is registered under {AUTOCAST_KEY[device]}"
    assert key not in policy.ops and key not in policy.effective and key not in policy.opaque
    with probe.device_context(device):
        found, seen = probe.consistent_categories(key, device, LOW[dtype])
    evidence = "\n".join(f"  {variant}: {what}" for variant, what in seen.items())
    assert NONE in found, f"{device} {dtype} {key}: unlisted, but eager autocast changed it\n{evidence}"


@pytest.mark.parametrize(
    "device, dtype, key", _params({d: list(POLICY[d].effective) for d in DEVICES})
)
def test_effective_composite_behaves_as_its_category(device: str, dtype: str, key: str) -> None:
    category = POLICY[device].effective[key]
    low = LOW[dtype]
    assert key not in registered(device), f"{key} is now registered under {AUTOCAST_KEY[device]}: list it"
    assert key not in POLICY[device].ops
    assert _is_composite(key), f"{key} is no longer CompositeImplicitAutograd"
    assert category in (Category.LOWER_PRECISION_FP, Category.FP32)
    op = probe.resolve(key)
    with probe.device_context(device):
        args, kwargs = probe.make_sample(key, device)
        # The inputs a model typically feeds: fp32 for an op that goes low, low for one that goes fp32.
        typical = "fp32" if category is Category.LOWER_PRECISION_FP else "low"
        vargs, vkwargs = probe.variants(op, args, kwargs, low)[typical]
        observed = probe.observe(op, vargs, vkwargs, device, low)
        predicted = probe.predict(category, op, vargs, vkwargs, device, low)
        untouched = probe.predict(NONE, op, vargs, vkwargs, device, low)
    assert observed.error is None and predicted.error is None, (observed.error, predicted.error)
    assert predicted.out != untouched.out, f"{key}: the sample has no input the category would cast"
    assert observed.out == predicted.out, (
        f"{device} {dtype} {key}: table says it behaves as {category.value} (output dtypes "
        f"{list(predicted.out)}), eager autocast gives {list(observed.out)}; {observed.summary()}"
    )
    if device == "cpu":
        assert _equal(observed.result, predicted.result), f"{key}: same dtypes, different values"


@contextlib.contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    old = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = old


# The RNN composites pick their kernels at run time: oneDNN or not (torch.backends.mkldnn.enabled, dtype,
# grad mode), so each is checked in training, in inference, and with oneDNN switched off; the policy
# is taken in the same oneDNN state, since its opaque entries depend on it.
OPAQUE_CANDIDATES = ["lstm.input", "rnn_tanh.input", "rnn_tanh.data", "rnn_relu.input", "rnn_relu.data"]


# RNN composites whose native paths promote with an fp32 state: graphamp decomposes them instead
# (tests/test_convert_cases.py checks the decomposition end to end against eager).
DECOMPOSED_RNN = ["gru.input", "gru.data", "lstm.data"]


@pytest.mark.parametrize("key", DECOMPOSED_RNN)
def test_promoting_rnns_are_decomposed(key: str) -> None:
    assert _is_composite(key) and key not in registered("cpu")
    for dtype in LOW.values():
        assert get_policy("cpu", dtype).category(key) is None


@pytest.mark.parametrize("projections", [False, True])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lstm_uses_onednn_where_eager_does(input_dtype: torch.dtype, grad: bool, projections: bool) -> None:
    # graphamp decomposes aten::lstm along oneDNN's kernel path exactly where eager takes it.
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphamp.policy import lstm_uses_onednn

    lstm = nn.LSTM(4, 6, proj_size=2 if projections else 0).to(input_dtype)
    x = torch.randn(3, 2, 4, dtype=input_dtype)
    with torch.set_grad_enabled(grad):
        try:
            traced = make_fx(lstm)(x)
        except RuntimeError as e:  # oneDNN may lack a kernel for this dtype on this CPU
            pytest.skip(f"eager cannot run this LSTM here: {str(e).splitlines()[0]}")
    onednn = any(n.target is torch.ops.aten.mkldnn_rnn_layer.default for n in traced.graph.nodes)
    assert lstm_uses_onednn(input_dtype, projections=projections, grad_enabled=grad) == onednn


def test_opaque_candidates_cover_the_tables() -> None:
    for dtype in LOW.values():
        assert set(get_policy("cpu", dtype).opaque) <= set(OPAQUE_CANDIDATES)
    assert not get_policy("cuda", torch.float16).opaque


@pytest.mark.parametrize("mode", ["inference", "train", "inference-no-onednn"])
@pytest.mark.parametrize("device, dtype, key", _params({"cpu": OPAQUE_CANDIDATES}))
def test_opaque_composite_equals_precast_inputs(device: str, dtype: str, key: str, mode: str) -> None:
    low = LOW[dtype]
    with _onednn(not mode.endswith("no-onednn")):
        policy = get_policy(device, low)
    if key not in policy.opaque:
        pytest.skip(f"{key} is decomposed, not run whole, under {dtype} in this oneDNN state")
    assert policy.opaque[key] is Category.LOWER_PRECISION_FP
    assert key not in registered(device), f"{key} is now registered under {AUTOCAST_KEY[device]}: list it"
    assert _is_composite(key), f"{key} is no longer CompositeImplicitAutograd"
    op = probe.resolve(key)
    args, kwargs = probe.make_sample(key, device)
    if mode == "train":
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.requires_grad_() if t.is_floating_point() else t, (args, kwargs)
        )
    with torch.set_grad_enabled(mode == "train"), _onednn(not mode.endswith("no-onednn")):
        observed = probe.observe(op, args, kwargs, device, low)
        precast = probe.predict(Category.LOWER_PRECISION_FP, op, args, kwargs, device, low)
    if observed.error is not None and _NO_FP16_ONEDNN_RNN in observed.error and low is torch.float16:
        pytest.skip(f"eager CPU fp16 autocast cannot run {key} on this CPU: {observed.error}")
    assert observed.error is None and precast.error is None, (observed.error, precast.error)
    assert observed.out == precast.out, (
        f"{key} ({mode}): running it on inputs pre-cast to {dtype} gives {list(precast.out)}, "
        f"eager {dtype} autocast gives {list(observed.out)}"
    )
    assert _equal(observed.result, precast.result), f"{key} ({mode}): same dtypes, different values"


def test_append_dtype_targets_are_the_redispatch_overloads() -> None:
    appended = {k for k, c in POLICY["cuda"].ops.items() if c is Category.FP32_APPEND_DTYPE}
    assert set(APPEND_DTYPE_TARGETS) == appended
    for key, target_key in APPEND_DTYPE_TARGETS.items():
        target = probe.resolve(target_key)
        assert "dtype" in [a.name for a in target._schema.arguments], f"{target_key} takes no dtype"
        # autocast redispatches with the same arguments plus dtype: the overload the probe finds.
        assert probe.dtype_overload(probe.resolve(key)) is target, f"{key} -> {target_key}"


def test_samples_are_all_used() -> None:
    used = {key for device in DEVICES for key in (*POLICY[device].ops, *POLICY[device].effective,
                                                  *OPAQUE_CANDIDATES, *DECOMPOSED_RNN, *CONTROLS[device])}
    assert set(probe.SAMPLES) <= used, f"stale SAMPLES entries: {sorted(set(probe.SAMPLES) - used)}"
