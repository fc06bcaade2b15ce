"""The model's setup in a chosen plan's pasted code, as the row says it is trained: loaded in
the dtype its precision implies, gradient checkpointing, its LoRA adapters (peft's
get_peft_model with the row's LoraConfig), torchao float8 and torch.compile. Every snippet
of tilefit.planner.configs (plain PyTorch, the Trainer's, Lightning's) starts from these
lines; the row's optimizer, as torch (or bitsandbytes, or DeepSpeed's CPU Adam) builds it.

Strings only: nothing here imports torch or transformers."""

from __future__ import annotations

from typing import Any

from tilefit.dtypes import parse_dtype
from tilefit.models.lora import peft_config
from tilefit.planner.rows import PlanRow

# the row's optimizer, built over ``PARAMS`` (the trainable parameters) with ``lr``
TORCH_OPTIMIZERS = {
    "adamw": "torch.optim.AdamW(PARAMS, lr=lr)",
    "adamw-fused": "torch.optim.AdamW(PARAMS, lr=lr, fused=True)",
    "adam": "torch.optim.Adam(PARAMS, lr=lr)",
    "adamw-8bit": "bitsandbytes.optim.AdamW8bit(PARAMS, lr=lr)",
    "paged-adamw-8bit": "bitsandbytes.optim.PagedAdamW8bit(PARAMS, lr=lr)",
    "paged-adamw": "bitsandbytes.optim.PagedAdamW(PARAMS, lr=lr)",
    "adafactor": "torch.optim.Adafactor(PARAMS, lr=lr)",
    "sgd": "torch.optim.SGD(PARAMS, lr=lr, momentum=0.9)",
}
# ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's CPU Adam (what
# tilefit.estimator.offload times; adamw_mode=True is AdamW's decoupled weight decay)
CPU_ADAM = "deepspeed.ops.adam.DeepSpeedCPUAdam(PARAMS, lr=lr, adamw_mode=True)"
CHECKPOINTING = ('model.gradient_checkpointing_enable('
                 'gradient_checkpointing_kwargs={"use_reentrant": False})')


def load_dtype(row: PlanRow) -> str:
    """The dtype the model is loaded in (a tilefit dtype name): a LoRA base in the step's
    16-bit dtype (as tilefit.models.lora.lora_base_dtype traces it; fp32 without one), else
    the weights' dtype of the precision: fp32 master weights under autocast, 16 bits for
    bf16-true / fp16-true (and ZeRO-Offload's 16-bit GPU copy)."""
    spec = row.recipe.spec
    if row.peft:
        return spec.half_dtype or "fp32"
    return spec.param_dtype


def torch_dtype(name: str) -> str:
    return f"torch.{parse_dtype(name).torch_name}"


def trainable(row: PlanRow, model: str = "model") -> str:
    """The parameters the optimizer steps: the adapters alone under LoRA."""
    if row.peft:
        return f"[p for p in {model}.parameters() if p.requires_grad]"
    return f"{model}.parameters()"


def optimizer_expr(row: PlanRow, model: str = "model") -> str:
    """The row's optimizer over ``model``'s trainable parameters (DeepSpeed's CPU Adam for a
    ZeRO-Offload row)."""
    text = CPU_ADAM if row.offload else TORCH_OPTIMIZERS.get(row.optimizer, row.optimizer)
    return text.replace("PARAMS", trainable(row, model))


def lora_call(row: PlanRow, task: str) -> str:
    cfg: dict[str, Any] = peft_config(task, row.recipe.lora)
    body = ", ".join(f"{k}={v!r}" for k, v in cfg.items())
    return f"model = get_peft_model(model, LoraConfig({body}))"


def model_lines(row: PlanRow, task: str, auto_class: str | None) -> list[str]:
    """The model as the row trains it. ``auto_class``: transformers' Auto class of the task
    (``model = Auto.from_pretrained(name, dtype=...)``); None: a model of your own, cast to
    the dtype. Checkpointing is enabled before peft wraps the model (peft then makes the
    frozen embeddings' output require grad, so checkpointed blocks get gradients)."""
    dtype = torch_dtype(load_dtype(row))
    out = ["import torch"]
    if auto_class is None:
        if load_dtype(row) != "fp32":
            out.append(f"model = model.to({dtype})")
    else:
        att = f', attn_implementation="{row.attention}"' if row.attention in (
            "sdpa", "eager") else ""
        out += [f"from transformers import {auto_class}",
                f"model = {auto_class}.from_pretrained(name, dtype={dtype}{att})"]
    if row.grad_checkpointing:
        out.append(CHECKPOINTING if auto_class else
                   "# gradient checkpointing: torch.utils.checkpoint around each block")
    if row.peft:
        out += ["from peft import LoraConfig, get_peft_model  # pip install peft",
                lora_call(row, task)]
    return out


def optimizer_imports(row: PlanRow) -> list[str]:
    text = optimizer_expr(row)
    if text.startswith("bitsandbytes."):
        return ["import bitsandbytes  # pip install bitsandbytes"]
    if text.startswith("deepspeed."):
        return ["import deepspeed  # pip install deepspeed"]
    return []


def optimizer_function(row: PlanRow) -> str:
    """A launch script's ``make_optimizer(params)``: the row's optimizer as the one-GPU
    snippets build it (TORCH_OPTIMIZERS, at the script's ``LR``), AdamW where the row's is
    your own factory."""
    known = row.optimizer in TORCH_OPTIMIZERS
    expr = TORCH_OPTIMIZERS[row.optimizer] if known else \
        "torch.optim.AdamW(PARAMS, lr=lr)  # your optimizer here"
    imports = "".join(f"    {line}\n" for line in optimizer_imports(row)) if known else ""
    body = expr.replace("PARAMS", "params").replace("lr=lr", "lr=LR")
    return (f"\n\ndef make_optimizer(params):\n"
            f'    """The planned optimizer, {row.optimizer}, over the parameters that '
            f'train."""\n{imports}    return {body}\n')
