"""Configs to paste for a chosen plan: Hugging Face TrainingArguments (Python and JSON),
Lightning Trainer arguments, a plain PyTorch loop, DeepSpeed JSON (offload), and the
multi-GPU launch (tilefit.planner.launch: a torchrun script, accelerate, DeepSpeed)."""

from __future__ import annotations

import json
from typing import Any

from tilefit.estimator.offload import REDUCE_BUCKET_ELEMENTS
from tilefit.models import Workload
from tilefit.models.lora import peft_config
from tilefit.planner import model_code
from tilefit.planner.rows import PlanRow

# TrainingArguments(optim=...) names (transformers training_args.OptimizerNames).
# "adamw_torch" is torch.optim.AdamW as torch defaults it (foreach on CUDA);
# "adamw_torch_fused" is AdamW(fused=True), the Trainer's default with torch >= 2.8.
HF_OPTIM = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "adam": "adamw_torch",
            "adamw-8bit": "adamw_bnb_8bit", "adafactor": "adafactor", "sgd": "sgd",
            "paged-adamw-8bit": "paged_adamw_8bit", "paged-adamw": "paged_adamw_32bit"}
# transformers' use_liger_kernel applies every Liger kernel of the model type; this config
# (TrainingArguments.liger_kernel_config, passed to Liger's apply_liger_kernel_to_<model>)
# keeps only the fused linear cross-entropy that tilefit estimated
LIGER_FUSED_CE_ONLY = {"fused_linear_cross_entropy": True, "cross_entropy": False,
                       "rope": False, "rms_norm": False, "swiglu": False}


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
    if row.grad_checkpointing:  # as the pasted model enables it (model_code.CHECKPOINTING)
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if row.offload:
        args.update(offload_training_arguments(deepspeed_path))
        del args["optim"]
    return args


def offload_training_arguments(deepspeed_path: str | None = None) -> dict[str, Any]:
    """A ZeRO-Offload row's Trainer arguments: its DeepSpeed JSON, whose optimizer section
    (DeepSpeed's CPU Adam) the Trainer takes in place of ``optim``; the learning rate and
    weight decay that section names, which the Trainer requires to match its own."""
    from tilefit.planner.launch import LEARNING_RATE
    from tilefit.planner.launch_deepspeed import ADAMW_WEIGHT_DECAY

    return {"deepspeed": deepspeed_path or "ds_config.json", "learning_rate": LEARNING_RATE,
            "weight_decay": ADAMW_WEIGHT_DECAY}


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
    (tilefit.models.quantize), as the row's recipe says."""
    from tilefit.models.quantize import bnb_config_kwargs

    return bnb_config_kwargs(row.recipe)


AUTO_CAUSAL_LM = "AutoModelForCausalLM"


def qlora_lines(row: PlanRow, task: str, *, placed: bool = False) -> list[str]:
    """A QLoRA row's model: loaded quantized by bitsandbytes in its compute dtype, prepared
    by peft (fp32 norms and embeddings, frozen) where the recipe says, LoRA adapters
    (peft_lora_config's) on it. ``placed``: loaded
    straight onto ``device`` (``device_map``), as a loop without a Trainer needs it: the
    weights are quantized as they are placed."""
    attention = f', attn_implementation="{row.attention}"' \
        if row.attention in ("sdpa", "eager") else ""
    if placed:
        attention += ', device_map={"": device}'
    ckpt = ("True, gradient_checkpointing_kwargs={'use_reentrant': False}"
            if row.grad_checkpointing else "False")
    bnb = bnb_kwargs(row)
    dtype = bnb.get("bnb_4bit_compute_dtype")  # loaded in it, as traced
    if dtype is not None:
        attention = f", dtype={dtype!r}{attention}"
    return [
        f"from transformers import {AUTO_CAUSAL_LM}",
        "from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training",
        "from transformers import BitsAndBytesConfig  # pip install bitsandbytes",
        "bnb_config = " + _python_call("BitsAndBytesConfig", bnb),
        "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb_config"
        f"{attention})",
        *([f"model = prepare_model_for_kbit_training(model, use_gradient_checkpointing={ckpt})"]
          if row.recipe.prepare_kbit else []),
        "model = get_peft_model(model, "
        + _python_call("LoraConfig", peft_config(task, row.recipe.lora)) + ")"]


def _auto_class(task: str, hf_model: bool) -> str | None:
    if not hf_model:
        return None
    from tilefit.models.tasks import auto_class_name

    return auto_class_name(task)


def model_setup(row: PlanRow, task: str, hf_model: bool, *, placed: bool = False
                ) -> list[str]:
    """The model as the row trains it: a QLoRA row's quantized load (qlora_lines), else
    model_code's lines."""
    if row.recipe.quantize:
        return qlora_lines(row, task, placed=placed)
    return model_code.model_lines(row, task, _auto_class(task, hf_model))


def hf_python(row: PlanRow, task: str = "causal-lm", *, hf_model: bool = True) -> str:
    """The model as the row trains it (model_code), then the Trainer's arguments."""
    args = hf_training_arguments(row)
    lines = model_setup(row, task, hf_model)
    lines.extend(float8_lines(row))  # the Trainer compiles (torch_compile=True)
    if row.offload:
        lines.append("# ds_config.json: the plan's DeepSpeed JSON (ZeRO-Offload; pip install "
                     "deepspeed)")
    lines += ["from transformers import Trainer, TrainingArguments", "",
              "args = " + _python_call("TrainingArguments", {"output_dir": "out", **args}),
              "trainer = Trainer(model=model, args=args, train_dataset=dataset)"]
    return "\n".join(lines)


def _lightning_fused_clip(row: PlanRow) -> str | None:
    """How Lightning clips a row whose optimizer is fused under autocast: its
    mixed-precision plugin refuses gradient_clip_val with an optimizer that unscales
    itself (lightning/pytorch/plugins/precision/amp.py). Under bf16 ("hook") the module
    clips in on_before_optimizer_step (no loss scale to undo); under fp16's loss scaler
    ("foreach") the optimizer is the same update unfused, which Lightning unscales before
    clipping. None: Lightning's gradient_clip_val as it is."""
    spec = row.recipe.spec
    if (row.recipe.max_grad_norm is None or row.offload or spec.autocast_dtype is None
            or "fused=True" not in model_code.optimizer_expr(row)):
        return None
    return "foreach" if spec.grad_scaler else "hook"


def lightning_optimizer(row: PlanRow, model: str) -> str:
    text = model_code.optimizer_expr(row, model)
    if _lightning_fused_clip(row) == "foreach":
        return text.replace("fused=True", "foreach=True")
    return text


# zero_grad(set_to_none=False), where the recipe keeps the gradients allocated, zeroed
ZERO_GRAD_KEPT = "optimizer.zero_grad(set_to_none=False)"


def lightning(row: PlanRow) -> dict[str, Any]:
    clip = _lightning_fused_clip(row)
    out: dict[str, Any] = {
        "trainer": {"accelerator": "gpu", "devices": 1,
                    "precision": row.recipe.spec.lightning,
                    "accumulate_grad_batches": row.accumulation_steps,
                    "gradient_clip_val": None if clip == "hook" else row.recipe.max_grad_norm},
        "dataloader": {"batch_size": row.micro_batch},
        "model": {"gradient_checkpointing_enable": row.grad_checkpointing,
                  "attn_implementation": row.attention,
                  "dtype": model_code.torch_dtype(model_code.load_dtype(row)),
                  "configure_optimizers": lightning_optimizer(row, "self")},
    }
    if clip == "hook":
        out["model"]["on_before_optimizer_step"] = _clip_line(row, "self")
    if not row.recipe.zero_grad_to_none:  # Lightning's default zero_grad() frees them
        out["model"]["optimizer_zero_grad"] = ZERO_GRAD_KEPT
    if row.recipe.compile or row.recipe.spec.float8_linears:
        # before trainer.fit(model): Lightning trains the module it is given
        out["model"]["before_fit"] = compile_lines(row)
    if row.offload:
        out["trainer"]["strategy"] = "deepspeed_stage_2_offload"
    return out


def lightning_python(row: PlanRow, task: str = "causal-lm", *, hf_model: bool = True) -> str:
    """A LightningModule that trains the model as the row says (model_code) with the row's
    optimizer (DeepSpeed's CPU Adam under ZeRO-Offload, as Lightning's DeepSpeed strategy
    asks), and its Trainer."""
    setup = [*model_setup(row, task, hf_model), *compile_lines(row), "self.model = model"]
    kwargs = lightning(row)["trainer"]
    lines = ["import lightning as L", "import torch", *model_code.optimizer_imports(row), "",
             "",
             "class PlannedModule(L.LightningModule):",
             "    def __init__(self, name):",
             "        super().__init__()",
             *("        " + line for line in setup), "",
             "    def training_step(self, batch, batch_idx):",
             "        return self.model(**batch).loss", "",
             "    def configure_optimizers(self):",
             f"        return {lightning_optimizer(row, 'self.model')}", "",
             *(["    def on_before_optimizer_step(self, optimizer):",
                "        # Lightning refuses gradient_clip_val with a fused optimizer",
                f"        {_clip_line(row, 'self.model')}", ""]
               if _lightning_fused_clip(row) == "hook" else []),
             *(["    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):",
                f"        {ZERO_GRAD_KEPT}", ""] if not row.recipe.zero_grad_to_none else []),
             "",
             f"loader = torch.utils.data.DataLoader(dataset, batch_size={row.micro_batch}, "
             "shuffle=True)",
             "trainer = " + _python_call("L.Trainer", kwargs),
             "trainer.fit(PlannedModule(name), loader)"]
    return "\n".join(lines)


def _clip_line(row: PlanRow, model: str) -> str:
    return (f"torch.nn.utils.clip_grad_norm_({model_code.trainable(row, model)}, "
            f"{row.recipe.max_grad_norm})")


def torch_loop(row: PlanRow, task: str = "causal-lm", *, hf_model: bool = True) -> str:
    """The row as a plain PyTorch loop; a ZeRO-Offload row as DeepSpeed's engine
    (offload_loop: plain PyTorch has no optimizer offload)."""
    if row.offload:
        return offload_loop(row, task, hf_model=hf_model)
    prec = row.recipe.spec
    amp = model_code.torch_dtype(prec.autocast_dtype) if prec.autocast_dtype else None
    device = 'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")'
    placed = ["import torch", device, *model_setup(row, task, hf_model, placed=True)] \
        if row.recipe.quantize else [*model_setup(row, task, hf_model), device,
                                     "model.to(device)"]
    lines = [*placed, *compile_lines(row), *model_code.optimizer_imports(row),
             f"# micro-batch {row.micro_batch} x {row.accumulation_steps} accumulation steps "
             f"= global batch {row.global_batch}",
             f"loader = torch.utils.data.DataLoader(dataset, batch_size={row.micro_batch}, "
             "shuffle=True, pin_memory=True)"]
    if prec.allow_tf32:
        lines.append("torch.backends.cuda.matmul.allow_tf32 = True")
    lines.append(f"opt = {model_code.optimizer_expr(row)}")
    if row.recipe.loss_sync:
        lines.append("running_loss = 0.0")
    if prec.grad_scaler:
        lines.append("scaler = torch.amp.GradScaler(device.type)")
    ctx = (f"torch.autocast(device.type, dtype={amp})" if amp else
           "torch.autocast(device.type, enabled=False)")
    lines += ["for i, batch in enumerate(loader):",
              "    batch = {k: v.to(device) for k, v in batch.items()}",
              f"    with {ctx}:",
              f"        loss = model(**batch).loss / {row.accumulation_steps}",
              "    scaler.scale(loss).backward()" if prec.grad_scaler else
              "    loss.backward()",
              *(["    running_loss += loss.item()  # the loss read on the host (loss_sync)"]
                if row.recipe.loss_sync else []),
              f"    if (i + 1) % {row.accumulation_steps} == 0:"]
    if row.recipe.max_grad_norm is not None:
        if prec.grad_scaler:
            lines.append("        scaler.unscale_(opt)")
        lines.append(f"        {_clip_line(row, 'model')}")
    lines.append("        scaler.step(opt); scaler.update()" if prec.grad_scaler
                 else "        opt.step()")
    lines.append(f"        opt.zero_grad(set_to_none={row.recipe.zero_grad_to_none})")
    return "\n".join(lines)


def offload_loop(row: PlanRow, task: str = "causal-lm", *, hf_model: bool = True) -> str:
    """A ZeRO-Offload row in plain PyTorch: torch has no optimizer offload, so the model is
    handed to DeepSpeed's engine with the plan's JSON (its CPU Adam steps on the CPU)."""
    config = deepspeed_offload(row)
    client = "" if "optimizer" in config else \
        f"optimizer={model_code.TORCH_OPTIMIZERS[row.optimizer].replace('PARAMS', 'params')}, "
    lines = [*model_code.model_lines(row, task, _auto_class(task, hf_model)),
             *compile_lines(row),
             "# plain PyTorch has no optimizer offload: DeepSpeed's ZeRO-Offload runs this plan",
             "# (pip install deepspeed; launch with: deepspeed --num_gpus 1 train.py)",
             "import deepspeed",
             f"ds_config = {config!r}  # the plan's DeepSpeed JSON (ds_config.json)",
             f"params = {model_code.trainable(row)}",
             f"engine, opt, _, _ = deepspeed.initialize(model=model, {client}"
             "model_parameters=params, config=ds_config)",
             f"# micro-batch {row.micro_batch} x {row.accumulation_steps} accumulation steps "
             f"= global batch {row.global_batch}",
             f"loader = torch.utils.data.DataLoader(dataset, batch_size={row.micro_batch}, "
             "shuffle=True, pin_memory=True)",
             "for batch in loader:",
             "    batch = {k: v.to(engine.device) for k, v in batch.items()}",
             "    loss = engine(**batch).loss",
             "    engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps",
             f"    engine.step()  # the CPU optimizer steps every {row.accumulation_steps} "
             "micro-batches, clipping included"]
    return "\n".join(lines)


def deepspeed_offload(row: PlanRow) -> dict[str, Any]:
    """ZeRO stage 2 with the optimizer on the CPU (DeepSpeed's ZeRO-Offload) on one GPU: the
    JSON of a one-GPU "zero2" offload plan (launch_deepspeed.deepspeed_config), its optimizer
    section DeepSpeed's CPU Adam, its reduce bucket the one tilefit.estimator.offload counts."""
    from dataclasses import replace

    from tilefit.planner.launch_deepspeed import deepspeed_config

    out = deepspeed_config(replace(row, strategy="zero2", world_size=1))
    assert out["zero_optimization"]["reduce_bucket_size"] == REDUCE_BUCKET_ELEMENTS
    return out


def single_gpu_configs(row: PlanRow, task: str, *, hf_model: bool = True) -> dict[str, Any]:
    hf = hf_training_arguments(row)
    out: dict[str, Any] = {
        "hf_training_arguments": hf,
        "hf_training_arguments_json": json.dumps(hf, indent=2),
        "hf_python": hf_python(row, task, hf_model=hf_model),
        "lightning": lightning(row),
        "lightning_python": lightning_python(row, task, hf_model=hf_model),
        "pytorch_loop": torch_loop(row, task, hf_model=hf_model),
    }
    if row.offload:
        out["deepspeed"] = deepspeed_offload(row)
    if row.peft:
        out["peft_lora_config"] = peft_config(task, row.recipe.lora)
    if row.recipe.quantize:
        out["bitsandbytes_config"] = bnb_kwargs(row)
    out["files"] = single_gpu_files(out)
    return out


def single_gpu_files(cfg: dict[str, Any]) -> dict[str, str]:
    """What ``--write-configs DIR`` writes for a one-GPU plan, by file name: each way to
    train it as a script, and the JSON configs it uses."""
    files = {"train_hf.py": cfg["hf_python"],
             "training_args.json": cfg["hf_training_arguments_json"],
             "train_lightning.py": cfg["lightning_python"],
             "train_pytorch.py": cfg["pytorch_loop"]}
    for key, name in (("deepspeed", "ds_config.json"), ("peft_lora_config", "lora_config.json"),
                      ("bitsandbytes_config", "bnb_config.json")):
        if key in cfg:
            files[name] = json.dumps(cfg[key], indent=2)
    return {name: text if text.endswith("\n") else text + "\n" for name, text in files.items()}


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
    if row.peft:
        out["peft_lora_config"] = peft_config(work.task, row.recipe.lora)
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
