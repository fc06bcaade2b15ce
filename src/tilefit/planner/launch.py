"""Configs that launch a multi-GPU plan as they are: a self-contained torchrun training script
(FSDP2's fully_shard per block then the root, or DDP; DeepSpeed's engine for a ZeRO plan,
``tilefit.planner.launch_deepspeed``), an accelerate config with its training script, a
DeepSpeed JSON.

The script builds the model as tilefit's workload does (a Hugging Face model from its config
with transformers' Auto class; a factory by importing it), on the meta device for FSDP2,
shards it with the plan's MixedPrecisionPolicy (torchtitan's: param_dtype the autocast dtype,
reduce_dtype fp32; docs/references.md, section 23), checkpoints activations if planned,
runs AdamW at the plan's micro-batch and accumulation on synthetic batches (a marked place
to plug the user's data), and prints one ``tilefit-step`` JSON line per rank and step.
The accelerate script imports the model, batches and the plan's numbers from it, so the two
train the same thing; accelerate runs FSDP on GPUs only (docs/references.md, section 26).
A LoRA row's script applies the planned peft LoraConfig and trains the adapters only
(docs/references.md, section 35, item 8).
"""

from __future__ import annotations

import json
from string import Template
from typing import Any

from tilefit.dtypes import parse_dtype
from tilefit.models import Workload
from tilefit.models.lora import peft_config
from tilefit.planner.model_code import load_dtype, optimizer_function
from tilefit.planner.rows import PlanRow
from tilefit.vocab import ZERO_STRATEGIES

TORCHRUN_SCRIPT_NAME = "train_tilefit.py"
ACCELERATE_SCRIPT_NAME = "train_accelerate.py"
ACCELERATE_CONFIG_NAME = "accelerate.yaml"
DEEPSPEED_CONFIG_NAME = "ds_config.json"
LEARNING_RATE = 1e-4  # the scripts' AdamW (and the DeepSpeed JSON's optimizer)

# the plan's numbers and imports: every script variant starts with these
HEADER = Template('''\
"""Written by `tilefit plan`: $title.

$launch
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

STRATEGY = "$strategy"
MODEL_CONFIG = $config  # Hugging Face config (None: a factory)
FACTORY = $factory  # "package.module:function" (None: a Hugging Face model)
AUTO_CLASS = "$auto_class"
ATTENTION = "$attention"  # "auto": transformers' choice for the model class
SEQ_LEN = $seq_len
INPUT_SHAPE = $input_shape
TASK = "$task"
MICRO_BATCH = $micro_batch  # per rank
ACCUMULATION_STEPS = $accumulation
GLOBAL_BATCH = $global_batch  # MICRO_BATCH x ACCUMULATION_STEPS x world size
AUTOCAST_DTYPE = $autocast  # mixed precision's compute dtype (None: full precision)
GRAD_SCALER = $scaler
GRAD_CHECKPOINTING = $ckpt
RESHARD_AFTER_FORWARD = True
MAX_GRAD_NORM = $max_grad_norm
ZERO_GRAD_TO_NONE = $zero_grad_to_none  # zero_grad(set_to_none=...): False keeps them, zeroed
LR = $lr
LORA = $lora  # peft.LoraConfig's arguments (None: every weight trains)
LORA_BASE_DTYPE = $lora_base  # the frozen base's dtype under LoRA (the adapters stay fp32)
''')

# the model and its batches, shared by every variant (train_accelerate.py imports them)
MODEL = '''

def build_model(where, checkpointing=GRAD_CHECKPOINTING):
    """The model as planned, fp32 weights, built on ``where`` (the meta device for FSDP2)."""
    if FACTORY is not None:
        import importlib
        module, name = FACTORY.split(":")
        with where:
            return getattr(importlib.import_module(module), name)()
    import transformers
    cfg = dict(MODEL_CONFIG)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with where:
        model = getattr(transformers, AUTO_CLASS).from_config(
            config, attn_implementation=None if ATTENTION == "auto" else ATTENTION,
            dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if LORA is not None:  # load your weights before this (from_pretrained)
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(LORA_BASE_DTYPE)
    return model


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def make_batch(step, micro, device):
    """A synthetic micro-batch of MICRO_BATCH samples: replace with your data."""
    if FACTORY is not None:
        return torch.randn(MICRO_BATCH, *INPUT_SHAPE, device=device)
    if TASK == "image-cls":
        size = MODEL_CONFIG.get("image_size", 224)
        return {"pixel_values": torch.randn(MICRO_BATCH, MODEL_CONFIG.get("num_channels", 3),
                                            size, size, device=device),
                "labels": torch.zeros(MICRO_BATCH, dtype=torch.long, device=device)}
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (MICRO_BATCH, SEQ_LEN), device=device)
    labels = torch.zeros(MICRO_BATCH, dtype=torch.long, device=device) \\
        if TASK == "seq-cls" else ids.clone()
    return {"input_ids": ids, "labels": labels}


def loss_of(model, batch):
    if FACTORY is not None:
        return model(batch).float().mean()  # a stand-in: put your loss here
    return model(**batch).loss


def check_world(world):
    if world * MICRO_BATCH * ACCUMULATION_STEPS != GLOBAL_BATCH:
        raise SystemExit(f"planned for {GLOBAL_BATCH // (MICRO_BATCH * ACCUMULATION_STEPS)} "
                         f"ranks, launched on {world}: launch as many processes")


def report(record, line):
    """One rank's step: printed, and appended to <record>/rank<R>.jsonl if asked."""
    print("tilefit-step " + json.dumps(line), flush=True)
    if record:
        with open(os.path.join(record, f"rank{line['rank']}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\\n")
'''

_FSDP = '''

def layer_list(model):
    """The list of repeated blocks: FSDP2 shards each one."""
    best = None
    for mod in model.modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = list(mod.children())
            numel = sum(p.numel() for p in mod.parameters())
            if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and numel and (
                    best is None or numel > best[0]):
                best = (numel, kids)
    return [] if best is None else best[1]


def initialise(model, device):
    """FSDP2: materialise the sharded model and initialise it (load your checkpoint here,
    e.g. with torch.distributed.checkpoint)."""
    model.to_empty(device=device)
    with torch.no_grad():
        if hasattr(model, "initialize_weights"):
            model.initialize_weights()
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        for m in model.modules():  # peft's LoRA init: B at zero, the adapter a no-op at first
            if hasattr(m, "reset_lora_parameters"):
                for name in m.active_adapters:
                    m.reset_lora_parameters(name, True)


def wrap(model, device):
    if STRATEGY == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPE, reduce_dtype=torch.float32) \\
        if AUTOCAST_DTYPE is not None else MixedPrecisionPolicy()
    for block in layer_list(model):
        fully_shard(block, mp_policy=policy, reshard_after_forward=RESHARD_AFTER_FORWARD)
    fully_shard(model, mp_policy=policy, reshard_after_forward=RESHARD_AFTER_FORWARD)
    initialise(model, device)
    return model
'''

_TORCH_MAIN = '''

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--record", help="a folder: each rank appends its steps to rank<R>.jsonl")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world(world)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    where = torch.device("meta") if STRATEGY == "fsdp2" else device
    model = wrap(build_model(where), device)
    model.train()
    torch.manual_seed(1 + rank)  # each rank its own synthetic samples
    opt = make_optimizer(trainable(model))
    scaler = torch.amp.GradScaler(device.type, enabled=GRAD_SCALER)
    for step in range(args.steps):
        total = 0.0
        for micro in range(ACCUMULATION_STEPS):
            batch = make_batch(step, micro, device)
            with torch.autocast(device.type, dtype=AUTOCAST_DTYPE or torch.float32,
                                enabled=AUTOCAST_DTYPE is not None):
                loss = loss_of(model, batch) / ACCUMULATION_STEPS
            scaler.scale(loss).backward()
            total += loss.item()
        if MAX_GRAD_NORM is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=ZERO_GRAD_TO_NONE)
        report(args.record, {"rank": rank, "world_size": world, "step": step, "loss": total,
                             "micro_batch": MICRO_BATCH,
                             "accumulation_steps": ACCUMULATION_STEPS,
                             "trainable_params": sum(p.numel() for p in trainable(model))})
    # every rank done before the group goes: a rank that tears down while another still
    # finishes its last collective aborts it (gloo: "terminate called without an active
    # exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

_ACCELERATE_SCRIPT = Template('''\
"""Written by `tilefit plan`: $title, with accelerate.

Launch on $gpus GPUs:  accelerate launch --config_file $config_name $script [--steps N]
The model, its synthetic batches and the plan's numbers come from $torchrun_script beside
it. accelerate runs FSDP and multi-GPU DDP only where it finds GPUs: on CPUs,
ACCELERATE_USE_CPU=true runs the job as DDP over gloo (an FSDP config too: no FSDP on CPUs).
"""
import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from $module import (ACCUMULATION_STEPS, GRAD_CHECKPOINTING, LR, MAX_GRAD_NORM, MICRO_BATCH,
                     ZERO_GRAD_TO_NONE, build_model, check_world, loss_of, make_batch,
                     make_optimizer, report, trainable)


def sharded(model):
    """Whether every parameter is a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor
    return all(isinstance(p, DTensor) for p in model.parameters())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--record", help="a folder: each rank appends its steps to rank<R>.jsonl")
    args = ap.parse_args()
    acc = Accelerator(gradient_accumulation_steps=ACCUMULATION_STEPS)
    world = acc.num_processes
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and world == 1:
        raise SystemExit("accelerate found no GPU and runs each process alone: on CPUs launch "
                         "with ACCELERATE_USE_CPU=true (DDP over gloo)")
    check_world(world)
    fsdp = acc.distributed_type == DistributedType.FSDP
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and not fsdp:
        print(f"note: FSDP asked for, accelerate runs {acc.distributed_type.value}", flush=True)
    torch.manual_seed(0)
    # under FSDP accelerate checkpoints the blocks itself (fsdp_activation_checkpointing)
    model = build_model(torch.device("cpu"), checkpointing=GRAD_CHECKPOINTING and not fsdp)
    model.train()
    opt = make_optimizer(trainable(model))
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(1 + acc.process_index)  # each rank its own synthetic samples
    for step in range(args.steps):
        total = 0.0
        for micro in range(ACCUMULATION_STEPS):
            with acc.accumulate(model):
                loss = loss_of(model, make_batch(step, micro, acc.device))
                acc.backward(loss)  # divided by the accumulation steps
                if acc.sync_gradients and MAX_GRAD_NORM is not None:
                    acc.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                opt.step()
                opt.zero_grad(set_to_none=ZERO_GRAD_TO_NONE)
            total += loss.item() / ACCUMULATION_STEPS
        report(args.record, {"rank": acc.process_index, "world_size": world, "step": step,
                             "loss": total, "micro_batch": MICRO_BATCH,
                             "accumulation_steps": ACCUMULATION_STEPS,
                             "distributed_type": acc.distributed_type.value,
                             "dtensor_shards": sharded(model)})
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
''')


def _torch_dtype(name: str | None) -> str:
    return "None" if name is None else f"torch.{parse_dtype(name).torch_name}"


def _title(row: PlanRow, work: Workload) -> str:
    return (f"{work.name} on {row.world_size} GPUs, {row.strategy}, {row.precision}, "
            f"micro-batch {row.micro_batch} x {row.accumulation_steps} accumulation x "
            f"{row.world_size} ranks = global batch {row.global_batch}")


def _script_attention(row: PlanRow, work: Workload) -> str:
    """The script's attention: the plan's; "auto" as traced, which is SDPA where the model
    class supports it and stays "auto" (transformers' choice, eager) where it refuses SDPA
    (Gemma 2, BLOOM), whose build would fail with attn_implementation="sdpa"."""
    if row.attention != "auto":
        return row.attention
    if work.config is not None:
        from tilefit.models.hf import refuses_sdpa

        if refuses_sdpa(work.config, work.task):
            return "auto"
    return "sdpa"


def script_header(row: PlanRow, work: Workload, launch: str) -> str:
    """The scripts' common start: the docstring (``launch`` says how to run it) and the
    plan's numbers as constants."""
    assert row.strategy is not None
    prec = row.recipe.spec
    hf = work.config is not None
    config = None if not hf else {k: v for k, v in work.config.items()  # type: ignore[union-attr]
                                  if not k.startswith("_")}
    auto = ""
    if hf:
        from tilefit.models.hf import auto_class_name

        auto = auto_class_name(work.task)
    return HEADER.substitute(
        title=_title(row, work), launch=launch, strategy=row.strategy, config=repr(config),
        factory=repr(None if hf else work.name), auto_class=auto,
        attention=_script_attention(row, work),
        seq_len=repr(work.seq_len), input_shape=repr(work.input_shape), task=work.task,
        micro_batch=row.micro_batch, accumulation=row.accumulation_steps,
        global_batch=row.global_batch, autocast=_torch_dtype(prec.autocast_dtype),
        scaler=repr(prec.grad_scaler), ckpt=repr(row.grad_checkpointing),
        max_grad_norm=repr(row.recipe.max_grad_norm), lr=repr(LEARNING_RATE),
        zero_grad_to_none=repr(row.recipe.zero_grad_to_none),
        lora=repr(None if not row.peft else peft_config(work.task, row.recipe.lora)),
        lora_base=_torch_dtype(load_dtype(row) if row.peft else None))


def torchrun_script(row: PlanRow, work: Workload) -> str:
    """The plan as a training script for ``torchrun --nproc-per-node N``: FSDP2 or DDP, or
    DeepSpeed's engine for a ZeRO plan."""
    if row.strategy in ZERO_STRATEGIES:
        from tilefit.planner.launch_deepspeed import deepspeed_script

        return deepspeed_script(row, work)
    launch = (f"Launch on {row.world_size} GPUs:   torchrun --nproc-per-node {row.world_size} "
              f"{TORCHRUN_SCRIPT_NAME} [--steps N]\n(on CPUs it runs with gloo; on GPUs with "
              "NCCL, one GPU per rank). Synthetic batches by\ndefault: replace make_batch() "
              "with your data (a DistributedSampler per rank).")
    return (script_header(row, work, launch) + MODEL + optimizer_function(row) + _FSDP
            + _TORCH_MAIN)


def accelerate_script(row: PlanRow, work: Workload) -> str:
    """A minimal Accelerator training loop beside the torchrun script, whose model, batches
    and numbers it imports: ``accelerate launch --config_file accelerate.yaml`` runs it."""
    return _ACCELERATE_SCRIPT.substitute(
        title=_title(row, work), gpus=row.world_size, config_name=ACCELERATE_CONFIG_NAME,
        script=ACCELERATE_SCRIPT_NAME, torchrun_script=TORCHRUN_SCRIPT_NAME,
        module=TORCHRUN_SCRIPT_NAME.removesuffix(".py"))


def accelerate_config(row: PlanRow) -> dict[str, Any]:
    """accelerate's config file (``accelerate launch --config_file``; accelerate 1.x's schema:
    distributed_type FSDP with fsdp_version 2, or MULTI_GPU for DDP), for the GPUs planned
    for. accelerate sets FSDP2's policy from mixed_precision with reduce_dtype = param_dtype
    (16-bit gradient reduction, unlike the script's fp32) and runs the forward under
    autocast. No CPU variant: on CPUs the environment decides, not the file (use_cpu reaches
    only a single-process launch; docs/references.md, section 26)."""
    assert row.strategy in ("ddp", "fsdp2"), row.strategy
    # accelerate's mixed_precision spells the 16-bit dtypes as tilefit's dtypes do
    mixed = row.recipe.spec.autocast_dtype or "no"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
        "main_training_function": "main", "num_machines": 1,
        "num_processes": row.world_size, "mixed_precision": mixed, "rdzv_backend": "static",
        "same_network": True, "use_cpu": False,
        "distributed_type": "FSDP" if row.strategy == "fsdp2" else "MULTI_GPU",
    }
    if row.strategy == "fsdp2":
        out["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": row.grad_checkpointing}
    return out


def launch_files(row: PlanRow, work: Workload) -> dict[str, str]:
    """The files that launch ``row`` as they are, by name: the torchrun script and the
    DeepSpeed JSON always, the accelerate config and script for DDP and FSDP2 plans (a ZeRO
    plan runs DeepSpeed's engine under torchrun)."""
    from tilefit.planner.launch_deepspeed import deepspeed_config

    files = {TORCHRUN_SCRIPT_NAME: torchrun_script(row, work),
             DEEPSPEED_CONFIG_NAME: json.dumps(deepspeed_config(row), indent=2) + "\n"}
    if row.strategy not in ZERO_STRATEGIES:
        files[ACCELERATE_CONFIG_NAME] = yaml_text(accelerate_config(row)) + "\n"
        files[ACCELERATE_SCRIPT_NAME] = accelerate_script(row, work)
    return files


def yaml_text(data: dict[str, Any], indent: int = 0) -> str:
    """A flat-or-nested mapping of scalars as YAML (JSON scalars are YAML scalars)."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(yaml_text(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    return "\n".join(lines)
