"""CUDA autocast's policy as the trace applies it, checked against independent references:
the op lists against the header torch ships (ATen/autocast_mode.h); every GEMM, convolution
and attention op of a set of torch.nn models against real autocast run for real on the CPU
(CPU's and CUDA's lists agree on those); the ops CUDA keeps in fp32 (softmax, layer_norm, the
losses), where CPU autocast differs, against the header's fp32 lists."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from tilefit import Recipe, trace
from tilefit.tracing import autocast_lists

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
BF16 = "bfloat16"

# the ops whose dtype CPU and CUDA autocast decide alike (both lists run them in the low
# dtype), and their backward kernels
GEMM_FAMILY = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
               "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward"}
# ops CUDA autocast keeps in fp32 where CPU autocast does not (the header's FP32 and
# FP32_SET_OPT_DTYPE lists, as the kernels they decompose into)
CUDA_FP32_KERNELS = {"native_layer_norm", "_log_softmax", "_softmax", "nll_loss_forward",
                     "mse_loss"}


def _header_list(macro: str) -> list[str]:
    body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", HEADER.read_text(), re.S)
    assert body is not None, macro
    return [f"{m[0]}.{m[1]}" if m[1] else m[0]
            for m in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1))]


@pytest.mark.skipif(not HEADER.exists(), reason="this torch ships no ATen headers")
def test_the_lists_are_the_headers() -> None:
    assert list(autocast_lists.LOWER_PRECISION_FP) == _header_list("AT_FORALL_LOWER_PRECISION_FP")
    assert list(autocast_lists.FP32) == _header_list("AT_FORALL_FP32")
    assert list(autocast_lists.FP32_SET_OPT_DTYPE) == _header_list(
        "AT_FORALL_FP32_SET_OPT_DTYPE")
    assert list(autocast_lists.PROMOTE) == _header_list("AT_FORALL_PROMOTE")
    redispatch = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(.*?)\n\n",
                           HEADER.read_text(), re.S)
    assert redispatch is not None
    assert sorted(re.findall(r'"(norm\.\w+)"', redispatch.group(1))) == sorted(
        autocast_lists.FP32_APPEND_DTYPE)


class _Ops(TorchDispatchMode):
    """Each aten op's name, phase and first floating output dtype, in a real run."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.seen: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        first = next((t for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        if first is not None:
            self.seen.append((func.overloadpacket.__name__, self.phase,
                              str(first.dtype).removeprefix("torch.")))
        return out


def _real_run(build: Callable[[], nn.Module], batch: torch.Tensor) -> list[tuple[str, str, str]]:
    """Forward under real CPU autocast (bf16), backward outside it, on real tensors, with
    the flash kernel for attention as the trace's stand-in for a GPU's."""
    torch.manual_seed(0)
    model = build()
    ops = _Ops()
    with ops, sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch).float().mean()
        ops.phase = "backward"
        loss.backward()
    return ops.seen


def _traced(build: Callable[[], nn.Module], batch: torch.Tensor) -> list[tuple[str, str, str]]:
    tr = trace(build, batch, recipe=Recipe(precision="bf16-mixed", optimizer="sgd",
                                           batch_size=batch.shape[0]),
               gpu="a100-80gb", loss_fn=lambda m, x: m(x).float().mean())
    return [(r.op.split(".")[1], "backward" if r.phase == "recompute" else r.phase, r.dtype)
            for r in tr.ops if r.step == 1 and r.phase in ("forward", "backward", "recompute")]


def _family(ops: list[tuple[str, str, str]]) -> Counter[tuple[str, str, str]]:
    return Counter(o for o in ops if o[0] in GEMM_FAMILY)


class _MHA(nn.Module):
    def __init__(self, batch_first: bool, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


class _EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.einsum("bqd,bkd->bqk", q, k).softmax(-1)
        return self.out(torch.einsum("bqk,bkd->bqd", scores, v))


def _scaled_mm(device_type: str) -> type[torch.autograd.Function]:
    """A custom autograd Function as PyTorch's AMP docs write one (custom_fwd/custom_bwd:
    the backward runs under the forward's autocast state), for ``device_type``."""

    class ScaledMM(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return torch.mm(a, b) * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            return torch.mm(g, b.t()) * 2, torch.mm(a.t(), g) * 2

    return ScaledMM


class _CustomFunction(nn.Module):
    """Written for the device it runs on: "cuda" where tilefit traces it for a GPU (a
    context naming CUDA, mirrored on the fake tensors' CPU), "cpu" in the real run."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32))
        self.fn = _scaled_mm(device_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x.flatten(0, 1), self.w)  # type: ignore[no-any-return]


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        # a reentrant checkpoint needs an input that requires grad: a layer before it
        self.inp = nn.Linear(32, 32)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.inp(x),  # type: ignore[no-any-return]
                          use_reentrant=self.reentrant)


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


SEQ = torch.randn(2, 8, 32)
MODELS: dict[str, tuple[Callable[[], nn.Module], torch.Tensor]] = {
    "mha-batch-first": (lambda: _MHA(True, False), SEQ),
    "mha-seq-first-weights": (lambda: _MHA(False, True), SEQ),
    "mha-batch-first-weights": (lambda: _MHA(True, True), SEQ),
    "encoder-post-norm": (lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                             batch_first=True), SEQ),
    "encoder-pre-norm": (lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                            batch_first=True, norm_first=True),
                         SEQ),
    "decoder": (lambda: _Decoder(), SEQ),
    "conv": (_Conv, torch.randn(2, 3, 12, 12)),
    "einsum-attention": (_EinsumAttention, SEQ),
    "autograd-function": (lambda: _CustomFunction("cpu"), SEQ),
    "checkpoint-non-reentrant": (lambda: _Checkpointed(False), SEQ),
    "checkpoint-reentrant": (lambda: _Checkpointed(True), SEQ),
}


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_gemm_and_attention_op_has_real_autocasts_dtype(name: str) -> None:
    build, batch = MODELS[name]
    traced_build = (lambda: _CustomFunction("cuda")) if name == "autograd-function" else build
    real, traced = _family(_real_run(build, batch)), _family(_traced(traced_build, batch))
    assert traced == real
    assert {dtype for _, _, dtype in traced} == {BF16}  # no model here keeps a GEMM in fp32


class _NormAndLoss(nn.Module):
    """A LayerNorm and a loss on a linear layer's bf16 output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.norm(self.a(x))).flatten(0, 1)
        return F.nll_loss(F.log_softmax(y, -1), torch.zeros(y.shape[0], dtype=torch.long))


@pytest.mark.parametrize("name", ["mha-seq-first-weights", "einsum-attention", "norm-and-loss"])
def test_what_cuda_keeps_in_fp32_is_fp32(name: str) -> None:
    build, batch = MODELS.get(name, (_NormAndLoss, SEQ))
    traced = [o for o in _traced(build, batch) if o[0] in CUDA_FP32_KERNELS
              and o[1] == "forward"]
    assert traced and {dtype for _, _, dtype in traced} == {"float32"}
    # CPU autocast keeps them in bf16: the trace follows CUDA's lists, not the CPU's
    real = [o for o in _real_run(build, batch) if o[0] in CUDA_FP32_KERNELS]
    assert BF16 in {dtype for _, _, dtype in real}


def _user_composite(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A user function that routes through torch's override protocol, as
    torch.nn.functional's composites do."""
    if has_torch_function((x, w)):
        return handle_torch_function(_user_composite, (x, w), x, w)  # type: ignore[no-any-return]
    return F.gelu(x @ w)


class _Logging(TorchFunctionMode):
    """The user's own torch-function handler (a profiler, a logger), active in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _Composite(nn.Module):
    def __init__(self, handler: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32))
        self.handler = handler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.handler:
            return _user_composite(x, self.w)
        with _Logging() as logging:
            out = _user_composite(x, self.w)
        assert logging.calls >= 1
        return out


@pytest.mark.parametrize("handler", [False, True])
def test_a_composite_never_seen_gets_the_policy(handler: bool) -> None:
    traced = _traced(lambda: _Composite(handler), SEQ)
    gemms = [o for o in traced if o[0] in GEMM_FAMILY]
    assert len(gemms) == 2  # x @ w forward; w's gradient (the batch needs none)
    assert {dtype for _, _, dtype in gemms} == {BF16}


def test_a_region_the_user_keeps_in_fp32_stays_fp32() -> None:
    class KeepsFp32(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(x.device.type, enabled=False):  # transformers' rotary idiom
                y = self.a(x.float())
            return self.b(y)

    real, traced = _family(_real_run(KeepsFp32, SEQ)), _family(_traced(KeepsFp32, SEQ))
    assert traced == real
    assert {dtype for _, _, dtype in traced} == {BF16, "float32"}


def test_cross_entropy_keeps_its_log_softmax_in_the_logits_dtype() -> None:
    """cross_entropy's composite calls log_softmax with the input's own dtype, so autocast's
    fp32 rule for log_softmax (set the dtype where none is given) does not apply: the
    log-probabilities are bf16, and nll_loss, on CUDA's fp32 list, casts them to fp32."""
    given: list[object] = []
    lib = torch.library.Library("aten", "IMPL")
    op = torch.ops.aten.log_softmax.int

    def spy(x, dim, dtype=None):  # type: ignore[no-untyped-def]
        given.append(dtype)
        with torch._C._ExcludeDispatchKeyGuard(
                torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(x, dim, dtype)

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("log_softmax.int", spy, "AutocastCPU")
        lib.impl("cross_entropy_loss", torch.library.fallthrough_kernel, "AutocastCPU")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(torch.randn(4, 10, dtype=torch.bfloat16), torch.zeros(4).long())
    finally:
        lib._destroy()
    assert given == [torch.bfloat16]  # the composite passes the dtype itself

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.head(x).flatten(0, 1)
            return F.cross_entropy(y, torch.zeros(y.shape[0], dtype=torch.long))

    traced = [o for o in _traced(Logits, SEQ) if o[1] == "forward"]
    assert [o for o in traced if o[0] == "_log_softmax"] == [("_log_softmax", "forward", BF16)]
    assert [o for o in traced if o[0] == "nll_loss_forward"] == [
        ("nll_loss_forward", "forward", "float32")]


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_multihead_attention_runs_the_kernels_of_its_linear_twin(precision: str) -> None:
    # issue 46's example, small: the GEMMs and attention kernels of nn.MultiheadAttention
    # blocks are those of the same blocks written with nn.Linear and SDPA, shape for shape
    # (the rest of the difference is MultiheadAttention's own copies, which a GPU runs too:
    # benchmarks/bench_mha_vs_linear.py)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_mha_vs_linear as twins

    x = torch.randn(2, 16, twins.WIDTH)

    def kernels(build: Callable[[], nn.Module]) -> Counter[tuple[object, ...]]:
        tr = trace(build, x, recipe=Recipe(precision=precision, optimizer="sgd", batch_size=2),
                   gpu="a100-80gb", loss_fn=lambda m, b: m(b).float().mean())
        return Counter((r.phase, r.kind, tuple(sorted((g.m, g.n, g.k, g.dtype) for g in
                                                      r.gemms)), r.dtype)
                       for r in tr.ops if r.step == 1 and r.kind in ("gemm", "attention"))

    assert kernels(twins.WithMHA) == kernels(twins.WithLinear)
