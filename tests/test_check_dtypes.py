"""check_dtypes: every node's dtype after the casts equals the one eager autocast gave it."""

import pytest
import torch
from torch import nn

import graphamp
from graphamp.passes import check_dtypes, insert_casts
from graphamp.node_info import peek
from graphamp.policy import get_policy
from graphamp.spec import AmpSpec
from helpers import captured

SPEC = AmpSpec("cpu", torch.bfloat16)


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def test_agrees_with_eager_after_the_casts():
    gm = captured(_model(), (torch.randn(2, 4),))
    assert all(peek(n).captured is not None for n in gm.graph.nodes if n.op == "call_function")
    insert_casts(gm, SPEC)
    assert not check_dtypes(gm, SPEC).modified


def test_a_drifted_table_is_named_at_its_node(monkeypatch):
    gm = captured(_model(), (torch.randn(2, 4),))
    drifted = get_policy("cpu", torch.bfloat16).with_overrides({"layer_norm": graphamp.Category.FP32})
    monkeypatch.setattr(AmpSpec, "policy", property(lambda self: drifted))
    insert_casts(gm, SPEC)
    with pytest.raises(graphamp.PolicyDriftError, match=r"node layer_norm .* eager autocast gave \(torch.bfloat16,\)"):
        check_dtypes(gm, SPEC)
