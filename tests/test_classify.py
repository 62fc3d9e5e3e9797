"""classify alone, on tiny hand-built FX graphs: the category, low dtype and reason, and no edit."""

import dataclasses
from types import MappingProxyType

import pytest
import torch
from torch import nn
from torch.fx import Graph

from graphamp.config import Config
from graphamp.node_info import AutocastFrame, GradFrame, info, peek
from graphamp.passes.classify import Decision, autocast_state, classify, location
from graphamp.policy import Category, get_policy

aten = torch.ops.aten
BF16 = get_policy("cpu", torch.bfloat16)


def _op(target, *, region=(), module_stack=None):
    """A graph holding one ``target`` node on a placeholder; returns the node."""
    g = Graph()
    x = g.placeholder("x")
    node = g.call_function(target, (x, x))
    if region:
        info(node).region = region
    if module_stack is not None:
        node.meta["nn_module_stack"] = module_stack
    g.output(node)
    return node


@pytest.mark.parametrize(
    "target, category",
    [
        (aten.mm.default, Category.LOWER_PRECISION_FP),
        (aten.mse_loss.default, Category.FP32),
        (aten.relu.default, None),
    ],
    ids=["lower", "fp32", "unlisted"],
)
def test_category_comes_from_the_policy_list(target, category):
    d = classify(_op(target), BF16, Config())
    assert d.category is category and d.low is torch.bfloat16
    assert d.reason == (f"{category.value} (cpu list)" if category else "not on an autocast list")


def test_classify_writes_nothing():
    node = _op(aten.mm.default)
    before = list(node.graph.nodes), dict(node.meta), node.args
    classify(node, BF16, Config())
    assert (list(node.graph.nodes), dict(node.meta), node.args) == before
    assert peek(node) is None


def test_disabled_region_leaves_the_op_alone():
    node = _op(aten.mm.default, region=(AutocastFrame("cpu", None, False),))
    assert classify(node, BF16, Config()) == (None, torch.bfloat16, "autocast disabled by a region in forward")


def test_innermost_region_sets_the_low_dtype_and_other_devices_are_ignored():
    region = (AutocastFrame("cpu", torch.float16, True), GradFrame(False), AutocastFrame("cuda", torch.bfloat16, False))
    node = _op(aten.mm.default, region=region)
    assert autocast_state(node, BF16) == (True, torch.float16)
    assert classify(node, BF16, Config()) == (Category.LOWER_PRECISION_FP, torch.float16, "lower_precision_fp (cpu list)")


def test_nested_region_reenables():
    node = _op(aten.mm.default, region=(AutocastFrame("cpu", None, False), AutocastFrame("cpu", None, True)))
    assert classify(node, BF16, Config()).category is Category.LOWER_PRECISION_FP


def test_module_kept_in_fp32_wins_over_region_and_list():
    stack = {"a": ("enc", "torch.nn.modules.container.Sequential"), "b": ("enc.0", nn.Linear)}
    node = _op(aten.mm.default, region=(AutocastFrame("cpu", None, False),), module_stack=stack)
    d = classify(node, BF16, Config(fp32_modules=(nn.Linear,)))
    assert d == Decision(Category.FP32, torch.bfloat16, "inside enc.0, kept in fp32 by config")
    assert classify(node, BF16, Config(fp32_modules=("enc",))).reason == "inside enc, kept in fp32 by config"


def test_config_override_is_named_as_the_source():
    config = Config(op_overrides={"relu": "fp32"})
    policy = BF16.with_overrides({"relu": Category.FP32})
    assert classify(_op(aten.relu.default), policy, config) == (Category.FP32, torch.bfloat16, "fp32 (config override)")


def test_opaque_lstm_is_left_to_the_kernel_path_only_with_kernel_paths():
    policy = dataclasses.replace(BF16, opaque=MappingProxyType({"lstm.input": Category.LOWER_PRECISION_FP}))
    node = _op(aten.lstm.input)
    assert classify(node, policy, Config()) == (None, torch.bfloat16, "decomposed along the kernel path eager takes for it")
    whole = classify(node, policy, Config(), kernel_paths=False)
    assert whole == (Category.LOWER_PRECISION_FP, torch.bfloat16, "lower_precision_fp (cpu composite, run whole)")


def test_location_names_the_innermost_module():
    assert location(_op(aten.mm.default)) == "at the top level of forward"
    stack = {"a": ("", "Net"), "b": ("enc.norm", nn.LayerNorm)}
    assert location(_op(aten.mm.default, module_stack=stack)) == "in module enc.norm (LayerNorm)"
    assert location(_op(aten.mm.default, module_stack={"a": ("", "my.pkg.Net")})) == "in module <root> (Net)"
