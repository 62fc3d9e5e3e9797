"""Composite forms of the fused inference kernels that ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` take in eval mode under ``no_grad``.

Dynamo traces those modules' Python, so in inference its graph holds one fused call,
``torch._transformer_encoder_layer_fwd`` or ``torch._native_multi_head_attention``, where
``torch.export`` (which never takes the fast path) holds the module's ordinary ops.

* ``_transformer_encoder_layer_fwd`` is on no autocast list: eager CPU autocast runs it whole
  and autocasts only the kernels it calls inside (attention in the low dtype, then a
  low-precision residual stream), which no per-node policy can express. Under the CPU policy
  graphamp runs it as eager does, under autocast, as one op
  (``graphamp::encoder_layer_under_autocast``, graphamp/runtime_autocast.py; ``convert(inference=True)``
  does the same: graphamp/passes/fuse_encoder_layers.py). Eager CUDA autocast
  never reaches it (the layer checks ``torch.is_autocast_enabled()``, CUDA's flag): under the CUDA
  policy graphamp runs its composite, the ops of the module's ordinary path.
* ``_native_multi_head_attention`` is on the CPU list (lower_precision_fp), so under the CPU policy
  it keeps eager's own decision. Eager CUDA autocast never reaches it (the module checks
  ``torch.is_autocast_enabled()``, CUDA's flag, and takes the ordinary path), so under the CUDA
  policy graphamp runs the composite, as eager does.

Dynamo traces ``nn.MultiheadAttention`` on its ordinary path where eager takes the fused one:
the module turns its fast path off while tracing (``_is_make_fx_tracing``), and marks the
output it returns then (a copy to contiguous, ``fast_path_blocked_by_tracing``).
:func:`follow_fused_attention` puts eager's fused call back there, under the CPU policy.

Each composite takes the fused op's arguments and computes what the module's ordinary path
computes in eval mode (dropout is the identity there).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import GraphModule, Node

from graphamp.policy import Policy

__all__ = [
    "composite_for", "follow_fused_attention", "fused_self_attention", "native_multi_head_attention", "runs_under_autocast",
    "transformer_encoder_layer",
]

_ENCODER_LAYER = (torch._transformer_encoder_layer_fwd, torch.ops.aten._transformer_encoder_layer_fwd.default)
_MHA = (torch._native_multi_head_attention, torch.ops.aten._native_multi_head_attention.default)


def _split_mask(mask: Tensor | None, mask_type: int | None, seq_len: int) -> tuple[Tensor | None, Tensor | None]:
    """(attn_mask, key_padding_mask) for the ordinary path, from ``merge_masks``'s merged mask.

    Type 1 is the key padding mask alone; type 2 is the (batch, heads, L, L) sum of both, which
    the ordinary path also forms (attn_mask + key_padding_mask) before attending.
    """
    if mask is None or mask_type is None:
        return None, None
    if mask_type == 0:
        return mask, None
    if mask_type == 1:
        return None, mask
    return mask.reshape(-1, seq_len, mask.shape[-1]), None


def native_multi_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim: int,
    num_head: int,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    proj_weight: Tensor,
    proj_bias: Tensor,
    mask: Tensor | None = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``nn.MultiheadAttention``'s ordinary path (batch_first, eval) for the fused op's arguments.

    >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    >>> x = torch.randn(2, 3, 8)
    >>> out, w = native_multi_head_attention(x, x, x, 8, 2, mha.in_proj_weight, mha.in_proj_bias,
    ...                                      mha.out_proj.weight, mha.out_proj.bias)
    >>> ref, ref_w = mha(x, x, x)
    >>> assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(w, ref_w, atol=1e-6)
    """
    # The ordinary path transposes to (L, B, E) and keeps the identities of shared inputs, which
    # decide whether the input projection runs as one packed linear. The copy to contiguous
    # changes no value: it lets the projection run as one matmul where a transposed view would
    # be batched over L with a broadcast weight (which inductor materializes, L times).
    if key is value:
        if query is key:
            query = key = value = query.transpose(1, 0).contiguous()
        else:
            query, key = (t.transpose(1, 0).contiguous() for t in (query, key))
            value = key
    else:
        query, key, value = (t.transpose(1, 0).contiguous() for t in (query, key, value))
    attn_mask, key_padding_mask = _split_mask(mask, mask_type, query.shape[0])
    out, weights = F.multi_head_attention_forward(
        query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, None, None, False, 0.0,
        proj_weight, proj_bias, training=False, key_padding_mask=key_padding_mask,
        need_weights=need_weights, attn_mask=attn_mask, average_attn_weights=average_attn_weights,
    )
    return out.transpose(1, 0), weights


def transformer_encoder_layer(
    src: Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    proj_weight: Tensor,
    proj_bias: Tensor,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1: Tensor,
    norm_bias_1: Tensor,
    norm_weight_2: Tensor,
    norm_bias_2: Tensor,
    ffn_weight_1: Tensor,
    ffn_bias_1: Tensor,
    ffn_weight_2: Tensor,
    ffn_bias_2: Tensor,
    mask: Tensor | None = None,
    mask_type: int | None = None,
) -> Tensor:
    """``nn.TransformerEncoderLayer``'s ordinary path (batch_first, eval) for the fused op's arguments.

    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    >>> x = torch.randn(2, 3, 8)
    >>> a, n1, n2 = layer.self_attn, layer.norm1, layer.norm2
    >>> out = transformer_encoder_layer(x, 8, 2, a.in_proj_weight, a.in_proj_bias, a.out_proj.weight,
    ...     a.out_proj.bias, False, False, n1.eps, n1.weight, n1.bias, n2.weight, n2.bias,
    ...     layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
    >>> assert torch.allclose(out, layer(x), atol=1e-5)
    """

    def attend(x: Tensor) -> Tensor:
        return native_multi_head_attention(
            x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
            mask, need_weights=False, mask_type=mask_type,
        )[0]

    def feed_forward(x: Tensor) -> Tensor:
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        h = F.gelu(h) if use_gelu else F.relu(h)
        return F.linear(h, ffn_weight_2, ffn_bias_2)

    def norm(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return F.layer_norm(x, (embed_dim,), weight, bias, eps)

    x = src
    if norm_first:
        x = x + attend(norm(x, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(x + attend(x), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


def composite_for(target: object, policy: Policy) -> Callable | None:
    """The composite to run in place of the fused call ``target`` under ``policy``, or None to keep it
    (:func:`runs_under_autocast` says how).

    >>> from graphamp.policy import get_policy
    >>> assert composite_for(torch._transformer_encoder_layer_fwd, get_policy("cuda", torch.float16)) is transformer_encoder_layer
    >>> assert composite_for(torch._transformer_encoder_layer_fwd, get_policy("cpu", torch.bfloat16)) is None
    >>> assert composite_for(torch._native_multi_head_attention, get_policy("cpu", torch.bfloat16)) is None
    """
    if target in _ENCODER_LAYER and not runs_under_autocast(target, policy):
        return transformer_encoder_layer
    if target in _MHA and policy.category("_native_multi_head_attention") is None:
        return native_multi_head_attention
    return None


def runs_under_autocast(target: object, policy: Policy) -> bool:
    """Whether the fused call ``target`` runs whole under ``policy``'s autocast, as eager runs it:
    the encoder layer under the CPU policy."""
    return target in _ENCODER_LAYER and policy.device_type == "cpu"


def fused_self_attention(
    x: Tensor, embed_dim: int, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor, proj_weight: Tensor,
    proj_bias: Tensor, key_padding_mask: Tensor | None, need_weights: bool, attn_mask: Tensor | None,
    average_attn_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """``nn.MultiheadAttention``'s fast path for batch-first self-attention on ``x`` (the masks as
    the module canonicalizes them, merged as its ``merge_masks`` does), returned as the ordinary
    path returns it (sequence first; no weights unless asked for).

    >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    >>> x = torch.randn(2, 3, 8)
    >>> with torch.no_grad():
    ...     out, _ = fused_self_attention(x, 8, 2, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias, None, False, None, True)
    ...     assert torch.equal(out.transpose(1, 0), mha(x, x, x, need_weights=False)[0])
    """
    mask, mask_type = key_padding_mask, None if key_padding_mask is None else 1
    if attn_mask is not None:
        batch, seq = x.shape[0], x.shape[1]
        mask_type = 2
        if attn_mask.dim() == 3:
            mask = attn_mask.view(batch, -1, seq, seq)
        else:
            mask = attn_mask.view(1, 1, seq, seq).expand(batch, num_heads, -1, -1)
        if key_padding_mask is not None:
            mask = mask + key_padding_mask.view(batch, 1, 1, seq).expand(-1, num_heads, -1, -1)
    out, weights = torch._native_multi_head_attention(
        x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, need_weights,
        average_attn_weights, mask_type,
    )
    return out.transpose(1, 0), weights if need_weights else None


def follow_fused_attention(gm: GraphModule) -> bool:
    """Call eager's fused attention where dynamo's graph holds the ordinary path that
    ``nn.MultiheadAttention`` took only because it was traced (module docstring); returns whether
    it changed the graph."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=F.multi_head_attention_forward)):
        x = _blocked_self_attention(node)
        if x is None:
            continue
        a, kw = node.args, node.kwargs
        node.target = fused_self_attention
        node.args = (
            x, a[3], a[4], a[5], a[6], a[11], a[12], kw.get("key_padding_mask"), kw.get("need_weights", True),
            kw.get("attn_mask"), kw.get("average_attn_weights", True),
        )
        node.kwargs = {}
        changed = True
    if changed:
        gm.recompile()
    return changed


def _blocked_self_attention(node: Node) -> Node | None:
    """The batch-first input of an ``F.multi_head_attention_forward`` call that
    ``nn.MultiheadAttention`` made with its fast path blocked only by tracing (so self-attention,
    any masks bool); else None."""
    args, kwargs = node.args, node.kwargs
    if len(args) != 13 or set(kwargs) - {"training", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal"}:
        return None  # separate projection weights
    query = args[0]
    if not (isinstance(query, Node) and args[1] is query and args[2] is query):
        return None
    if not (query.op == "call_method" and query.target == "transpose" and tuple(query.args[1:]) == (1, 0)):
        return None
    first = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    back = [u for f in first for u in f.users if u.op == "call_method" and u.target == "transpose" and tuple(u.args[1:]) == (1, 0)]
    if len(back) != 1 or not any(u.op == "call_method" and u.target == "contiguous" for u in back[0].users):
        return None  # no mark of a fast path blocked by tracing
    return query.args[0]
