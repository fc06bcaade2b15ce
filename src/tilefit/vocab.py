"""tilefit's vocabulary: precisions, training recipes, op kinds, phases, memory categories.

One definition of each, torch-free (the gemm / linear / gpus commands import nothing heavy).
Every module that needs to know what "bf16-mixed" means — its autocast dtype, whether a
GradScaler runs, what the device must support, how Hugging Face or Lightning spell it — asks
the ``Precision`` here instead of keeping a table of its own.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from tilefit.errors import TilefitError

if TYPE_CHECKING:
    from tilefit.hardware.device import Device

# ---- op kinds, phases, memory categories (what a trace records) --------------------------
# collective: a c10d collective of a data-parallel engine (all-reduce, all-gather,
# reduce-scatter, broadcast), costed by tilefit.estimator.collectives
OpKind = Literal["gemm", "conv", "attention", "memory", "view", "unknown", "collective"]
Phase = Literal["setup", "forward", "backward", "recompute", "loss_check", "clip_grad",
                "optimizer", "zero_grad", "scaler"]
# communication: the buffers a data-parallel engine holds (DDP's gradient buckets, FSDP2's
# all-gathered parameters and its all-gather / reduce-scatter buffers); only multi-GPU
# traces have it (Trace.breakdown_at)
# cudagraph_pool: what the private memory pool of torch.compile's CUDA graphs holds beyond its
# live tensors at the peak (tilefit.estimator.cudagraphs; no storage has it)
Category = Literal["parameters", "gradients", "optimizer_state", "activations", "temporaries",
                   "inputs", "communication", "cudagraph_pool"]
Attention = Literal["auto", "eager", "sdpa"]

OP_KINDS: tuple[str, ...] = get_args(OpKind)
PHASES: tuple[str, ...] = get_args(Phase)[1:]  # the phases of a step ("setup" precedes it)
# once per micro-batch; loss_check: the training loop reads the loss on the host (the HF
# Trainer's logging_nan_inf_filter, a loss printed each step): it waits for the GPU
MICRO_PHASES: tuple[str, ...] = ("forward", "backward", "recompute", "loss_check")
# once per optimizer step
OPTIMIZER_PHASES: tuple[str, ...] = ("clip_grad", "optimizer", "zero_grad", "scaler")
CATEGORIES: tuple[str, ...] = get_args(Category)
ATTENTIONS: tuple[str, ...] = get_args(Attention)

# ---- data-parallel strategies (tilefit.tracing.distributed wraps the model in them) --------
# ddp: torch.nn.parallel.DistributedDataParallel; fsdp2: torch.distributed.fsdp.fully_shard
# per transformer block, then the root. DeepSpeed ZeRO: ZERO_STRATEGIES below (modelled).
Strategy = Literal["ddp", "fsdp2"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
# what --gpus N without --strategy runs: fully sharded, the engine that fits large models
DEFAULT_STRATEGY = "fsdp2"
# DeepSpeed ZeRO stages 1-3: modelled, not traced (tilefit.estimator.zero; DeepSpeed's engine
# does not run on fake tensors), on top of the one-GPU trace
ZeroStrategy = Literal["zero1", "zero2", "zero3"]
ZERO_STRATEGIES: tuple[str, ...] = get_args(ZeroStrategy)

# ---- optimizers (tilefit.tracing.optimizers builds them) ------------------------------------
# adamw-8bit, paged-adamw-8bit, paged-adamw: bitsandbytes' AdamW8bit, PagedAdamW8bit and
# PagedAdamW (the optional extra "quant"); paged state lives in CUDA unified memory
OPTIMIZER_NAMES: tuple[str, ...] = ("sgd", "adam", "adamw", "adamw-fused", "adafactor",
                                    "adamw-8bit", "paged-adamw-8bit", "paged-adamw")
# the optimizers bitsandbytes builds (tilefit.tracing.optimizers)
BNB_OPTIMIZERS: tuple[str, ...] = ("adamw-8bit", "paged-adamw-8bit", "paged-adamw")
# of those, the ones whose state is paged (cudaMallocManaged): the driver may evict it to the
# host under memory pressure instead of failing the allocation
PAGED_OPTIMIZERS: tuple[str, ...] = ("paged-adamw-8bit", "paged-adamw")
# an optimizer -> the same update as one fused kernel (torch.optim's fused=True)
FUSED_IMPLEMENTATION: dict[str, str] = {"adamw": "adamw-fused"}


def same_update(a: str, b: str) -> bool:
    """Whether two optimizer names are the same training algorithm (one may be the other's
    fused implementation)."""
    return a == b or FUSED_IMPLEMENTATION.get(a) == b or FUSED_IMPLEMENTATION.get(b) == a

# ---- quantized base weights (tilefit.models.quantize: bitsandbytes' own layers) ----------
# nf4 / fp4: Linear4bit (QLoRA's 4-bit NormalFloat / 4-bit float); int8: Linear8bitLt
# (LLM.int8()). Every linear layer but the output head, as transformers' BitsAndBytesConfig
Quantization = Literal["nf4", "fp4", "int8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)

# ---- precisions ---------------------------------------------------------------------------
PrecisionName = Literal["fp32", "tf32", "fp16-mixed", "fp16-mixed-unscaled", "bf16-mixed",
                        "bf16-true", "fp16-true", "fp8-mixed"]


@dataclass(frozen=True)
class Precision:
    """How a training step uses floating point.

    Dtype fields hold tilefit dtype names (tilefit.dtypes: fp32, tf32, fp16, bf16, fp8)."""

    name: str  # the canonical spelling, a PrecisionName
    compute_dtype: str  # the GEMMs' math dtype, whose dense peak MFU is measured against
    autocast_dtype: str | None  # torch.autocast's low-precision dtype; None: no autocast
    param_dtype: str  # the dtype the weights are held in (bf16 for pure bf16 training)
    grad_scaler: bool  # fp16 needs loss scaling (torch.amp.GradScaler)
    requires: str | None  # the dtype the device must support; None: any device
    lightning: str  # Lightning Trainer(precision=...)
    description: str
    aliases: tuple[str, ...] = ()

    @property
    def half_dtype(self) -> str | None:
        """The 16-bit dtype of the step (autocast's or the weights'), None for fp32/tf32:
        what DeepSpeed's and accelerate's bf16/fp16 switches mean."""
        return self.autocast_dtype or (self.param_dtype if self.param_dtype != "fp32" else None)

    @property
    def allow_tf32(self) -> bool:
        """fp32 tensors whose matmuls run on TF32 Tensor Cores
        (torch.backends.cuda.matmul.allow_tf32)."""
        return self.compute_dtype == "tf32"

    def hf_flags(self) -> dict[str, bool]:
        """Hugging Face TrainingArguments' precision switches (bf16 / fp16 / tf32). HF has no
        pure-bf16 switch: its bf16=True is autocast, and pure bf16 comes from loading the
        model with torch_dtype=torch.bfloat16."""
        half = self.half_dtype
        return {"bf16": half == "bf16", "fp16": half == "fp16", "tf32": self.allow_tf32}

    @property
    def float8_linears(self) -> bool:
        """The nn.Linear GEMMs run in fp8 as torchao's float8 training runs them
        (tilefit.tracing.float8); the rest of the step is the autocast dtype's."""
        return self.compute_dtype == "fp8"

    def supported_by(self, device: Device) -> bool:
        return self.requires is None or device.supports(self.requires)


PRECISIONS: tuple[Precision, ...] = (
    Precision("fp32", "fp32", None, "fp32", False, None, "32-true",
              "fp32 weights and math (TF32 off)", ("32", "32-true", "float32", "full")),
    Precision("tf32", "tf32", None, "fp32", False, "tf32", "32-true",
              "fp32 weights, matmuls on TF32 Tensor Cores", ("tensorfloat32",)),
    Precision("fp16-mixed", "fp16", "fp16", "fp32", True, "fp16", "16-mixed",
              "fp32 weights, fp16 autocast with loss scaling",
              ("16-mixed", "fp16", "16", "float16", "amp-fp16", "float16-mixed")),
    # fp16 autocast without torch's GradScaler: a loop that never scales its loss (timm's
    # --amp without a scaler, a hand-written loop); Lightning and Hugging Face always scale
    # fp16, so their configs cannot say it (after fp16-mixed: mixed_precision's choice)
    Precision("fp16-mixed-unscaled", "fp16", "fp16", "fp32", False, "fp16", "16-mixed",
              "fp32 weights, fp16 autocast without loss scaling",
              ("fp16-autocast", "fp16-mixed-no-scaler", "fp16-noscaler")),
    Precision("bf16-mixed", "bf16", "bf16", "fp32", False, "bf16", "bf16-mixed",
              "fp32 weights, bf16 autocast",
              ("bf16", "bfloat16", "amp", "amp-bf16", "bfloat16-mixed")),
    # pure bf16 weights, spelled as Lightning spells them ("bf16-true"); a bare "bf16" is
    # autocast, as Hugging Face's bf16=True, Lightning's "bf16" and accelerate's "bf16" mean
    Precision("bf16-true", "bf16", None, "bf16", False, "bf16", "bf16-true",
              "bf16 weights, gradients, optimizer state and math (no fp32 master copy)",
              ("pure-bf16", "bfloat16-true")),
    # fp16 weights without autocast or torch's GradScaler (which refuses fp16 gradients):
    # Lightning's "16-true", and DeepSpeed's fp16 mode, which keeps the fp32 master copy in
    # its partitioned optimizer and scales the loss itself (docs/references.md, section 24,
    # item 5). "fp16" alone stays fp16-mixed's alias.
    Precision("fp16-true", "fp16", None, "fp16", False, "fp16", "16-true",
              "fp16 weights, gradients, optimizer state and math (no fp32 master copy, no "
              "loss scaler)", ("16-true", "pure-fp16", "float16-true")),
    # torchao's float8 training (docs/references.md, section 21): the nn.Linear layers'
    # three GEMMs in fp8 with dynamic tensorwise scaling, everything else bf16 autocast, fp32
    # master weights. Lightning has no switch for it: bf16-mixed, the model converted by
    # torchao.float8.convert_to_float8_training in configure_model.
    Precision("fp8-mixed", "fp8", "bf16", "fp32", False, "fp8", "bf16-mixed",
              "fp32 weights, nn.Linear GEMMs in fp8 (torchao float8, tensorwise dynamic "
              "scaling), the rest bf16 autocast",
              ("fp8", "float8", "fp8-torchao", "float8-mixed", "torchao-fp8")),
)
PRECISION_NAMES: tuple[str, ...] = tuple(p.name for p in PRECISIONS)
assert get_args(PrecisionName) == PRECISION_NAMES


def parse_precision(text: str | Precision) -> Precision:
    """A Precision from its name or an alias (case-insensitive; Lightning's spellings
    included). Unknown names are an error listing the choices and the closest ones."""
    if isinstance(text, Precision):
        return text
    key = str(text).strip().lower().replace("_", "-")
    for p in PRECISIONS:
        if key == p.name or key in p.aliases:
            return p
    spellings = [*PRECISION_NAMES, *(a for p in PRECISIONS for a in p.aliases)]
    close = difflib.get_close_matches(key, spellings, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise TilefitError(
        f"unknown precision {text!r}{hint}",
        expected="one of " + ", ".join(PRECISION_NAMES),
        given=repr(text),
        fix="pass Recipe(precision='bf16-mixed') on Ampere and later GPUs, "
        "Recipe(precision='fp16-mixed') before, Recipe(precision='fp32') on the CPU")


# spellings whose meaning differs across the ecosystem: a bare 16-bit dtype name is read as
# autocast, as Hugging Face (TrainingArguments(bf16=True)), Lightning (precision="bf16") and
# accelerate (mixed_precision="bf16") read it; torch users may mean 16-bit weights
AMBIGUOUS_SPELLINGS: tuple[str, ...] = ("bf16", "bfloat16", "fp16", "float16", "16")


def precision_reading(text: str) -> str | None:
    """A one-line note of how an ambiguous precision spelling was read (None for an
    unambiguous one)."""
    key = str(text).strip().lower().replace("_", "-")
    if key not in AMBIGUOUS_SPELLINGS:
        return None
    p = parse_precision(key)
    pure = "bf16-true" if p.autocast_dtype == "bf16" else "fp16-true"
    return (f"precision {text!r} read as {p.name} ({p.description}), as Hugging Face's, "
            f"Lightning's and accelerate's {key} mean; 16-bit weights are {pure!r}")


def mixed_precision(half_dtype: str) -> Precision:
    """The autocast precision of a 16-bit dtype ("bf16" -> bf16-mixed, "fp16" -> fp16-mixed)."""
    for p in PRECISIONS:
        if p.autocast_dtype == half_dtype:
            return p
    raise ValueError(f"no mixed precision autocasts to {half_dtype!r}")


def precision_from_hf(bf16: bool, fp16: bool, tf32: bool | None) -> Precision:
    """The precision Hugging Face TrainingArguments(bf16=, fp16=, tf32=) runs."""
    if bf16:
        return parse_precision("bf16-mixed")
    if fp16:
        return parse_precision("fp16-mixed")
    return parse_precision("tf32" if tf32 else "fp32")


def device_precisions(device: Device) -> list[Precision]:
    """The precisions worth trying on a device, best first: mixed precision in the 16-bit
    dtype the part has (bf16 on Ampere and later; fp16 with loss scaling before: V100 and T4
    have no bf16), then full precision: tf32 where the part has TF32 Tensor Cores, else
    fp32."""
    mixed = [p for p in PRECISIONS if p.autocast_dtype and p.supported_by(device)]
    out = sorted(mixed, key=lambda p: p.autocast_dtype != "bf16")[:1]
    tf32 = parse_precision("tf32")
    out.append(tf32 if tf32.supported_by(device) else parse_precision("fp32"))
    return out


def default_precision(device: Device) -> str:
    """bf16 mixed precision where the part has bf16, else fp16 mixed precision, else fp32
    (the CPU, and GPUs without 16-bit Tensor Cores)."""
    if device.kind == "cpu":
        return "fp32"
    first = device_precisions(device)[0]
    return first.name if first.autocast_dtype else "fp32"


def check_precision_supported(precision: str | Precision, device: Device) -> Precision:
    """The Precision, or an error when the device has no math for it."""
    p = parse_precision(precision)
    if not p.supported_by(device):
        raise TilefitError(
            f"{device.display_name} has no {p.requires} math, so precision {p.name} cannot run",
            expected=f"a GPU with {p.requires} Tensor Cores (in the catalog: "
            f"{', '.join(gpus_supporting(p.requires))})", given=f"{p.name} on {device.name}",
            fix=f"use Recipe(precision={default_precision(device)!r}) on this device, or "
            "one of the GPUs above: estimate(..., gpu=...)")
    return p


def gpus_supporting(dtype: str) -> list[str]:
    """The catalog GPUs with dense math in ``dtype`` (their canonical names)."""
    from tilefit.hardware.catalog import CATALOG  # torch-free; imported late: no cycle

    return [d.name for d in CATALOG if d.supports(dtype)]


def check_max_grad_norm(max_grad_norm: float | None, *, given: str | None = None) -> None:
    """None (no clipping) or a positive number; else an error with the fix. ``given``: the
    user's text when it came from the command line."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, int | float) \
            or not max_grad_norm > 0:
        raise TilefitError(
            "max_grad_norm must be a positive number (or None: no clipping)",
            expected="e.g. 1.0, the Hugging Face Trainer's default",
            given=repr(max_grad_norm) if given is None else given,
            fix="pass Recipe(max_grad_norm=1.0) (the Trainer's default), or "
            "Recipe(max_grad_norm=None) to train without clipping")


# ---- torch.compile (tilefit.tracing.inductor_fusion) ------------------------------------------
# torch.compile's mode= as tilefit predicts it: "default" (Inductor's kernels, launched by the
# host one by one) or "reduce-overhead" (the same kernels captured as CUDA graphs and replayed,
# tilefit.estimator.cudagraphs). compile=True alone means "default".
CompileMode = Literal["default", "reduce-overhead"]
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
REDUCE_OVERHEAD = "reduce-overhead"  # the CompileMode that replays CUDA graphs


def check_compile_mode(mode: str, compile: bool) -> None:
    """An error for an unknown compile mode, or a mode other than "default" without
    compile=True."""
    if mode not in COMPILE_MODES:
        raise TilefitError(f"unknown torch.compile mode {mode!r}",
                           expected="one of " + ", ".join(COMPILE_MODES), given=repr(mode),
                           fix="pass Recipe(compile=Compile(mode='reduce-overhead')), or "
                           "Recipe(compile=Compile(mode='default'))")
    if mode != "default" and not compile:
        raise TilefitError(f"compile_mode={mode!r} is a mode of torch.compile",
                           expected=f"compile=True with compile_mode={mode!r}",
                           given="compile=False",
                           fix="pass Recipe(compile=Compile(mode=...))")

# Op kinds Inductor runs as "extern" ATen kernels, never fused with their neighbours: GEMMs
# (mm, addmm, bmm), convolutions and fused attention (docs/references.md, section 19).
EXTERN_KINDS: tuple[str, ...] = ("gemm", "conv", "attention")


# ---- mixture-of-experts routing (tilefit.tracing.moe traces under it) -------------------
# How many of a MoE layer's routed token-slots (tokens x top_k) each expert receives: the
# router decides it from values a fake tensor does not have, so a trace assumes it.
# balanced: every expert an equal share; skewed:F: the busiest expert a share F
ROUTINGS: tuple[str, ...] = ("balanced", "skewed:F")


@dataclass(frozen=True)
class ExpertRouting:
    """A routing assumption: ``busiest`` None is balanced, else skewed's share F."""

    busiest: float | None = None

    @property
    def name(self) -> str:
        return "balanced" if self.busiest is None else f"skewed:{self.busiest:g}"

    def counts(self, routed: int, experts: int, cap: int | None = None) -> tuple[int, ...]:
        """Tokens per expert (expert 0 the busiest) of ``routed`` token-slots over ``experts``.
        Balanced: ``routed // experts`` each, the first ``routed % experts`` one more.
        Skewed: the busiest round(F x routed), at least an even share (ceil) and at most
        ``cap`` (the tokens: top-k picks an expert once per token); the others share the
        rest as balanced does."""
        if self.busiest is None or experts == 1:
            return _even(routed, experts)
        top = min(max(round(self.busiest * routed), -(-routed // experts)), routed)
        top = top if cap is None else min(top, cap)
        return (top, *_even(routed - top, experts - 1))


BALANCED = ExpertRouting()  # the default routing assumption


def _even(routed: int, experts: int) -> tuple[int, ...]:
    base, extra = divmod(routed, experts)
    return tuple(base + (1 if i < extra else 0) for i in range(experts))


def parse_routing(text: str) -> ExpertRouting:
    """``"balanced"`` or ``"skewed:F"`` with F in (0, 1] (the busiest expert's share of the
    routed token-slots) -> ExpertRouting; anything else a TilefitError naming both forms."""
    key = str(text).strip().lower()
    if key == "balanced":
        return BALANCED
    head, _, share = key.partition(":")
    try:
        value = float(share) if head == "skewed" else None
    except ValueError:
        value = None
    if value is None or not 0.0 < value <= 1.0:
        raise TilefitError(f"unknown routing {text!r}",
                           expected="balanced, or skewed:F with F in (0, 1] (the busiest "
                           "expert's share of the routed tokens, e.g. skewed:0.5)",
                           given=repr(text), fix="pass Recipe(routing='balanced') or "
                           "Recipe(routing='skewed:0.5')")
    return ExpertRouting(value)
