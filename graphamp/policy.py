"""Autocast op lists as frozen data, per device and lower-precision dtype.

The lists mirror ``aten/src/ATen/autocast_mode.cpp`` of torch 2.13 (``TORCH_LIBRARY_IMPL(aten,
AutocastCPU, m)`` and the ``AT_FORALL_*`` macros used for AutocastCUDA). Keys are ATen overload
names without the namespace: ``schema.name`` plus ``"." + overload_name`` unless the overload is
the default one (``"linear"``, ``"softmax.int"``, ``"conv2d.padding"``). ``tests/test_policy_drift.py``
checks every entry against the installed torch, in both directions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = [
    "DTYPE_ALIASES", "resolve_dtype",
    "Category",
    "Policy",
    "DEVICE_TYPES",
    "LOW_DTYPES",
    "get_policy",
    "lstm_uses_onednn",
    "is_eligible",
    "op_key",
    "promote_dtype",
    "short_dtype",
]


class Category(str, enum.Enum):
    """The cast policies of ``autocast_mode.h`` (``CastPolicy``), plus the banned list."""

    __module__ = "graphamp"  # its public path, which saved modules with op overrides name

    LOWER_PRECISION_FP = "lower_precision_fp"  # cast every eligible tensor argument to the low dtype
    FP32 = "fp32"  # cast every eligible tensor argument to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # if arg 0 is eligible and dtype is None, pass dtype=float32
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the dtype-taking overload with dtype=float32
    PROMOTE = "promote"  # cast eligible arguments to the widest eligible dtype (fp32 wins)
    BANNED = "banned"  # raises under autocast


DEVICE_TYPES = ("cpu", "cuda")
LOW_DTYPES = (torch.bfloat16, torch.float16)
DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, device_type: str) -> torch.dtype:
    """The lower-precision dtype to use; None means autocast's default for ``device_type``.

    >>> assert resolve_dtype("fp16", "cpu") is torch.float16 and resolve_dtype(None, "cpu") is torch.bfloat16
    """
    if dtype is None:
        return torch.get_autocast_dtype(device_type)
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPE_ALIASES:
            raise ValueError(f"dtype={dtype!r} is not a lower-precision float; use torch.bfloat16 ('bf16') or torch.float16 ('fp16')")
        return DTYPE_ALIASES[dtype.removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {type(dtype).__name__}")
    if dtype not in LOW_DTYPES:
        kind = "a floating" if dtype.is_floating_point else "not a floating"
        raise ValueError(
            f"dtype={dtype} is {kind} dtype autocast can lower to; use torch.bfloat16 or torch.float16"
        )
    return dtype


_L, _F, _S, _A, _P, _B = (
    Category.LOWER_PRECISION_FP,
    Category.FP32,
    Category.FP32_SET_OPT_DTYPE,
    Category.FP32_APPEND_DTYPE,
    Category.PROMOTE,
    Category.BANNED,
)

# AT_FORALL_LOWER_PRECISION_FP plus the cudnn extras registered in autocast_mode.cpp.
_CUDA_LOWER_PRECISION_FP = frozenset({
    "_convolution", "_convolution.deprecated", "_scaled_dot_product_flash_attention",
    "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm",
    "bmm", "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "einsum", "gru_cell", "linalg_multi_dot", "linalg_vecdot",
    "linear", "lstm_cell", "matmul", "mm", "mv", "prelu", "rnn_relu_cell", "rnn_tanh_cell",
    "scaled_dot_product_attention",
})
_CUDA_FP32 = frozenset({
    "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "acos", "asin",
    "binary_cross_entropy_with_logits", "cdist", "cosh", "cosine_embedding_loss",
    "cosine_similarity", "dist", "erfinv", "exp", "expm1", "frobenius_norm.dim", "group_norm",
    "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "layer_norm", "log", "log10",
    "log1p", "log2", "logsumexp", "margin_ranking_loss", "mse_loss", "multi_margin_loss",
    "multilabel_margin_loss", "native_layer_norm", "nll_loss", "nll_loss2d", "nuclear_norm",
    "nuclear_norm.dim", "pdist", "poisson_nll_loss", "pow.Scalar", "pow.Tensor_Scalar",
    "pow.Tensor_Tensor", "reciprocal", "renorm", "rms_norm", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softplus", "tan", "triplet_margin_loss", "upsample_bicubic2d",
    "upsample_bilinear2d", "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "upsample_trilinear3d",
})
_CUDA_FP32_SET_OPT_DTYPE = frozenset({
    "cumprod", "cumsum", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "linalg_vector_norm",
    "log_softmax.int", "prod", "prod.dim_int", "softmax.int", "sum", "sum.dim_IntList",
})
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the overload without dtype -> the one with it.
_CUDA_FP32_APPEND_DTYPE = frozenset({"norm.Scalar", "norm.ScalarOpt_dim"})
_CUDA_PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
    "scatter_add", "tensordot", "vdot",
})
_CUDA_BANNED = frozenset({"binary_cross_entropy"})

# The hand-written TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) block.
_CPU_LOWER_PRECISION_FP = frozenset({
    "_addmm_activation", "_convolution.deprecated", "_native_multi_head_attention", "addbmm",
    "addmm", "baddbmm", "bmm", "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d",
    "conv3d.padding", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "linalg_vecdot", "linear", "matmul", "mkldnn_rnn_layer", "mm",
    "prelu", "scaled_dot_product_attention",
})
_CPU_FP32 = frozenset({
    "_grid_sampler_2d_cpu_fallback", "_lu_with_info", "adaptive_avg_pool3d", "adaptive_max_pool3d",
    "avg_pool3d", "binary_cross_entropy", "binary_cross_entropy_with_logits", "cdist", "cholesky",
    "cholesky_inverse", "cholesky_solve", "cosine_embedding_loss", "cross_entropy_loss",
    "ctc_loss.IntList", "ctc_loss.Tensor", "fake_quantize_per_tensor_affine", "fft_fft", "fft_fft2",
    "fft_fftn", "fft_hfft", "fft_ifft", "fft_ifft2", "fft_ifftn", "fft_ihfft", "fft_irfft",
    "fft_irfft2", "fft_irfftn", "fft_rfft", "fft_rfft2", "fft_rfftn", "fractional_max_pool2d",
    "fractional_max_pool3d", "geqrf", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
    "hinge_embedding_loss", "huber_loss", "inverse", "kl_div", "l1_loss", "linalg_cholesky",
    "linalg_cholesky_ex", "linalg_cond", "linalg_cond.p_str", "linalg_eig", "linalg_eigh",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_householder_product", "linalg_inv",
    "linalg_inv_ex", "linalg_lstsq", "linalg_matrix_rank", "linalg_matrix_rank.atol_rtol_float",
    "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.tol_tensor", "linalg_qr",
    "linalg_solve", "linalg_svd", "linalg_svdvals", "linalg_tensorinv", "linalg_tensorsolve",
    "lu_solve", "margin_ranking_loss", "max_pool3d", "max_unpool2d", "max_unpool3d", "mse_loss",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_margin_loss_forward",
    "nanquantile", "nanquantile.scalar", "nll_loss", "nll_loss2d", "orgqr", "ormqr", "pinverse",
    "poisson_nll_loss", "polar", "prod", "prod.dim_int", "qr", "quantile", "quantile.scalar",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "smooth_l1_loss", "soft_margin_loss", "stft", "stft.center", "svd",
    "trace", "triangular_solve", "triplet_margin_loss", "view_as_complex",
})
_CPU_PROMOTE = frozenset({"cat", "index_copy", "stack"})


def _table(*groups: tuple[frozenset[str], Category]) -> Mapping[str, Category]:
    table: dict[str, Category] = {}
    for names, category in groups:
        for name in names:
            assert name not in table, f"{name} is listed twice"
            table[name] = category
    return MappingProxyType(table)


_REGISTERED = {
    "cpu": _table((_CPU_LOWER_PRECISION_FP, _L), (_CPU_FP32, _F), (_CPU_PROMOTE, _P)),
    "cuda": _table(
        (_CUDA_LOWER_PRECISION_FP, _L), (_CUDA_FP32, _F), (_CUDA_FP32_SET_OPT_DTYPE, _S),
        (_CUDA_FP32_APPEND_DTYPE, _A), (_CUDA_PROMOTE, _P), (_CUDA_BANNED, _B),
    ),
}

# Ops autocast does not register that are CompositeImplicitAutograd and decompose, with autocast
# still on, into listed ops; eager autocast therefore behaves as if they had this category.
# graphamp reproduces them exactly by decomposing such nodes (passes/insert_casts.py); this table
# names the known ones so they can be inspected and checked against eager.
_EFFECTIVE = {
    "cpu": _table(
        (frozenset({"einsum", "tensordot", "chain_matmul", "linalg_multi_dot", "rnn_tanh_cell",
                    "rnn_relu_cell"}), _L),
    ),
    "cuda": _table(
        (frozenset({"conv1d.padding", "conv2d.padding", "conv3d.padding"}), _L),
        (frozenset({"cross_entropy_loss", "upsample_nearest2d.vec", "upsample_bilinear2d.vec"}), _F),
    ),
}

# Unregistered RNN composites graphamp runs whole, as if listed, instead of decomposing them: their
# decompositions unroll over time and pick kernels at run time, and for these the whole op on
# inputs pre-cast to the low dtype is bitwise what eager's decomposition gives (its listed children
# cast the same values and nothing in between promotes). rnn_tanh/rnn_relu always qualify;
# nn.LSTM only where oneDNN runs it (bf16 with oneDNN on), since its native path promotes the
# gates with an fp32 state. GRU's native path promotes likewise, so it is decomposed.
# graphamp.convert goes further for nn.LSTM: it decomposes it along oneDNN's own kernel path (see
# lstm_uses_onednn), which is exact for fp32 inputs and bidirectional layers too; the run-whole
# entry serves the torch.compile backend, whose AOTAutograd cannot trace that kernel's backward.
_OPAQUE_RNN = frozenset({"rnn_tanh.input", "rnn_tanh.data", "rnn_relu.input", "rnn_relu.data"})


def _opaque(device_type: str, dtype: torch.dtype) -> Mapping[str, Category]:
    if device_type != "cpu":
        return MappingProxyType({})
    names = set(_OPAQUE_RNN)
    if dtype is torch.bfloat16 and _onednn_runs_bf16_lstm():
        names.add("lstm.input")
    return _table((frozenset(names), _L))


def _onednn_runs_bf16_lstm() -> bool:
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def lstm_uses_onednn(input_dtype: torch.dtype, *, projections: bool, grad_enabled: bool) -> bool:
    """Whether eager CPU ``aten::lstm`` runs oneDNN for this input (``use_mkldnn`` in RNN.cpp).

    There it calls ``mkldnn_rnn_layer`` once per layer and direction, an op on the CPU
    lower_precision_fp list, so autocast casts the input once per call; elsewhere it runs native
    cells whose gates promote with the fp32 state. Both are read from torch's switches now.

    >>> on = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    >>> assert lstm_uses_onednn(torch.float32, projections=False, grad_enabled=True) == on
    >>> assert not lstm_uses_onednn(torch.float64, projections=False, grad_enabled=True)
    """
    mkldnn = torch.backends.mkldnn
    if projections or not (mkldnn.is_available() and mkldnn.enabled):
        return False
    if input_dtype is torch.float32:
        return True
    if input_dtype is torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if input_dtype is torch.float16:
        return not grad_enabled and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


# Redispatch targets of fp32_append_dtype ops (autocast_mode.cpp, KERNEL_DIFFERENT_REDISPATCH_SIGNATURE).
APPEND_DTYPE_TARGETS = MappingProxyType({
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
})


def short_dtype(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bf16"``, as reports and cast names spell dtypes."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(dtype, str(dtype))


def is_eligible(val: object, device_type: str) -> bool:
    """autocast_mode.h ``is_eligible``: a floating tensor, not float64, on the autocast device.

    >>> assert is_eligible(torch.zeros(1), "cpu") and not is_eligible(torch.zeros(1).double(), "cpu")
    """
    return (
        isinstance(val, torch.Tensor)
        and val.device.type == device_type
        and val.is_floating_point()
        and val.dtype is not torch.float64
    )


def promote_dtype(dtypes: Iterable[torch.dtype], low: torch.dtype) -> torch.dtype | None:
    """autocast's promote rule over the floating input dtypes on the device (``prioritize`` in
    autocast_mode.h): float64 is ignored, float32 wins over the low dtype; None where two
    different low dtypes meet, which eager autocast rejects.

    >>> assert promote_dtype([torch.bfloat16, torch.float32], torch.bfloat16) is torch.float32
    >>> assert promote_dtype([torch.float16, torch.bfloat16], torch.bfloat16) is None
    """
    current = low
    for dtype in dtypes:
        if dtype is torch.float64:
            continue
        if current is torch.float32 or dtype is torch.float32:
            current = torch.float32
        elif not (current is low and dtype is low):
            return None
    return current


def op_key(op: torch._ops.OpOverload) -> str:
    """The table key of an ATen overload: ``aten::softmax.int`` -> ``"softmax.int"``."""
    name = op._schema.name.split("::", 1)[-1]
    overload = op._schema.overload_name
    return f"{name}.{overload}" if overload else name


@dataclass(frozen=True)
class Policy:
    """One autocast policy: a device type, its lower-precision dtype, and the op lists.

    >>> p = get_policy("cpu", torch.bfloat16)
    >>> assert p.category("linear") is Category.LOWER_PRECISION_FP and p.category("add.Tensor") is None
    """

    device_type: str
    dtype: torch.dtype
    # Registered autocast ops -> category (the lists of autocast_mode.cpp).
    ops: Mapping[str, Category] = field(repr=False)
    # Unregistered composites that behave as a category under eager autocast; graphamp reaches
    # the same result by decomposing them (informative, checked against eager by the tests).
    effective: Mapping[str, Category] = field(repr=False)
    # Unregistered composites graphamp treats as listed, without decomposing them.
    opaque: Mapping[str, Category] = field(repr=False, default_factory=dict)

    def category(self, key: str) -> Category | None:
        found = self.ops.get(key)
        return found if found is not None else self.opaque.get(key)

    def with_overrides(self, overrides: Mapping[str, Category | None]) -> Policy:
        """A copy whose op lists have ``overrides`` applied (``None`` removes an op)."""
        if not overrides:
            return self
        ops, opaque = dict(self.ops), dict(self.opaque)
        for key, category in overrides.items():
            opaque.pop(key, None)
            if category is None:
                ops.pop(key, None)
            else:
                ops[key] = category
        return Policy(self.device_type, self.dtype, MappingProxyType(ops), self.effective, MappingProxyType(opaque))


def get_policy(device_type: str, dtype: torch.dtype) -> Policy:
    """The built-in policy for ``device_type`` ("cpu" or "cuda") and ``dtype`` (bf16 or fp16).

    Its ``opaque`` entries depend on whether oneDNN is enabled now (``torch.backends.mkldnn``).
    """
    if device_type not in _REGISTERED:
        raise ValueError(f"no autocast policy for device_type={device_type!r}; use one of {DEVICE_TYPES}")
    if dtype not in LOW_DTYPES:
        raise ValueError(f"no autocast policy for dtype={dtype}; use torch.bfloat16 or torch.float16")
    return Policy(device_type, dtype, _REGISTERED[device_type], _EFFECTIVE[device_type], _opaque(device_type, dtype))
