"""A DeepSpeed plan as it launches: the JSON (``ds_config.json``) and a torchrun script that
trains with DeepSpeed's engine (``deepspeed.initialize(model=..., model_parameters=...,
config=...)``, ``engine.backward``, ``engine.step``).

The JSON is what tilefit's ZeRO model assumes (``tilefit.estimator.zero``): the plan's stage,
ZeRO-Offload of the optimizer to pinned CPU memory, the bucket sizes of ``ZeroConfig``,
DeepSpeed's bf16/fp16 mode for a 16-bit recipe, gradient clipping, and train_batch_size =
micro-batch x accumulation x GPUs. Keys and where DeepSpeed reads them:
docs/references.md, section 26. A DDP or FSDP2 plan gets the closest DeepSpeed JSON
(ZeRO-0 for DDP, ZeRO-3 for FSDP2) and no DeepSpeed script.
"""

from __future__ import annotations

from string import Template
from typing import Any

from tilefit.errors import TilefitError
from tilefit.estimator.zero import DEEPSPEED_DEFAULTS, ZeroConfig
from tilefit.models import Workload
from tilefit.planner import launch
from tilefit.planner.rows import PlanRow
from tilefit.vocab import ZERO_STRATEGIES

# a plan's engine -> DeepSpeed's zero_optimization.stage
STAGES = {"ddp": 0, "fsdp2": 3, "zero1": 1, "zero2": 2, "zero3": 3}
# torch.optim's defaults, spelled out: DeepSpeed's CPU Adam defaults weight_decay to 0
ADAMW_WEIGHT_DECAY = 0.01
SGD_MOMENTUM = 0.9  # what tilefit traces for "sgd" (tilefit.planner.model_code.TORCH_OPTIMIZERS)
# optimizers DeepSpeed cannot name in its JSON: the script passes them as a client optimizer
CLIENT_OPTIMIZERS = {"adamw-8bit": "bitsandbytes.optim.AdamW8bit"}

_DS_MAIN = Template('''
DS_CONFIG = $ds_config
CLIENT_OPTIMIZER = $client  # "module.Class" built here when DS_CONFIG names none
HF_DS_CONFIG = None  # ZeRO-3, a Hugging Face model: transformers' handle on DS_CONFIG


def cast_floats(batch, dtype):
    """DeepSpeed's bf16/fp16 mode holds 16-bit weights: floating inputs follow them."""
    if dtype is None:
        return batch
    if isinstance(batch, dict):
        return {k: cast_floats(v, dtype) for k, v in batch.items()}
    return batch.to(dtype) if batch.is_floating_point() else batch


def build_partitioned(config):
    """ZeRO-3: the model built under DeepSpeed's zero.Init. A meta build first imports the
    model's modules (importing them under zero.Init, which patches torch's tensor
    constructors, fails in torch._dynamo). A Hugging Face model is built by transformers'
    own zero.Init path (HfDeepSpeedConfig): it initialises each layer's weights gathered,
    where zero.Init alone would leave them as the partitioned construction left them."""
    import deepspeed
    build_model(torch.device("meta"))
    if FACTORY is None:
        from transformers.integrations import HfDeepSpeedConfig
        global HF_DS_CONFIG  # transformers holds a weak reference: kept alive here
        HF_DS_CONFIG = HfDeepSpeedConfig(config)
        return build_model(torch.device("cpu"))
    with deepspeed.zero.Init(config_dict_or_path=config):
        return build_model(torch.device("cpu"))


def offload_device(engine):
    """Where the engine keeps the optimizer: "none", "cpu" or "nvme"."""
    device = getattr(engine.zero_offload_optimizer(), "device", "none")
    return str(getattr(device, "value", device))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--record", help="a folder: each rank appends its steps to rank<R>.jsonl")
    ap.add_argument("--ds-config", help="a DeepSpeed JSON to use instead of DS_CONFIG")
    args = ap.parse_args()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    config = DS_CONFIG
    if args.ds_config:
        with open(args.ds_config) as f:
            config = json.load(f)
    deepspeed.init_distributed()  # NCCL on GPUs, gloo on CPUs (DS_ACCELERATOR=cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world(world)
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    stage = config["zero_optimization"]["stage"]
    if stage == 3:  # each rank holds only its partition from the start
        model = build_partitioned(config)
    else:
        model = build_model(torch.device("cpu"))
    model.train()
    opt = None
    if CLIENT_OPTIMIZER is not None:
        import importlib
        module, name = CLIENT_OPTIMIZER.rsplit(".", 1)
        opt = getattr(importlib.import_module(module), name)(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           model_parameters=model.parameters(), config=config)
    half = torch.bfloat16 if config["bf16"]["enabled"] else (
        torch.float16 if config["fp16"]["enabled"] else None)
    torch.manual_seed(1 + rank)  # each rank its own synthetic samples
    for step in range(args.steps):
        total = 0.0
        for micro in range(engine.gradient_accumulation_steps()):
            batch = cast_floats(make_batch(step, micro, engine.device), half)
            loss = loss_of(engine, batch)
            engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.item() / engine.gradient_accumulation_steps()
        report(args.record, {
            "rank": rank, "world_size": world, "step": step, "loss": total,
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "accumulation_steps": engine.gradient_accumulation_steps(),
            "zero_stage": engine.zero_optimization_stage(),
            "offload_optimizer": offload_device(engine),
            "optimizer": type(engine.basic_optimizer).__name__,
            "param_dtype": str(next(engine.module.parameters()).dtype)})
    # the engine and the handles of its collectives freed while the group lives: ZeRO-3 left
    # to the interpreter's exit aborted a rank in 3 of 17 runs on 2 CPU ranks (gloo:
    # "terminate called without an active exception"), in none of 16 with this
    import gc
    engine.destroy()
    del engine, model, opt
    gc.collect()
    dist.barrier()  # every rank done before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
''')


def _optimizer(row: PlanRow) -> tuple[dict[str, Any] | None, bool]:
    """DeepSpeed's ``optimizer`` section for the plan's optimizer (None: a client optimizer)
    and whether ZeRO must be told to allow it (it lists the optimizers it has tested:
    torch's Adam and AdamW, its own Adam, Adagrad, Lion). Adam-family without offload:
    torch's own (``torch_adam``), the optimizer tilefit traced; with offload DeepSpeed's CPU
    Adam, which tilefit's offload model times."""
    name, lr = row.optimizer, launch.LEARNING_RATE
    if name in ("adamw", "adamw-fused", "adam"):
        w_mode = name != "adam"
        params: dict[str, Any] = {"lr": lr, "weight_decay": ADAMW_WEIGHT_DECAY if w_mode
                                  else 0.0, "adam_w_mode": w_mode}
        if not row.offload:
            params["torch_adam"] = True
            if name == "adamw-fused":
                params["fused"] = True
        return {"type": "AdamW" if w_mode else "Adam", "params": params}, False
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": SGD_MOMENTUM}}, True
    if name == "adafactor":
        return {"type": "Adafactor", "params": {"lr": lr}}, True
    if name in CLIENT_OPTIMIZERS:
        return None, True
    raise TilefitError(f"no DeepSpeed optimizer for {name!r}",
                       expected="adamw, adamw-fused, adam, sgd, adafactor or adamw-8bit",
                       given=name, fix="plan with Recipe(optimizer='adamw')")


def _zero_section(row: PlanRow, zero: ZeroConfig) -> dict[str, Any]:
    stage = STAGES[row.strategy or "ddp"]
    if row.strategy not in ZERO_STRATEGIES:  # DDP or FSDP2 as DeepSpeed: as it always was
        return {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    out: dict[str, Any] = {
        "stage": stage, "overlap_comm": zero.overlaps(stage), "contiguous_gradients": True,
        "reduce_bucket_size": zero.reduce_bucket_size,
        "allgather_bucket_size": zero.allgather_bucket_size}
    if stage == 3:
        out.update(stage3_prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                   stage3_max_live_parameters=zero.stage3_max_live_parameters,
                   stage3_max_reuse_distance=zero.stage3_max_reuse_distance)
    if row.offload:
        out["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return out


def deepspeed_config(row: PlanRow, zero: ZeroConfig = DEEPSPEED_DEFAULTS) -> dict[str, Any]:
    """The plan as DeepSpeed's JSON; ``zero`` the bucket sizes tilefit's model used."""
    if row.strategy not in STAGES:
        raise TilefitError("no DeepSpeed config for this engine",
                           expected=", ".join(STAGES), given=str(row.strategy),
                           fix="plan with Parallelism(world_size=...) above 1")
    half = row.recipe.spec.half_dtype
    out: dict[str, Any] = {
        "train_batch_size": row.global_batch,
        "train_micro_batch_size_per_gpu": row.micro_batch,
        "gradient_accumulation_steps": row.accumulation_steps,
        "bf16": {"enabled": half == "bf16"}, "fp16": {"enabled": half == "fp16"},
        "zero_optimization": _zero_section(row, zero),
        "gradient_clipping": row.recipe.max_grad_norm or 0.0,
    }
    if row.strategy in ZERO_STRATEGIES:
        optimizer, untested = _optimizer(row)
        if optimizer is not None:
            out["optimizer"] = optimizer
        if untested:
            out["zero_allow_untested_optimizer"] = True
            if row.offload:  # ZeRO-Offload refuses a non-DeepSpeed optimizer unless told
                out["zero_force_ds_cpu_optimizer"] = False
    return out


def deepspeed_script(row: PlanRow, work: Workload) -> str:
    """The ZeRO plan as a torchrun script training with DeepSpeed's engine, its JSON
    embedded (``--ds-config FILE`` reads another)."""
    assert row.strategy in ZERO_STRATEGIES, row.strategy
    n = row.world_size
    text = (f"Launch on {n} GPUs:   torchrun --nproc-per-node {n} "
            f"{launch.TORCHRUN_SCRIPT_NAME} [--steps N]\nDeepSpeed ZeRO-{STAGES[row.strategy]}"
            f"{' with the optimizer offloaded to the CPU' if row.offload else ''}, its config "
            f"below (the same as {launch.DEEPSPEED_CONFIG_NAME}). On CPUs:\nDS_ACCELERATOR=cpu "
            "(gloo). Synthetic batches by default: replace make_batch() with your data.\n"
            "Precision is DeepSpeed's (DS_CONFIG's bf16/fp16: 16-bit weights, fp32 master "
            "copy):\nAUTOCAST_DTYPE, GRAD_SCALER and RESHARD_AFTER_FORWARD are not used.")
    config = deepspeed_config(row)
    client = CLIENT_OPTIMIZERS.get(row.optimizer) if "optimizer" not in config else None
    return (launch.script_header(row, work, text) + launch.MODEL
            + _DS_MAIN.substitute(ds_config=repr(config), client=repr(client)))
