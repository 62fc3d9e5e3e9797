"""Run each eval ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` as eager autocast does
under ``no_grad``: through its fused kernel.

In eval mode under ``no_grad``, ``nn.TransformerEncoderLayer.forward`` calls
``torch._transformer_encoder_layer_fwd``, which is on no autocast list: CPU autocast lets it run
and casts only the kernels it calls inside (attention in the low dtype, then a low-precision
residual stream; see graphamp/backend/fast_paths.py). ``torch.export`` never takes that path, so
the captured graph holds the layer's ordinary ops, whose policy is eager's *with* grad: numerically
different and, op by op, slower. For ``convert(inference=True)`` (which runs under ``no_grad``)
this pass replaces each such layer's ops by the fused call under the layer's autocast state
(:func:`graphamp.runtime.autocast_op`), so outputs are bitwise eager's and the kernel is eager's.

A layer is replaced only where eager takes the fused path: eval (no dropout that trains),
``batch_first``, one packed input projection, relu or gelu, no mask but a key padding mask (bool,
or the float one ``nn.TransformerEncoder`` hands its layers; a batch equal to the sequence length
is left alone, as it could be a square attention mask), an even head count, and the
CPU policy (CUDA autocast turns the path off: the module checks ``torch.is_autocast_enabled()``).
Anything else keeps the ordinary ops.

An ``nn.MultiheadAttention`` outside such a layer takes ``torch._native_multi_head_attention`` in
the same conditions (self-attention; no mask but a bool ``key_padding_mask``, which it takes as
0/-inf; here only where nothing reads the attention weights). That op is on CPU autocast's
lower-precision list, so it needs no autocast region: it replaces the module's ops as an ordinary
node, and insert_casts casts its inputs as eager autocast does.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.passes.graph_edit import attr_of, carried_meta, fake_mode_of, next_node, recompute_val
from graphamp.node_info import graph_info
from graphamp.policy import Category, op_key
from graphamp.runtime import FUSED_ENCODER_LAYER, autocast_op, fused_layer_dtype

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["fuse_encoder_layers", "fused_value", "opaque_fused_layers"]

aten = torch.ops.aten
FUSED = FUSED_ENCODER_LAYER
MHA = aten._native_multi_head_attention.default
_LAYER = "TransformerEncoderLayer"
_ATTENTION = "MultiheadAttention"
_PARAMS = (
    "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias",
    "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
    "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
)


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _layer_path(node: Node, kind: str = _LAYER) -> str | None:
    """The outermost module of type ``kind`` on the node's module stack (None inside an encoder
    layer when looking for attention: the layer is fused whole)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, type_ in stack.values():
        name = (type_ if isinstance(type_, str) else f"{type_.__module__}.{type_.__qualname__}").rsplit(".", 1)[-1]
        if name == _LAYER and kind != _LAYER:
            return None
        if name == kind:
            return path
    return None


def _join(path: str, name: str) -> str:
    """A parameter's target under the module at ``path`` ("" for the root: the model is the layer)."""
    return f"{path}.{name}" if path else name


def _regions(gm: GraphModule, kind: str = _LAYER) -> dict[str, list[Node]]:
    regions: dict[str, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            path = _layer_path(node, kind)
            if path is not None:
                regions.setdefault(path, []).append(node)
    return regions


def _fused_args(gm: GraphModule, path: str, nodes: list[Node]) -> tuple[Node, Node, tuple, Node | None] | None:
    """(layer input, layer output, the fused op's arguments after ``src`` with no mask, the
    ``src_key_padding_mask`` (bool or float) or None), or None where eager would not take the fused
    path or the region is not one layer call."""
    inside = set(nodes)
    params = {n.target: n for n in gm.graph.find_nodes(op="get_attr")}
    weights = [params.get(_join(path, name)) for name in _PARAMS]
    if any(w is None for w in weights):
        return None  # separate q/k/v projections, no biases, ...: eager's fast path needs them all
    # Size arithmetic (SymInts) is shared between layers; only tensors cross a layer's boundary.
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    tensors = [a for a in inputs if a.op != "get_attr" and _is_tensor(a)]
    masks = _padding_masks(tensors, floats=True)
    tensors = [a for a in tensors if a not in masks]
    outputs = [n for n in nodes if _is_tensor(n) and any(u not in inside for u in n.users)]
    if len(tensors) != 1 or len(masks) > 1 or len(outputs) != 1 or any(a.op == "get_attr" and a not in weights for a in inputs):
        return None  # other masks, or more than one layer call under one path
    src = tensors[0]
    val = src.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 3 or not val.is_floating_point() or val.dtype is torch.float64:
        return None
    if masks and not _padding_shaped(masks[0], val):
        return None
    targets = {n.target for n in nodes}
    if any(n.target is aten.dropout.default and n.args[2] for n in nodes):
        return None  # training-mode dropout: eager runs the ordinary path
    sdpa = [n for n in nodes if n.target is aten.scaled_dot_product_attention.default]
    norms = [n for n in nodes if n.target is aten.layer_norm.default]
    if len(sdpa) != 1 or len(norms) != 2 or ({aten.relu.default, aten.gelu.default} & targets) == set():
        return None
    heads = sdpa[0].meta["val"].shape[1]
    eps = norms[0].args[4] if len(norms[0].args) > 4 else 1e-5
    eps2 = norms[1].args[4] if len(norms[1].args) > 4 else 1e-5
    if not isinstance(heads, int) or heads % 2 or eps != eps2:
        return None
    use_gelu = aten.gelu.default in targets
    if use_gelu and any(n.target is aten.gelu.default and n.kwargs.get("approximate", "none") != "none" for n in nodes):
        return None
    norm_first = norms[0].args[0] is src
    embed_dim = attr_of(gm, _join(path, "self_attn.in_proj_weight")).shape[1]
    w = weights
    args = (embed_dim, heads, w[0], w[1], w[2], w[3], use_gelu, norm_first, eps, w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11], None, None)
    return src, outputs[0], args, masks[0] if masks else None


def _padding_masks(tensors: list[Node], *, floats: bool = False) -> list[Node]:
    """The bool (batch, seq) inputs among ``tensors`` (with ``floats``, float ones too: an encoder
    layer keeps its fast path with the float mask ``nn.TransformerEncoder`` hands it, attention does not)."""
    return [a for a in tensors if a.meta["val"].dim() == 2 and (a.meta["val"].dtype is torch.bool or floats and a.meta["val"].is_floating_point())]


def _padding_shaped(mask: Node, src: torch.Tensor) -> bool:
    """Whether ``mask`` is (batch, seq) of a batch-first ``src``, and cannot be a (seq, seq)
    attention mask: one whose batch is its length is left to the ordinary ops."""
    batch, seq = src.shape[0], src.shape[1]
    return tuple(mask.meta["val"].shape) == (batch, seq) and batch != seq


def _canonical_mask(gm: GraphModule, mask: Node, like: Node, after: Node, reason: str) -> Node:
    """``mask`` as the fast paths take it (``F._canonical_mask``): 0, or -inf where padded, in
    ``like``'s dtype; inserted after ``after``."""
    fake_mode = fake_mode_of(gm)
    with gm.graph.inserting_after(after):
        zeros = gm.graph.call_function(aten.zeros_like.default, (mask,), {"dtype": like.meta["val"].dtype})
    with gm.graph.inserting_after(zeros):
        filled = gm.graph.call_function(aten.masked_fill.Scalar, (zeros, mask, float("-inf")))
    for node in (zeros, filled):
        node.meta.update(carried_meta(after, reason=reason))
        node.meta["val"] = recompute_val(node, fake_mode)
    return filled


def _attention_args(gm: GraphModule, path: str, nodes: list[Node]) -> tuple[Node, Node, tuple, Node | None, bool] | None:
    """(input, output, the fused op's arguments after query, key, value, the bool key padding mask
    or None, need_weights) for a self-attention ``nn.MultiheadAttention`` call whose attention
    weights nothing reads, or None."""
    inside = set(nodes)
    params = {n.target: n for n in gm.graph.find_nodes(op="get_attr")}
    weights = [params.get(_join(path, name.removeprefix("self_attn."))) for name in _PARAMS[:4]]
    if any(w is None for w in weights):
        return None
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    tensors = [a for a in inputs if a.op != "get_attr" and _is_tensor(a)]
    masks = _padding_masks(tensors)
    tensors = [a for a in tensors if a not in masks]
    outputs = [n for n in nodes if _is_tensor(n) and any(u not in inside for u in n.users)]
    if len(tensors) != 1 or len(masks) > 1 or len(outputs) != 1 or any(a.op == "get_attr" and a not in weights for a in inputs):
        return None  # cross-attention, other masks, or attention weights returned
    src = tensors[0]
    val = src.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 3 or val.dtype is not torch.float32:
        return None
    if masks and not _padding_shaped(masks[0], val):
        return None
    if any(n.target is aten.dropout.default and n.args[2] for n in nodes):
        return None
    sdpa = [n for n in nodes if n.target is aten.scaled_dot_product_attention.default]
    softmax = [n for n in nodes if n.target is aten.softmax.int]
    if len(sdpa) == 1 and not sdpa[0].args[3 + bool(masks):] and not sdpa[0].kwargs:
        heads, need_weights = sdpa[0].meta["val"].shape[1], False
    elif not sdpa and len(softmax) == 1:  # need_weights=True (the default), the weights unused: eager's kernel computes them
        heads, need_weights = softmax[0].meta["val"].shape[0] // val.shape[0], True
    else:
        return None  # another mask or a causal flag
    if not isinstance(heads, int) or heads % 2:
        return None
    embed_dim = attr_of(gm, weights[0].target).shape[1]
    return src, outputs[0], (embed_dim, heads, *weights), masks[0] if masks else None, need_weights


def _fuse_attention(gm: GraphModule) -> bool:
    modified = False
    fake_mode = fake_mode_of(gm)
    for path, nodes in _regions(gm, _ATTENTION).items():
        found = _attention_args(gm, path, nodes)
        if found is None:
            continue
        src, out, args, mask, need_weights = found
        last = out
        if mask is not None:
            last = mask = _canonical_mask(gm, mask, src, out, f"{path}: the key padding mask, as eager's fused attention takes it")
        with gm.graph.inserting_after(last):
            # average_attn_weights: MultiheadAttention's default; it shapes only the weights, which nothing reads.
            fused = gm.graph.call_function(MHA, (src, src, src, *args, mask, need_weights, True, None if mask is None else 1))
        with gm.graph.inserting_after(fused):
            first = gm.graph.call_function(operator.getitem, (fused, 0))
        for node in (fused, first):
            node.meta.update(carried_meta(out, eager_kernel="_native_multi_head_attention", reason=f"{path}: eager's fused attention under no_grad"))
        try:
            fused.meta["val"] = recompute_val(fused, fake_mode)
        except Exception:  # no fake kernel: leave the module's ordinary ops
            for node in (first, fused, *((mask, mask.args[0]) if last is not out else ())):
                gm.graph.erase_node(node)
            continue
        first.meta["val"] = fused.meta["val"][0]
        out.replace_all_uses_with(first)
        for node in reversed(nodes):
            if not node.users:
                gm.graph.erase_node(node)
        modified = True
    return modified


def fuse_encoder_layers(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Replace each eval TransformerEncoderLayer's ops by eager's fused kernel under autocast."""
    # An AmpModule only: the torch.compile backend maps the fused op itself (backend/fast_paths.py),
    # and an exported program holds no graphamp call.
    if spec.target != "module" or spec.device_type != "cpu" or not torch.backends.mha.get_fastpath_enabled():
        return PassResult(gm, False)
    if not (spec.inference or spec.no_grad):
        # A graph kept for grad: eager's program is this one with grad; without grad it would be the
        # fused one, which the AmpModule converts on its first call without grad (AmpSpec.no_grad).
        fused = any(_fused_args(gm, p, n) is not None for p, n in _regions(gm).items()) or any(
            _attention_args(gm, p, n) for p, n in _regions(gm, _ATTENTION).items()
        )
        graph_info(gm).fused_without_grad = fused
        return PassResult(gm, False)
    modified = False
    # A config (or budget plan) listing the fused op fp32 runs it with autocast off: eager fp32's program.
    raised = spec.config.all_overrides.get(op_key(FUSED)) is Category.FP32
    for path, nodes in _regions(gm).items():
        found = _fused_args(gm, path, nodes)
        if found is None:
            continue
        src, out, args, mask = found
        last = out
        if mask is not None:  # merge_masks: a key padding mask alone is mask type 1; a float one is taken as it is
            if mask.meta["val"].dtype is torch.bool:
                last = _canonical_mask(gm, mask, src, out, f"{path}: the key padding mask, as eager's fused layer takes it")
            args = (*args[:-2], last if last is not out else mask, 1)
        with gm.graph.inserting_after(last):
            if raised:
                fused = gm.graph.call_function(FUSED, (src, *args))
            else:
                fused = gm.graph.call_function(autocast_op, (FUSED, spec.device_type, spec.dtype, src, *args))
        dtype = _fused_dtype(gm, src.meta["val"], args, None if raised else (spec.device_type, spec.dtype))
        how = "with autocast off, as the config lists it fp32" if raised else "under autocast as eager runs it"
        fused.meta.update(carried_meta(
            out, category=None, dtype=dtype,
            reason=f"{path}: eager's fused _transformer_encoder_layer_fwd under no_grad, run {how}",
            eager_kernel="_transformer_encoder_layer_fwd",
        ))
        fake_mode = fake_mode_of(gm)
        with fake_mode:
            fused.meta["val"] = torch.empty_like(out.meta["val"], dtype=dtype)
        out.replace_all_uses_with(fused)
        for node in reversed(nodes):
            if not node.users:
                gm.graph.erase_node(node)
        _refresh_after(fused, fake_mode)
        modified = True
    modified |= _fuse_attention(gm)
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def _fused_dtype(gm: GraphModule, src: torch.Tensor, args: tuple, autocast: tuple[str, torch.dtype] | None) -> torch.dtype:
    """The fused kernel's output dtype on an input like ``src`` (with ``autocast``: (device type,
    dtype) on), for the graph's arguments ``args`` after ``src`` (:func:`fused_layer_dtype`)."""
    return fused_layer_dtype(src, [attr_of(gm, a.target) if isinstance(a, Node) else a for a in args[:-2]] + [None, None], autocast)


def opaque_fused_layers(graph: torch.fx.Graph) -> None:
    """Make each fused layer run under autocast one op (``graphamp::encoder_layer_under_autocast``)
    for a program torch.compile compiles: traced through, ``autocast_op``'s kernel would be recorded
    without the autocast it runs under, and run in fp32."""
    for node in graph.find_nodes(op="call_function", target=autocast_op):
        op, device_type, dtype, *args = node.args
        if op is FUSED:
            node.target, node.args = torch.ops.graphamp.encoder_layer_under_autocast.default, (*args, device_type, dtype)


def fused_value(node: Node, fake_mode: torch._subclasses.fake_tensor.FakeTensorMode) -> torch.Tensor:
    """``meta["val"]`` of a fused layer run under autocast (``autocast_op(FUSED, ...)``) after its
    input changed dtype (autotune raised the layer before it): the shape from fake propagation,
    the dtype from eager's kernel (:func:`fused_layer_dtype`)."""
    val = recompute_val(node, fake_mode)
    _, device_type, dtype, src, *args = node.args
    out = fused_layer_dtype(src.meta["val"], [a.meta["val"] if isinstance(a, Node) else a for a in args[:-2]] + [None, None], (device_type, dtype))
    with fake_mode:
        return torch.empty_like(val, dtype=out)


def _refresh_after(node: Node, fake_mode: torch._subclasses.fake_tensor.FakeTensorMode) -> None:
    """Re-derive the values of the ATen ops after ``node``: its output dtype may differ from the
    ordinary path's (insert_casts, which runs next, decides their casts from these values)."""
    current = next_node(node)
    while current is not None:
        if current.op == "call_function" and (isinstance(current.target, torch._ops.OpOverload) or current.target.__name__ == "getitem"):
            current.meta["val"] = recompute_val(current, fake_mode)
        current = next_node(current)
