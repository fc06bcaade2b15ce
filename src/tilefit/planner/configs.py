"""Configs to paste for a chosen plan: Hugging Face TrainingArguments (Python and JSON),
Lightning Trainer arguments, a plain PyTorch loop, DeepSpeed JSON (offload), and the
multi-GPU launch (tilefit.planner.launch: a torchrun script, accelerate, DeepSpeed)."""

from __future__ import annotations

import json
from typing import Any

from tilefit.dtypes import parse_dtype
from tilefit.estimator.offload import REDUCE_BUCKET_ELEMENTS
from tilefit.models import Workload
from tilefit.models.lora import peft_config
from tilefit.planner.rows import PlanRow

# TrainingArguments(optim=...) names (transformers training_args.OptimizerNames).
# "adamw_torch" is torch.optim.AdamW as torch defaults it (foreach on CUDA);
# "adamw_torch_fused" is AdamW(fused=True), the Trainer's default with torch >= 2.8.
HF_OPTIM = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "adam": "adamw_torch",
            "adamw-8bit": "adamw_bnb_8bit", "adafactor": "adafactor", "sgd": "sgd"}
# transformers' use_liger_kernel applies every Liger kernel of the model type; this config
# (TrainingArguments.liger_kernel_config, passed to Liger's apply_liger_kernel_to_<model>)
# keeps only the fused linear cross-entropy that tilefit estimated
LIGER_FUSED_CE_ONLY = {"fused_linear_cross_entropy": True, "cross_entropy": False,
                       "rope": False, "rms_norm": False, "swiglu": False}
TORCH_OPTIM = {
    "adamw": "torch.optim.AdamW(model.parameters(), lr=lr)",
    "adamw-fused": "torch.optim.AdamW(model.parameters(), lr=lr, fused=True)",
    "adam": "torch.optim.Adam(model.parameters(), lr=lr)",
    "adamw-8bit": "bitsandbytes.optim.AdamW8bit(model.parameters(), lr=lr)",
    "adafactor": "torch.optim.Adafactor(model.parameters(), lr=lr)",
    "sgd": "torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)",
}


def hf_training_arguments(row: PlanRow, *, deepspeed_path: str | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "per_device_train_batch_size": row.micro_batch,
        "gradient_accumulation_steps": row.accumulation_steps,
        "gradient_checkpointing": row.grad_checkpointing,
        **row.recipe.spec.hf_flags(),
        # the Trainer clips at 1.0 unless told otherwise; 0 turns clipping off
        "max_grad_norm": row.recipe.max_grad_norm or 0.0,
        "optim": HF_OPTIM.get(row.optimizer, row.optimizer),
        # the Trainer reads each micro-batch's loss on the host (a wait for the GPU) unless
        # told otherwise; the estimate this row came from did the same
        "logging_nan_inf_filter": row.recipe.loss_sync,
    }
    if row.recipe.compile:  # the Trainer wraps the model in torch.compile (mode "default")
        args["torch_compile"] = True
    if row.recipe.fused_ce:  # Liger's fused linear cross-entropy alone, as estimated
        args["use_liger_kernel"] = True
        args["liger_kernel_config"] = dict(LIGER_FUSED_CE_ONLY)
    if row.offload:
        args["deepspeed"] = deepspeed_path or "ds_config.json"
    return args


def _python_call(name: str, kwargs: dict[str, Any]) -> str:
    body = "".join(f"    {k}={v!r},\n" for k, v in kwargs.items())
    return f"{name}(\n{body})"


def float8_lines(row: PlanRow) -> list[str]:
    """torchao's float8 conversion of an fp8 row's model (docs/references.md, section 21):
    the layers whose dimensions are multiples of 16 (torch.compile follows: compile_lines)."""
    if not row.recipe.spec.float8_linears:
        return []
    return ["from torchao.float8 import convert_to_float8_training  # pip install torchao",
            "convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "
            "m.in_features % 16 == 0 and m.out_features % 16 == 0)"]


def compile_lines(row: PlanRow) -> list[str]:
    """A compiled row's model wrapped as it was estimated (torch.compile, default mode), after
    any float8 conversion; for a plain loop or Lightning (the HF Trainer takes
    torch_compile=True instead)."""
    return [*float8_lines(row), *(["model = torch.compile(model)"] if row.recipe.compile
                                  else [])]


def bnb_kwargs(row: PlanRow) -> dict[str, Any]:
    """transformers.BitsAndBytesConfig(**this) of a QLoRA row: the base as it was traced
    (tilefit.models.quantize), computing in the row's 16-bit dtype."""
    from tilefit.models.quantize import bnb_config_kwargs

    half = row.recipe.spec.half_dtype
    return bnb_config_kwargs(str(row.recipe.quantize),
                             parse_dtype(half).torch_name if half else "float32")


def qlora_lines(row: PlanRow, task: str) -> list[str]:
    """A QLoRA row's model: loaded quantized by bitsandbytes, prepared by peft (fp32 norms
    and embeddings, frozen), LoRA adapters (peft_lora_config's) on it."""
    attention = f', attn_implementation="{row.attention}"' \
        if row.attention in ("sdpa", "eager") else ""
    ckpt = ("True, gradient_checkpointing_kwargs={'use_reentrant': False}"
            if row.grad_checkpointing else "False")
    return [
        "from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training",
        "from transformers import BitsAndBytesConfig  # pip install bitsandbytes",
        "bnb_config = " + _python_call("BitsAndBytesConfig", bnb_kwargs(row)),
        "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb_config"
        f"{attention})",
        f"model = prepare_model_for_kbit_training(model, use_gradient_checkpointing={ckpt})",
        "model = get_peft_model(model, " + _python_call("LoraConfig", peft_config(task))
        + ")"]


def hf_python(row: PlanRow, task: str = "causal-lm") -> str:
    args = hf_training_arguments(row)
    lines = ["from transformers import AutoModelForCausalLM, TrainingArguments", ""]
    if row.recipe.quantize:
        lines.extend(qlora_lines(row, task))
    elif row.attention in ("sdpa", "eager"):
        lines.append(f'model = AutoModelForCausalLM.from_pretrained(name, '
                     f'attn_implementation="{row.attention}")')
    if row.recipe.spec.float8_linears:
        lines.append("import torch")
        lines.extend(float8_lines(row))
    lines.append("args = " + _python_call("TrainingArguments", {"output_dir": "out", **args}))
    return "\n".join(lines)


def lightning(row: PlanRow) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trainer": {"accelerator": "gpu", "devices": 1,
                    "precision": row.recipe.spec.lightning,
                    "accumulate_grad_batches": row.accumulation_steps,
                    "gradient_clip_val": row.recipe.max_grad_norm},
        "dataloader": {"batch_size": row.micro_batch},
        "model": {"gradient_checkpointing_enable": row.grad_checkpointing,
                  "attn_implementation": row.attention},
    }
    if row.recipe.compile or row.recipe.spec.float8_linears:
        # before trainer.fit(model): Lightning trains the module it is given
        out["model"]["before_fit"] = compile_lines(row)
    if row.offload:
        out["trainer"]["strategy"] = "deepspeed_stage_2_offload"
    return out


def torch_loop(row: PlanRow) -> str:
    prec = row.recipe.spec
    amp = f"torch.{parse_dtype(prec.autocast_dtype).torch_name}" if prec.autocast_dtype else None
    lines = [
        "import torch",
        f"# micro-batch {row.micro_batch} x {row.accumulation_steps} accumulation steps = "
        f"global batch {row.global_batch}",
        f"loader = torch.utils.data.DataLoader(dataset, batch_size={row.micro_batch}, "
        "shuffle=True, pin_memory=True)",
    ]
    if prec.allow_tf32:
        lines.append("torch.backends.cuda.matmul.allow_tf32 = True")
    if prec.param_dtype != "fp32":
        lines.append(f"model = model.to(torch.{parse_dtype(prec.param_dtype).torch_name})")
    if row.grad_checkpointing:
        lines.append("model.gradient_checkpointing_enable()  # HF models; else "
                     "torch.utils.checkpoint per block")
    lines.extend(compile_lines(row))
    lines.append(f"opt = {TORCH_OPTIM.get(row.optimizer, row.optimizer)}")
    if prec.grad_scaler:
        lines.append("scaler = torch.amp.GradScaler('cuda')")
    lines.append("for i, batch in enumerate(loader):")
    ctx = (f"torch.autocast('cuda', dtype={amp})" if amp else "torch.autocast('cuda', "
           "enabled=False)")
    lines.append(f"    with {ctx}:")
    lines.append(f"        loss = model(**batch).loss / {row.accumulation_steps}")
    if prec.grad_scaler:
        lines.append("    scaler.scale(loss).backward()")
    else:
        lines.append("    loss.backward()")
    lines.append(f"    if (i + 1) % {row.accumulation_steps} == 0:")
    if row.recipe.max_grad_norm is not None:
        if prec.grad_scaler:
            lines.append("        scaler.unscale_(opt)")
        lines.append("        torch.nn.utils.clip_grad_norm_(model.parameters(), "
                     f"{row.recipe.max_grad_norm})")
    lines.append("        scaler.step(opt); scaler.update()" if prec.grad_scaler
                 else "        opt.step()")
    lines.append("        opt.zero_grad(set_to_none=True)")
    return "\n".join(lines)


def deepspeed_offload(row: PlanRow) -> dict[str, Any]:
    """ZeRO stage 2 with the optimizer on the CPU (DeepSpeed's ZeRO-Offload)."""
    return {
        "train_batch_size": row.global_batch,
        "train_micro_batch_size_per_gpu": row.micro_batch,
        "gradient_accumulation_steps": row.accumulation_steps,
        "bf16": {"enabled": row.recipe.spec.half_dtype == "bf16"},
        "fp16": {"enabled": row.recipe.spec.half_dtype == "fp16"},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
        },
        "gradient_clipping": row.recipe.max_grad_norm or 0.0,
    }


def single_gpu_configs(row: PlanRow, task: str) -> dict[str, Any]:
    hf = hf_training_arguments(row)
    out: dict[str, Any] = {
        "hf_training_arguments": hf,
        "hf_training_arguments_json": json.dumps(hf, indent=2),
        "hf_python": hf_python(row, task),
        "lightning": lightning(row),
        "pytorch_loop": torch_loop(row),
    }
    if row.offload:
        out["deepspeed"] = deepspeed_offload(row)
    if row.peft:
        out["peft_lora_config"] = peft_config(task)
    if row.recipe.quantize:
        out["bitsandbytes_config"] = bnb_kwargs(row)
    return out


def multi_gpu_configs(row: PlanRow, work: Workload) -> dict[str, Any]:
    """A multi-GPU plan's configs that launch as they are (tilefit.planner.launch): the
    torchrun script (DeepSpeed's engine for a ZeRO plan), the DeepSpeed JSON, for DDP and
    FSDP2 the accelerate config (dict and YAML) and its script, the Trainer's per-device
    arguments, and ``files``: what ``--write-configs DIR`` writes, by name."""
    from tilefit.planner import launch
    from tilefit.planner.launch_deepspeed import deepspeed_config
    from tilefit.vocab import ZERO_STRATEGIES

    files = launch.launch_files(row, work)
    hf = {**hf_training_arguments(row), "per_device_train_batch_size": row.micro_batch,
          "gradient_accumulation_steps": row.accumulation_steps}
    run = f"torchrun --nproc-per-node {row.world_size} {launch.TORCHRUN_SCRIPT_NAME}"
    out: dict[str, Any] = {
        "torchrun_script": files[launch.TORCHRUN_SCRIPT_NAME],
        "deepspeed": deepspeed_config(row),
        "hf_training_arguments": hf,
        "files": files,
    }
    if row.strategy in ZERO_STRATEGIES:
        out["launch"] = run + "   # DeepSpeed's engine; on CPUs with DS_ACCELERATOR=cpu"
        out["deepspeed_note"] = "the torchrun script trains with it (deepspeed.initialize)"
        return out
    acc = launch.accelerate_config(row)
    out.update({
        "launch": f"{run}   # or: accelerate launch --config_file "
                  f"{launch.ACCELERATE_CONFIG_NAME} {launch.ACCELERATE_SCRIPT_NAME}",
        "accelerate": acc, "accelerate_yaml": launch.yaml_text(acc),
        "deepspeed_note": f"DeepSpeed's closest equivalent of {row.strategy} (ZeRO-"
                          f"{out['deepspeed']['zero_optimization']['stage']}); not launched: "
                          "plan a ZeRO strategy for a DeepSpeed run",
    })
    return out
