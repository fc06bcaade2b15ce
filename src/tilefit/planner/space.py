"""The search space: micro-batches that split the global batch, and the recipes to try.

The global batch is the user's training recipe (it sets the gradient noise and the learning
rate schedule), so every candidate keeps micro_batch x accumulation_steps == global_batch
exactly; only divisors of the global batch are micro-batch candidates. A recipe here is a
tilefit.recipe.Recipe whose batch is set per trace (Recipe.with_batch).
"""

from __future__ import annotations

from dataclasses import replace

from tilefit.batches import divisors, is_friendly
from tilefit.errors import TilefitError
from tilefit.hardware import Device
from tilefit.recipe import Lora, Recipe
from tilefit.vocab import FUSED_IMPLEMENTATION, PRECISIONS, device_precisions

# What a change of optimizer means for training, shown in the plan's "changes" column.
OPTIMIZER_LABELS = {
    "adamw": "AdamW", "adamw-fused": "AdamW (fused kernel)", "adam": "Adam",
    "adamw-8bit": "8-bit AdamW (bitsandbytes)",
    "adafactor": "Adafactor", "sgd": "SGD with momentum",
}
# Optimizers the planner may propose in place of the user's (only when allowed, or when
# nothing else fits; always marked as a change to the training algorithm).
ALTERNATIVE_OPTIMIZERS = ("adamw-8bit", "adafactor", "sgd")


def check_global_batch(global_batch: int) -> None:
    """A global batch the planner can split into hardware-friendly micro-batches.

    Rejected: non-integers, values < 1, and odd primes > 2 whose only splits are 1 x G
    (micro-batch 1: every GEMM's batch dimension at 1) and G x 1 (no accumulation possible).
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise TilefitError("the global batch must be a whole number >= 1",
                           expected="the samples per optimizer step of your recipe, e.g. 32",
                           given=repr(global_batch),
                           fix="pass plan(..., global_batch=32)")
    if global_batch > 2 and divisors(global_batch) == [1, global_batch]:
        lower, upper = nearest_splittable(global_batch)
        raise TilefitError(
            f"the global batch {global_batch} is prime: it splits only into 1 x {global_batch} "
            f"(micro-batch 1) or {global_batch} x 1 (no accumulation)",
            expected="a global batch with a hardware-friendly divisor (a multiple of 8 or a "
            "power of two)", given=str(global_batch),
            fix=f"use a nearby global batch: {lower} or {upper} (scale the learning rate with "
            "it if your recipe does)")


def nearest_splittable(global_batch: int) -> tuple[int, int]:
    """The nearest global batches below and above with a friendly divisor of at least 8
    (or a power of two when the batch is small)."""

    def ok(g: int) -> bool:
        if g < 1:
            return False
        want = 8 if global_batch >= 8 else 2
        return any(d >= want and is_friendly(d) for d in divisors(g))

    lower = next((g for g in range(global_batch - 1, 0, -1) if ok(g)), 1)
    upper = next(g for g in range(global_batch + 1, 2 * global_batch + 16) if ok(g))
    return lower, upper


def micro_batch_candidates(global_batch: int) -> tuple[list[int], list[int]]:
    """(friendly divisors, other divisors) of the global batch."""
    ds = divisors(global_batch)
    return [d for d in ds if is_friendly(d)], [d for d in ds if not is_friendly(d)]


def precisions(device: Device) -> list[str]:
    """The precision names worth planning on the device, best first
    (tilefit.vocab.device_precisions)."""
    return [p.name for p in device_precisions(device)]


def base_recipes(device: Device, optimizer: str, *, hf_model: bool) -> list[Recipe]:
    """The recipes that keep the user's optimizer: mixed precision with SDPA, with and
    without gradient checkpointing; mixed precision with eager attention and full precision
    with SDPA, without checkpointing. Checkpointing is crossed with the fastest attention and
    precision only, to keep the trace count down: the eager and full-precision rows show
    what those choices cost, and neither is ever faster or smaller than SDPA in mixed
    precision once checkpointing is on (eager materialises the attention scores; fp32
    activations are twice the bytes of bf16 ones)."""
    precs = precisions(device)
    att = "sdpa" if hf_model else "auto"
    out = [Recipe(precision=precs[0], optimizer=optimizer, attention=att),
           Recipe(precision=precs[0], optimizer=optimizer, grad_checkpointing=True,
                  attention=att)]
    if hf_model:
        out.append(Recipe(precision=precs[0], optimizer=optimizer, attention="eager"))
    out.extend(Recipe(precision=p, optimizer=optimizer, attention=att) for p in precs[1:])
    return out


def same_math_recipes(device: Device, optimizer: str, *, causal_lm: bool) -> list[Recipe]:
    """Changes that keep the math: the optimizer's fused kernel (torch.optim's fused=True),
    for a causal LM the fused linear cross-entropy loss (Liger Kernel's; with and without
    checkpointing), and torch.compile, each in mixed precision with SDPA."""
    prec = precisions(device)[0]
    out: list[Recipe] = []
    fused = FUSED_IMPLEMENTATION.get(optimizer)
    if fused is not None:
        out.append(Recipe(precision=prec, optimizer=fused, attention="sdpa" if causal_lm
                          else "auto"))
    if causal_lm:
        out.extend(Recipe(precision=prec, optimizer=fused or optimizer, grad_checkpointing=ckpt,
                          attention="sdpa", fused_ce=True) for ckpt in (False, True))
    if device.kind == "cuda":  # torch.compile of the forward and backward (Inductor)
        out.append(Recipe(precision=prec, optimizer=fused or optimizer,
                          attention="sdpa" if causal_lm else "auto", compile=True))
    return out


def moe_recipes(device: Device, optimizer: str, *, experts: bool) -> list[Recipe]:
    """For a mixture of experts, pure bf16 (weights, gradients and optimizer state in bf16):
    torch's grouped GEMM, which runs the experts, takes bf16 only, so in mixed precision
    (fp32 weights) they run one fp32 matmul per expert (docs/references.md, section 40).
    Not the same math: no fp32 master weights."""
    if not experts or device.kind != "cuda" or not device.supports("bf16"):
        return []
    return [Recipe(precision="bf16-true", optimizer=FUSED_IMPLEMENTATION.get(optimizer,
                                                                            optimizer),
                   attention="sdpa")]


def fp8_recipes(device: Device, optimizer: str, *, hf_model: bool) -> list[Recipe]:
    """fp8 training (torchao's float8 on the nn.Linear GEMMs, the rest bf16 autocast) with
    torch.compile, which fuses its scaling and casting kernels, where the GPU has fp8
    Tensor Cores (docs/references.md, section 21). Not the same math: fp8 rounding. A
    machine without torchao gets a note saying how to install it (the trace's error)."""
    fp8 = [p for p in PRECISIONS if p.float8_linears and p.supported_by(device)]
    if device.kind != "cuda" or not fp8:
        return []
    return [Recipe(precision=fp8[0].name, optimizer=FUSED_IMPLEMENTATION.get(optimizer,
                                                                            optimizer),
                   attention="sdpa" if hf_model else "auto", compile=True)]


def optimizer_recipes(device: Device, optimizer: str, *, hf_model: bool) -> list[Recipe]:
    """Recipes that change the optimizer: mixed precision, the fastest attention."""
    prec = precisions(device)[0]
    att = "sdpa" if hf_model else "auto"
    return [Recipe(precision=prec, optimizer=opt, grad_checkpointing=ckpt, attention=att)
            for opt in ALTERNATIVE_OPTIMIZERS if opt != optimizer for ckpt in (False, True)]


def qlora_recipes(device: Device, optimizer: str, lora: Lora | None = None) -> list[Recipe]:
    """QLoRA (Dettmers et al. 2023): peft_recipes' LoRA on a base quantized to nf4 by
    bitsandbytes (double quantization, computing in the mixed precision's 16-bit dtype),
    with and without checkpointing (Hugging Face models only)."""
    return [replace(spec, quantize="nf4") for spec in peft_recipes(device, optimizer, lora)]


def compiled(device: Device, specs: list[Recipe]) -> list[Recipe]:
    """Each of ``specs`` under torch.compile (Inductor), on a GPU: what torchtune's LoRA and
    QLoRA recipes run by default; the same math, fused kernels and fewer saved activations
    (for a large vocabulary, chiefly the loss's logits)."""
    if device.kind != "cuda":
        return []
    return [replace(spec, compile=True) for spec in specs]


def peft_recipes(device: Device, optimizer: str, lora: Lora | None = None) -> list[Recipe]:
    """LoRA (``lora``'s adapters, default Lora()) with the user's optimizer, mixed
    precision, SDPA, with and without checkpointing (Hugging Face models only: the adapters
    wrap their linear layers)."""
    prec = precisions(device)[0]
    return [Recipe(precision=prec, optimizer=optimizer, grad_checkpointing=ckpt,
                   attention="sdpa", lora=lora or Lora()) for ckpt in (False, True)]
