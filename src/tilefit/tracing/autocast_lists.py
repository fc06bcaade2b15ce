"""CUDA autocast's op lists, as ATen registers them for the Autocast dispatch key.

From torch's ATen/autocast_mode.h (shipped in the wheel under torch/include; torch 2.13,
with where torch 2.11's header differs applied when it is the installed torch, each
difference below with its source): AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (norm's
fp32_append_dtype) and AT_FORALL_PROMOTE, and binary_cross_entropy, which CUDA autocast
refuses (autocast_mode.cpp's "banned" kernel).
Each entry is one aten overload, "name" for the default one and "name.overload" otherwise,
exactly as the header lists it: an overload the header does not list runs without a cast
(docs/references.md, section 46). tests/test_autocast_policy.py checks these lists against
the header of the installed torch where it ships one.
"""

from __future__ import annotations

from tilefit.compat.amp import autocast_runs_rms_norm_in_fp32, has_named_dim_overloads

# torch 2.11 (before pytorch/pytorch#173895 removed named tensors) also lists each of these
# overloads' named-dimension sibling, right after it (its autocast_mode.h)
_NAMED_SIBLING: dict[str, str] = {
    "prod.dim_int": "prod.dim_Dimname", "softmax.int": "softmax.Dimname",
    "log_softmax.int": "log_softmax.Dimname", "cumprod": "cumprod.dimname",
    "cumsum": "cumsum.dimname", "sum.dim_IntList": "sum.dim_DimnameList",
}


def _with_named_siblings(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` with each one's named-dimension sibling after it, where aten has them."""
    if not has_named_dim_overloads():
        return names
    return tuple(n for name in names for n in (name, _NAMED_SIBLING.get(name)) if n)


LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)

FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
if not autocast_runs_rms_norm_in_fp32():  # torch 2.11: rms_norm is not listed (from 2.12)
    FP32 = tuple(n for n in FP32 if n != "rms_norm")

FP32_SET_OPT_DTYPE: tuple[str, ...] = _with_named_siblings((
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
))

# fp32_append_dtype: the overload is run as its dtype-taking sibling with dtype=float32
FP32_APPEND_DTYPE: dict[str, str] = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
if has_named_dim_overloads():  # torch 2.11's header lists the named-dimension norm too
    FP32_APPEND_DTYPE["norm.names_ScalarOpt_dim"] = "norm.names_ScalarOpt_dim_dtype"

PROMOTE: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)

# CUDA autocast raises for these (autocast_mode.cpp, binary_cross_entropy_banned)
BANNED: tuple[str, ...] = ("binary_cross_entropy",)

BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional."
    "binary_cross_entropy_with_logits\nor torch.nn.BCEWithLogitsLoss.  "
    "binary_cross_entropy_with_logits and BCEWithLogits are\nsafe to autocast.")


# registered by cudnn/AutocastRNN.cpp, not in the header's lists: the cuDNN RNN in fp16
CUDNN_RNN = "_cudnn_rnn"


def listed() -> frozenset[str]:
    """Every overload CUDA autocast has a kernel for."""
    return frozenset((*LOWER_PRECISION_FP, *FP32, *FP32_SET_OPT_DTYPE, *FP32_APPEND_DTYPE,
                      *PROMOTE, *BANNED, CUDNN_RNN))
