"""strip_asserts: export's dtype asserts go; nothing else does."""

import torch
from torch import nn

from graphamp.capture import capture
from graphamp.passes import record_dtypes, strip_asserts
from graphamp.spec import AmpSpec

SPEC = AmpSpec("cpu", torch.bfloat16)
ASSERT = torch.ops.aten._assert_tensor_metadata.default


class ToFloat(nn.Module):
    def forward(self, x):
        return x.float() * 2  # export checks that .float() of an fp32 input is a no-op


def test_dtype_asserts_are_erased_and_the_rest_kept():
    gm = capture(ToFloat(), (torch.randn(3),), {}, device_type="cpu", dtype=torch.bfloat16)
    record_dtypes(gm, SPEC)
    assert gm.graph.find_nodes(op="call_function", target=ASSERT)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not ASSERT]
    assert strip_asserts(gm, SPEC).modified
    assert not gm.graph.find_nodes(op="call_function", target=ASSERT)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == ops
    assert not strip_asserts(gm, SPEC).modified  # idempotent
    x = torch.randn(3)
    assert torch.equal(gm(x), x * 2)
