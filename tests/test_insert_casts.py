"""insert_casts on tiny graphs: structure first (which casts, where, why), numerics second."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import graphamp
from graphamp.passes import insert_casts
from graphamp.policy import get_policy
from graphamp.verify.fake_cuda import fake_cuda_model
from helpers import spec_of, captured, casts, targets

aten = torch.ops.aten
BF16 = get_policy("cpu", torch.bfloat16)


class Fn(nn.Module):
    def __init__(self, fn, *params):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList(params)

    def forward(self, *args):
        return self.fn(*args, *self.ps)


def _cast_dtypes(gm):
    return sorted(str(n.kwargs["dtype"]) for n in casts(gm))


def _rewrite(fn, *args, params=(), policy=BF16):
    gm = captured(Fn(fn, *params), args, dtype=policy.dtype, device_type=policy.device_type)
    insert_casts(gm, spec_of(policy))
    return gm


def test_lower_precision_casts_every_eligible_argument():
    gm = _rewrite(lambda x, w, b: torch.nn.functional.linear(x, w, b), torch.randn(2, 4), params=(nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))))
    assert _cast_dtypes(gm) == ["torch.bfloat16"] * 3
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert all(a.target is aten._to_copy.default for a in linear.args)
    assert linear.meta["graphamp"].category == "lower_precision_fp"


def test_ineligible_arguments_are_left_alone():
    gm = _rewrite(lambda x, i: (x.double() @ x.double().t(), i @ i.t()), torch.randn(2, 4), torch.randint(0, 5, (2, 4)))
    assert casts(gm) == []


def test_fp32_list_casts_low_inputs_up():
    gm = _rewrite(lambda x, y: torch.nn.functional.mse_loss(x @ x.t(), y), torch.randn(3, 3), torch.randn(3, 3))
    assert _cast_dtypes(gm) == ["torch.bfloat16", "torch.bfloat16", "torch.float32"]  # mm in, mm out up


@pytest.mark.parametrize("mixed, expected", [(True, ["torch.float32"]), (False, [])], ids=["fp32-wins", "all-low"])
def test_promote(mixed, expected):
    def f(x, y):
        low = x @ x.t()
        other = y if mixed else y @ y.t()
        return torch.cat([low, other], 0)

    gm = _rewrite(f, torch.randn(3, 3), torch.randn(3, 3))
    cat_inputs = [n for n in gm.graph.nodes if n.target is aten.cat.default][0].args[0]
    cast_into_cat = [a for a in cat_inputs if a.target is aten._to_copy.default]
    assert [str(c.kwargs["dtype"]) for c in cast_into_cat] == expected


def test_promote_ignores_float64():
    gm = _rewrite(lambda x: torch.cat([x @ x.t(), x.double()[:, :3]], 0), torch.randn(3, 3))
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default)
    assert cat.meta["graphamp"].dtype is torch.bfloat16  # fp64 does not vote; cat then type-promotes


def test_promote_rejects_two_low_dtypes_as_eager_does():
    def f(x):
        with torch.autocast("cpu", dtype=torch.float16):
            half = x @ x.t()
        return torch.cat([half, x @ x.t()], 0)

    x = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="prioritize"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            Fn(f)(x)
    with pytest.raises(graphamp.PromoteTypeError, match="prioritize"):
        _rewrite(f, x)


def test_in_place_and_out_overloads_are_never_cast():
    def f(x, acc):
        acc = acc.clone()
        acc.addmm_(x, x.t())
        return acc

    gm = _rewrite(f, torch.randn(3, 3), torch.randn(3, 3))
    assert aten.addmm_.default in targets(gm) and casts(gm) == []


def test_unlisted_composite_is_decomposed_when_it_holds_listed_ops():
    gm = _rewrite(lambda x, w: torch.einsum("bi,ij->bj", x, w), torch.randn(2, 4), params=(nn.Parameter(torch.randn(4, 3)),))
    assert aten.einsum.default not in targets(gm)
    assert any(t in (aten.bmm.default, aten.mm.default) for t in targets(gm))
    assert _cast_dtypes(gm) == ["torch.bfloat16", "torch.bfloat16"]


def test_unlisted_composite_without_listed_ops_stays_whole():
    gm = _rewrite(lambda x: torch.nn.functional.layer_norm(x, (4,)), torch.randn(2, 4))
    assert aten.layer_norm.default in targets(gm) and casts(gm) == []


def test_explicit_dtype_is_respected():
    gm = _rewrite(lambda x: (x @ x.t()).softmax(-1, dtype=torch.float64), torch.randn(3, 3))
    softmax = next(n for n in gm.graph.nodes if n.target is aten.softmax.int)
    assert softmax.args[2] is torch.float64 or softmax.kwargs.get("dtype") is torch.float64


def _cuda_rewrite(fn, *shapes):
    policy = get_policy("cuda", torch.float16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_cuda_model(Fn(fn))
        args = tuple(torch.randn(*s, device="cuda") for s in shapes)
        gm = captured(model, args, dtype=policy.dtype, device_type="cuda")
        insert_casts(gm, spec_of(policy))
    return gm


def test_set_opt_dtype_passes_float32_without_casting():
    gm = _cuda_rewrite(lambda x: ((x @ x.t()).softmax(-1), (x @ x.t()).sum(-1, dtype=torch.float16)), (3, 3))
    softmax = next(n for n in gm.graph.nodes if n.target is aten.softmax.int)
    assert softmax.kwargs["dtype"] is torch.float32
    assert softmax.args[0].target is not aten._to_copy.default  # the input itself is not cast
    summed = next(n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList)
    assert summed.kwargs.get("dtype") is torch.float16  # explicit dtype respected


def test_append_dtype_redispatches_norm():
    gm = _cuda_rewrite(lambda x: aten.norm.ScalarOpt_dim(x @ x.t(), 2, [-1]), (3, 3))
    norm = next(n for n in gm.graph.nodes if str(n.target).startswith("aten.norm"))
    assert norm.target is aten.norm.ScalarOpt_dim_dtype and norm.kwargs["dtype"] is torch.float32


def test_cuda_policy_casts_for_fp32_ops():
    gm = _cuda_rewrite(lambda x: torch.exp(x @ x.t()), (3, 3))
    exp = next(n for n in gm.graph.nodes if n.target is aten.exp.default)
    assert exp.args[0].target is aten._to_copy.default and exp.args[0].kwargs["dtype"] is torch.float32


def test_fp32_module_config_wins_over_the_lists():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    gm = captured(model, (torch.randn(2, 4),))
    insert_casts(gm, spec_of(BF16, config=graphamp.Config(fp32_modules=("1",))))
    second = [n for n in gm.graph.nodes if n.target is aten.linear.default][1]
    assert second.meta["graphamp"].dtype is torch.float32
    assert "kept in fp32" in second.meta["graphamp"].reason
