"""torch.compile(backend="graphamp") on the constructs the census's real models showed failing
(issue 17): each test is the smallest construct, compared with eager autocast bitwise, or the
typed graphamp error where the backend cannot be exact."""

import pytest
import torch
from torch import nn

from helpers import _loss, assert_same_grads, assert_same_outputs, run_eager

EAGER = {"inner": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, **options):
    return torch.compile(model, backend="graphamp", options={**EAGER, **options})


def run_compiled(cm, model, args, *, ambient):
    model.zero_grad(set_to_none=True)
    if ambient:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cm(*args)
    else:
        out = cm(*args)
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def assert_exact_compiled(model, args, *, ambient=True):
    ref, ref_grads = run_eager(model, args, {}, torch.bfloat16, grads=True)
    out, grads = run_compiled(compiled(model), model, args, ambient=ambient)
    assert_same_outputs(out, ref)
    assert ref_grads
    assert_same_grads(grads, ref_grads)


# torch.vmap in forward (hf/jamba's and hf/falcon_mamba's associative_scan under dynamo): dynamo's
# graph holds functorch's vmap markers, which the re-trace must record, not run unrecorded.

class VmappedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.vmap(lambda row: self.lin(row).relu())(x)


class AssociativeScan(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        from torch._higher_order_ops.associative_scan import associative_scan

        a = torch.exp(self.lin(x)).float()

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        _, s = associative_scan(combine, (a, x.float()), dim=1, combine_mode="generic")
        return s


@pytest.mark.parametrize("ambient", [True, False], ids=["inside-autocast", "outside"])
def test_associative_scan(ambient):
    torch.manual_seed(0)
    assert_exact_compiled(AssociativeScan(), (torch.randn(2, 5, 4),), ambient=ambient)
