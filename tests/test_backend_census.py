"""torch.compile(backend="graphamp") on the constructs the census's real models showed failing
(issue 17): each test is the smallest construct, compared with eager autocast bitwise, or the
typed graphamp error where the backend cannot be exact."""

import contextlib

import pytest
import torch

import graphamp
from helpers import _loss, assert_same_grads, assert_same_outputs, run_eager
import torch.nn.functional as F
from torch import nn

# The backend tests' own helpers: an empty dynamo cache per test (autouse), inner="eager".
from test_backend import EAGER, _fresh_dynamo, compiled  # noqa: F401


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
# graph holds functorch's vmap markers. Run unrecorded in the re-trace, their batched tensors
# reached the tracer as constants (BackendCompilerFailed: "NYI: querying is_contiguous inside of
# vmap"); and eager autocast inside vmap casts the ops a batching rule calls, not the op: under
# vmap, linear with a bias is fp32 (bf16 mm + fp32 add) while x @ w is bf16.

class VmappedLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = torch.vmap(lambda row: (self.lin(row).relu(), row @ self.w))(x)
        return self.lin(y[0]) + y[1]


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


class FuncTransforms(nn.Module):
    """torch.func.jvp and torch.func.grad in forward: their regions are kept whole too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        tangent = torch.func.jvp(lambda r: self.lin(r).tanh(), (x,), (torch.ones_like(x),))[1]
        grad = torch.func.grad(lambda r: self.lin(r).tanh().float().sum())(x)
        return self.lin(tangent) * grad


@pytest.mark.parametrize("ambient", [True, False], ids=["inside-autocast", "outside"])
@pytest.mark.parametrize("cls", [VmappedLayers, AssociativeScan, FuncTransforms])
def test_vmap_region(cls, ambient):
    torch.manual_seed(0)
    assert_exact_compiled(cls(), (torch.randn(2, 5, 4),), ambient=ambient)


@pytest.mark.parametrize("cls", [VmappedLayers, AssociativeScan, FuncTransforms])
def test_vmap_region_no_grad(cls):
    # Under no_grad dynamo traces again (grad mode is guarded); torch.func.grad's region then
    # switches grad on inside, as eager's does.
    torch.manual_seed(0)
    model, x = cls(), torch.randn(2, 5, 4)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model(x)
        out = compiled(model)(x)
    assert_same_outputs(out, ref)


@pytest.mark.parametrize("cls", [VmappedLayers, FuncTransforms])
def test_vmap_region_dynamic_shapes(cls):
    # The region's body keeps dynamo's symbolic sizes: one graph serves other batch and lengths.
    torch.manual_seed(0)
    model = cls()
    cm = torch.compile(model, backend="graphamp", options=EAGER, dynamic=True)
    for shape in [(2, 5, 4), (3, 7, 4)]:
        x = torch.randn(shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert_same_outputs(cm(x), model(x))


# A routed sum whose buffer's dtype the Python chooses (hf/jetmoe's index_add before the backend
# followed eager's dtype constants): outside torch.autocast dynamo traces the fp32 branch, and the
# graph index_adds a bf16 source into an fp32 tensor. torch's fake index_add does not check dtypes,
# so the graph compiled and raised an untyped RuntimeError at its first call.

class RoutedSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, index):
        h = self.lin(x)
        out = torch.zeros(3, 4) if h.dtype == torch.float32 else h.new_zeros(3, 4)
        return out.index_add(0, index, h)


def test_index_add_of_other_dtype_is_a_typed_error():
    from torch._dynamo.exc import BackendCompilerFailed

    import graphamp

    args = (torch.randn(5, 4), torch.tensor([0, 2, 1, 0, 2]))
    model = RoutedSum()
    assert_exact_compiled(model, args, ambient=True)
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(model)(*args)
    error = info.value.inner_exception
    assert isinstance(error, graphamp.PolicyDriftError), error
    assert "index_add" in str(error) and "torch.autocast('cpu', dtype=torch.bfloat16)" in str(error)


# A dtype call only eager makes (the branch dynamo does not take: hf/jamba's and hf/falcon_mamba's
# recurrent scan, where the compiled code takes associative_scan) must not lend its autocast
# constants to a graph call alike in name and constants (a literal .to(torch.float32)). The
# backend aligns the graph's dtype calls with eager's by name and constants only, so the literal
# cast became .to(torch.bfloat16). Keying each call by its call site (file:line) fixes it: the
# patch for graphamp/backend/observe.py and eager_dtypes.py is in the issue 17 report.

class EagerOnlyDtypeCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if not torch.compiler.is_compiling():
            h = h.to(h.dtype)
        return h.to(torch.float32).pow(2)


def test_eager_only_dtype_call_lends_no_constants():
    torch.manual_seed(0)
    assert_exact_compiled(EagerOnlyDtypeCall(), (torch.randn(2, 4),), ambient=False)


# Code that switches autocast off only where it is on (transformers' maybe_autocast(...,
# enabled=False): Flint's attention scores, Inkling's and HunYuan-VL's fp32 regions). Outside
# torch.autocast dynamo traced it with no region, and graphamp's policy ran the region's matmul in
# bf16 where eager autocast runs it in fp32 (census 2026-11-27: Flint's logits differed by 0.0039).

class MaybeAutocastOff(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.q(x)
        region = torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else contextlib.nullcontext()
        with region:
            scores = torch.matmul(h.float(), h.float().transpose(-1, -2)) * 0.5
        return self.out(scores.softmax(-1).to(h.dtype) @ h)


def test_a_region_eager_switches_autocast_off_in_is_followed_outside_autocast():
    torch.manual_seed(0)
    assert_exact_compiled(MaybeAutocastOff(), (torch.randn(2, 4, 8),), ambient=False)


def test_the_region_markers_wrap_only_the_calls_from_the_off_sites():
    from graphamp.backend.eager_regions import follow_eager_regions
    from graphamp.backend.observe import node_call_site

    def f(x):
        a = x.sin()
        b = a @ a
        return b.cos() + a

    gm = torch.fx.symbolic_trace(f)
    for node in gm.graph.nodes:
        node.meta["stack_trace"] = f'  File "model.py", line {3 if node.name == "matmul" else 9}, in f\n'
    matmul = next(n for n in gm.graph.nodes if n.name == "matmul")
    assert follow_eager_regions(gm, {node_call_site(matmul)}, device_type="cpu")
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    enter, exit_ = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
    assert order.count(enter) == order.count(exit_) == 1
    i = order.index(enter)
    assert order[i + 1 : i + 3] == [matmul.target, exit_]
    x = torch.randn(3, 3)
    assert torch.equal(gm(x), f(x))
    assert not follow_eager_regions(gm, set(), device_type="cpu")


def test_flint_outside_autocast_is_bitwise():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlintConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Flint")
    torch.manual_seed(0)
    config = transformers.FlintConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )
    model = transformers.FlintForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want = model(input_ids=ids).logits
    with torch.no_grad():
        got = compiled(model)(input_ids=ids).logits
    assert got.dtype == want.dtype and torch.equal(got, want)


# A mask eager drops by value (hf/paligemma, hf/colpali, hf/aimv2): transformers calls SDPA without
# the all-ones padding mask in eager (PaliGemma then attends bidirectionally, AIMv2's text tower
# without its causal mask) but builds the mask when compiled. The backend compiles eager's program
# and dynamo's, and picks per call by the graph's mask: bitwise on the all-ones mask and on a
# padded one, forward and gradients. (In training the model breaks into graphs: the eager run that
# observes a later graph at compile time must not bump a buffer's version that an earlier graph saved
# for its backward, Gemma's embed_scale.)

def _tiny_paligemma():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, vocab_size=120, head_dim=16, use_cache=False),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=16),
        image_token_index=100, vocab_size=120, projection_dim=32,
    )
    model = transformers.PaliGemmaForConditionalGeneration(config)
    ids = torch.cat([torch.full((2, 4), 100), torch.randint(0, 99, (2, 5))], 1)
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 32, 32), use_cache=False)


def _padded(kwargs):
    mask = torch.ones_like(kwargs["input_ids"])
    mask[1, -2:] = 0
    return {**kwargs, "attention_mask": mask}


def test_a_mask_eager_drops_by_value_is_followed_per_call_in_training():
    # Forward and gradients; without grad, on DropsAnAllOnesMask below.
    model, kwargs = _tiny_paligemma()
    model.train()
    ones = {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    cm = compiled(model)
    for call in (ones, _padded(kwargs), ones):  # eager's program, dynamo's, eager's again
        ref, ref_grads = run_eager(model, (), call, torch.bfloat16, grads=True)
        model.zero_grad(set_to_none=True)
        out = cm(**call)
        _loss(out).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        assert_same_outputs(out, ref)
        assert_same_grads(grads, ref_grads)


def test_mask_patterns():
    from graphamp.backend.dropped_masks import MaskPattern

    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert MaskPattern.of(causal[None, None].expand(2, 1, 4, 4)).matches(torch.ones(6, 6, dtype=torch.bool).tril())
    padded = causal.clone()
    padded[:, 0] = False
    assert not MaskPattern.of(causal).matches(padded)
    additive = torch.zeros(2, 1, 3, 3)
    assert MaskPattern.of(additive).kind == "all" and not MaskPattern.of(additive).matches(torch.tensor([[0.0, -1e9]]))
    other = MaskPattern.of(padded)
    assert other.kind == "values" and other.matches(padded.clone()) and not other.matches(causal)


class DropsAnAllOnesMask(nn.Module):
    """transformers' pattern in small: an all-ones padding mask is dropped in eager only; and a
    sum by an in-place ``index_add_`` whose result goes unused (a mixture-of-experts layer's, as
    in hf/deepseek_v3), which the copy holding eager's program must keep."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        attn_mask = mask[:, None, None, :].bool()
        if not torch.compiler.is_compiling() and bool(mask.all()):
            attn_mask = None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        total = torch.zeros_like(out)
        total.index_add_(0, torch.arange(out.shape[0]), out)
        return total


def _all_ones_and_padded():
    padded = torch.ones(2, 6, dtype=torch.long)
    padded[1, -2:] = 0
    return torch.ones(2, 6, dtype=torch.long), padded


def test_the_program_without_the_mask_keeps_in_place_writes():
    torch.manual_seed(0)
    model, x = DropsAnAllOnesMask().eval(), torch.randn(2, 6, 8)
    cm = compiled(model)
    for mask in _all_ones_and_padded():
        ref, _ = run_eager(model, (x, mask), {}, torch.bfloat16, grads=False)
        with torch.no_grad():
            assert_same_outputs(cm(x, mask), ref)


# A method cached by shape, device and dtype (transformers' compile_compatible_method_lru_cache:
# DETR-family and SAM3 position embeddings, hf/maskformer and hf/sam3_vision_model): uncached while
# compiling, cached in eager. An eager autocast call before compiling fills the bf16 entry, so the
# backend's eager run made none of the calls inside, and could not give dynamo's fp32 trace of them
# eager's dtypes.

def _cached_embedding():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")

    class SinePosition(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        @staticmethod
        @pytorch_utils.compile_compatible_method_lru_cache(maxsize=1)
        def embedding(shape, device, dtype):
            steps = torch.arange(1, shape[-1] + 1, dtype=dtype, device=device)
            return (steps / shape[-1] * 3.14159).sin().expand(shape)

        def forward(self, x):
            h = self.proj(x)
            return h + self.embedding(h.shape, h.device, h.dtype)

    return SinePosition


def test_a_cached_method_eager_filled_before_compiling_is_followed():
    torch.manual_seed(0)
    model, x = _cached_embedding()().eval(), torch.randn(2, 8)
    ref, _ = run_eager(model, (x,), {}, torch.bfloat16, grads=False)  # fills the bf16 entry
    with torch.no_grad():
        out = compiled(model)(x)
    assert_same_outputs(out, ref)


def test_masks_that_cannot_be_computed_run_dynamos_program_and_say_so():
    from graphamp.backend.dropped_masks import MaskPattern, Split, dispatch

    def fails(*args):
        raise RuntimeError("no mask here")

    run = dispatch(Split(None, fails, [MaskPattern("all")]), lambda *a: "eager's", lambda *a: "dynamo's")
    with pytest.warns(graphamp.EagerPathWarning, match="could not compute the attention masks"):
        assert run(torch.ones(2)) == "dynamo's"
    assert run(torch.ones(2)) == "dynamo's"  # warned once


# The same drop before eager attention (hf/bridgetower): eager's Python adds no mask, dynamo's graph
# adds the fp32 zero mask to the bf16 scores, which promotes them, so softmax and the attention
# weights come out fp32 where eager autocast gives bf16. No call records the drop; the backend splits
# where the program without the add is the one that gives eager's outputs on the example.

class AddsAnAllOnesMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        if not torch.compiler.is_compiling() and bool(mask.all()):
            bias = None
        scores = q @ k.transpose(-1, -2) * 0.5
        if bias is not None:
            scores = scores + bias
        weights = scores.softmax(-1)
        return weights @ v, weights


@pytest.mark.parametrize("ambient", [False, True], ids=["outside", "inside_autocast"])
def test_a_mask_eager_attention_drops_is_followed_per_call(ambient):
    torch.manual_seed(0)
    model, x = AddsAnAllOnesMask().eval(), torch.randn(2, 6, 8)
    ones, padded = _all_ones_and_padded()
    cm = compiled(model)
    for mask in (ones, padded, ones):  # eager's program, dynamo's, eager's again
        ref, _ = run_eager(model, (x, mask), {}, torch.bfloat16, grads=False)
        with torch.no_grad(), (torch.autocast("cpu", dtype=torch.bfloat16) if ambient else contextlib.nullcontext()):
            out = cm(x, mask)
        assert_same_outputs(out, ref)
        assert out[1].dtype == torch.bfloat16 if mask is ones else out[1].dtype == torch.float32


def test_a_mask_eager_attention_drops_is_followed_in_training():
    torch.manual_seed(0)
    model, x = AddsAnAllOnesMask().train(), torch.randn(2, 6, 8)
    cm = compiled(model)
    for mask in _all_ones_and_padded():
        ref, ref_grads = run_eager(model, (x, mask), {}, torch.bfloat16, grads=True)
        model.zero_grad(set_to_none=True)
        out = cm(x, mask)
        _loss(out).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert_same_outputs(out, ref)
        assert_same_grads(grads, ref_grads)


def _fails(*args, **kwargs):
    raise RuntimeError("a graph the split cannot handle")


@pytest.mark.parametrize("split, cls, replacement", [
    ("split_dropped_masks", DropsAnAllOnesMask, lambda *a, **k: None),
    ("split_dropped_adds", AddsAnAllOnesMask, lambda *a, **k: None),
    ("split_dropped_adds", AddsAnAllOnesMask, _fails),  # never a crash: dynamo's program, checked
], ids=["sdpa", "add", "add_fails"])
def test_without_the_split_the_dropped_mask_really_differs(monkeypatch, split, cls, replacement):
    import graphamp.backend as backend

    monkeypatch.setattr(backend, split, replacement)
    torch.manual_seed(0)
    model, x = cls().eval(), torch.randn(2, 6, 8)
    ones, _ = _all_ones_and_padded()
    ref, _ = run_eager(model, (x, ones), {}, torch.bfloat16, grads=False)
    with pytest.warns(graphamp.EagerPathWarning, match="differ from eager"), torch.no_grad():
        out = compiled(model)(x, ones)
    assert out[1].dtype != ref[1].dtype if cls is AddsAnAllOnesMask else not torch.equal(out, ref)


def test_only_masks_from_the_inputs_alone_that_are_zero_are_dropped():
    from graphamp.backend.dropped_masks import added_masks, split_dropped_adds

    class Adds(nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = nn.Parameter(torch.zeros(6))  # zero, but a parameter: never a mask

        def forward(self, x, mask):
            bias = (1.0 - mask[:, None, :].float()) * -1e9
            return (x + self.shift) + bias, x + mask[:, None, :].float()  # the second is not zero

    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    ones, padded = _all_ones_and_padded()
    torch.compile(Adds(), backend=capture)(torch.randn(2, 3, 6), ones)
    gm, example = graphs[0]
    assert len(added_masks(gm)) == 2  # the bias and the second mask; not the parameter
    split = split_dropped_adds(gm, example)
    assert [p.kind for p in split.patterns] == ["all"]
    assert sum(1 for n in split.eager_program.graph.nodes if n.op == "call_function" and "add" in str(n.target)) == 2
    assert split.patterns[0].matches(split.masks(*example)[0])
    padded_example = [padded if t is example[-1] or (isinstance(t, torch.Tensor) and t.dtype == torch.long) else t for t in example]
    assert not split.patterns[0].matches(split.masks(*padded_example)[0])
