"""The launch files of a multi-GPU plan beyond the torchrun script (tests/test_plan_gpus.py):
the DeepSpeed JSON and script of a ZeRO plan, checked against DeepSpeed's documented schema
and, where DeepSpeed is installed (TILEFIT_DEEPSPEED_DIR, installed apart as
benchmarks/bench_zero_cpu.py says), launched on 2 CPU ranks; the accelerate config and
script, launched on 2 CPU ranks through accelerate's own FSDP2 path
(docs/references.md, section 26)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tilefit.errors import TilefitError
from tilefit.estimator.zero import DEEPSPEED_DEFAULTS
from tilefit.models import Workload, load_workload
from tilefit.planner.launch import (
    ACCELERATE_CONFIG_NAME,
    ACCELERATE_SCRIPT_NAME,
    DEEPSPEED_CONFIG_NAME,
    TORCHRUN_SCRIPT_NAME,
    launch_files,
)
from tilefit.planner.launch_deepspeed import deepspeed_config
from tilefit.planner.rows import PlanRow
from tilefit.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
# DeepSpeed 0.19.8's documented keys (deepspeed.ai/docs/config-json; pydantic models
# runtime/zero/config.py DeepSpeedZeroConfig and runtime/zero/offload_config.py, which forbid
# any other key)
TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "bf16", "fp16", "zero_optimization", "gradient_clipping", "optimizer",
            "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"}
ZERO_KEYS = {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size",
             "allgather_bucket_size", "stage3_prefetch_bucket_size",
             "stage3_max_live_parameters", "stage3_max_reuse_distance", "offload_optimizer"}
OFFLOAD_KEYS = {"device", "pin_memory"}


def _row(strategy: str | None, *, precision: str = "bf16-mixed", offload: bool = False,
         optimizer: str = "adamw", micro: int = 2, accumulation: int = 2) -> PlanRow:
    return PlanRow(recipe=Recipe(batch_size=micro, accumulation_steps=accumulation,
                                 precision=precision, optimizer=optimizer, attention="sdpa",
                                 max_grad_norm=1.0),
                   predicted_peak_memory_bytes=1, predicted_step_time_s=1.0, samples_per_s=1.0,
                   tokens_per_s=None, mfu=0.0, budget_bytes=2, world_size=2, strategy=strategy,
                   offload=offload)


def _mlp() -> Workload:
    return load_workload("tests.fixtures.tiny_models:mlp", input_shape=(32,))


@pytest.mark.parametrize(("strategy", "offload", "precision"),
                         [("zero1", False, "fp32"), ("zero2", False, "bf16-mixed"),
                          ("zero3", False, "bf16-mixed"), ("zero2", True, "fp16-mixed")])
def test_zero_json_is_the_modelled_config(strategy: str, offload: bool, precision: str) -> None:
    cfg = deepspeed_config(_row(strategy, precision=precision, offload=offload))
    zero = cfg["zero_optimization"]
    stage = int(strategy[-1])
    assert set(cfg) <= TOP_KEYS and set(zero) <= ZERO_KEYS
    assert cfg["train_batch_size"] == 2 * 2 * 2  # micro x accumulation x GPUs
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 2)
    assert cfg["bf16"]["enabled"] is (precision == "bf16-mixed")
    assert cfg["fp16"]["enabled"] is (precision == "fp16-mixed")
    assert cfg["gradient_clipping"] == 1.0
    # the buckets and overlap tilefit's ZeRO model assumed: DeepSpeed's defaults
    assert zero["stage"] == stage and zero["overlap_comm"] is (stage == 3)
    assert zero["reduce_bucket_size"] == DEEPSPEED_DEFAULTS.reduce_bucket_size == 500_000_000
    assert zero["allgather_bucket_size"] == DEEPSPEED_DEFAULTS.allgather_bucket_size
    assert ("stage3_prefetch_bucket_size" in zero) is (stage == 3)
    if stage == 3:
        assert zero["stage3_prefetch_bucket_size"] == 50_000_000
        assert zero["stage3_max_live_parameters"] == 1_000_000_000
    assert cfg["optimizer"]["type"] == "AdamW"
    params = cfg["optimizer"]["params"]
    assert params["lr"] == 1e-4 and params["weight_decay"] == 0.01
    if offload:  # DeepSpeed's CPU Adam steps the offloaded partition: no torch_adam
        assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
        assert set(zero["offload_optimizer"]) <= OFFLOAD_KEYS and "torch_adam" not in params
    else:  # torch's AdamW, the optimizer tilefit traced
        assert "offload_optimizer" not in zero and params["torch_adam"] is True


def test_ddp_and_fsdp2_keep_their_closest_deepspeed_stage() -> None:
    assert deepspeed_config(_row("fsdp2"))["zero_optimization"] == {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    assert deepspeed_config(_row("ddp"))["zero_optimization"]["stage"] == 0
    assert "optimizer" not in deepspeed_config(_row("ddp"))


def test_optimizers_deepspeed_has_not_tested_are_allowed_explicitly() -> None:
    sgd = deepspeed_config(_row("zero2", optimizer="sgd", offload=True))
    assert sgd["optimizer"] == {"type": "SGD", "params": {"lr": 1e-4, "momentum": 0.9}}
    assert sgd["zero_allow_untested_optimizer"] is True
    assert sgd["zero_force_ds_cpu_optimizer"] is False  # ZeRO-Offload would refuse it
    adam = deepspeed_config(_row("zero1", optimizer="adam"))["optimizer"]
    assert adam["type"] == "Adam" and adam["params"]["adam_w_mode"] is False


def test_one_gpu_row_has_no_deepspeed_launch() -> None:
    with pytest.raises(TilefitError) as err:
        deepspeed_config(_row(None))
    assert "Parallelism(world_size=...) above 1" in str(err.value)


def test_zero_plan_writes_a_deepspeed_script_carrying_its_json() -> None:
    files = launch_files(_row("zero3", offload=True), _mlp())
    assert set(files) == {TORCHRUN_SCRIPT_NAME, DEEPSPEED_CONFIG_NAME}  # no accelerate
    text = files[TORCHRUN_SCRIPT_NAME]
    namespace: dict[str, Any] = {}
    exec(compile(text.replace('if __name__ == "__main__":', "if False:"), "t.py", "exec"),
         namespace)
    assert namespace["DS_CONFIG"] == json.loads(files[DEEPSPEED_CONFIG_NAME])
    assert namespace["DS_CONFIG"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert (namespace["MICRO_BATCH"], namespace["ACCUMULATION_STEPS"]) == (2, 2)
    assert "deepspeed.initialize(model=model" in text and "engine.backward(loss)" in text
    assert set(launch_files(_row("fsdp2"), _mlp())) == {
        TORCHRUN_SCRIPT_NAME, DEEPSPEED_CONFIG_NAME, ACCELERATE_CONFIG_NAME,
        ACCELERATE_SCRIPT_NAME}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}


def _steps(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(record.glob("rank*.jsonl"))
            for line in f.read_text().splitlines()]


def _write(files: dict[str, str], out: Path) -> None:
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)


def _deepspeed_dir() -> str | None:
    where = os.environ.get("TILEFIT_DEEPSPEED_DIR")
    if not where:
        return None
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": where, "DS_ACCELERATOR": "cpu"})
    return where if probe.returncode == 0 else None


def test_zero3_script_runs_two_steps_under_deepspeed(tmp_path: Path) -> None:
    """DeepSpeed's engine reads the JSON (its pydantic models forbid unknown keys) and each
    rank trains at the planned micro-batch, accumulation and stage."""
    where = _deepspeed_dir()
    if where is None:
        pytest.skip("DeepSpeed not importable from TILEFIT_DEEPSPEED_DIR")
    out = tmp_path / "ds"
    _write(launch_files(_row("zero3"), _mlp()), out)
    env = _env(DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] += os.pathsep + where
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          TORCHRUN_SCRIPT_NAME, "--steps", "2", "--record", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=out)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = _steps(tmp_path)
    assert sorted((s["rank"], s["step"]) for s in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all((s["micro_batch"], s["accumulation_steps"], s["zero_stage"], s["world_size"])
               == (2, 2, 3, 2) and s["param_dtype"] == "torch.bfloat16" for s in steps)


def test_accelerate_fsdp2_config_shards_on_two_cpu_ranks(tmp_path: Path) -> None:
    """accelerate launch with the written YAML and script, the CPU answering accelerate's
    device detection as a GPU node (tests/fixtures/accelerate_as_gpu.py): accelerate's own
    FSDP2 path shards every parameter as a DTensor on both ranks."""
    from accelerate.commands.config.config_args import load_config_from_file

    out = tmp_path / "acc"
    _write(launch_files(_row("fsdp2", precision="fp32"), _mlp()), out)
    loaded = load_config_from_file(str(out / ACCELERATE_CONFIG_NAME))
    assert loaded.fsdp_config["fsdp_version"] == 2 and loaded.num_processes == 2
    # --main_process_port 0: a free port, which accelerate picks (its default is a fixed
    # 29500, which ignores PET_MASTER_PORT: a run just before, or beside on another worker,
    # could still hold it, and rank 0's store then aborted: "terminate called without an
    # active exception")
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          ACCELERATE_CONFIG_NAME, "--num_processes", "2",
                          "--main_process_port", "0",
                          str(ROOT / "tests" / "fixtures" / "accelerate_as_gpu.py"),
                          ACCELERATE_SCRIPT_NAME, "--steps", "2", "--record", str(tmp_path)],
                         env=_env(), capture_output=True, text=True, timeout=600, cwd=out)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = _steps(tmp_path)
    assert sorted((s["rank"], s["step"]) for s in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["distributed_type"] == "FSDP" and s["dtensor_shards"] and s["world_size"] == 2
               and (s["micro_batch"], s["accumulation_steps"]) == (2, 2) for s in steps)


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128,
        "max_position_embeddings": 128}


@pytest.mark.parametrize(("model_type", "attention"), [("gemma2", "auto"), ("llama", "sdpa")])
def test_script_keeps_auto_attention_where_the_class_refuses_sdpa(
        tmp_path: Path, model_type: str, attention: str) -> None:
    """Gemma 2 refuses SDPA (transformers raises a ValueError for attn_implementation="sdpa"):
    its "auto" plan keeps "auto" and the script's model builds (eager); Llama takes SDPA."""
    import runpy

    import torch

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": model_type, **TINY}))
    work = load_workload(str(config), seq_len=16)
    row = dataclasses.replace(_row("ddp"), recipe=dataclasses.replace(
        _row("ddp").recipe, attention="auto"))
    script = tmp_path / TORCHRUN_SCRIPT_NAME
    script.write_text(launch_files(row, work)[TORCHRUN_SCRIPT_NAME])
    assert f'ATTENTION = "{attention}"' in script.read_text()
    built = runpy.run_path(str(script))["build_model"](torch.device("meta"), False)
    assert built.config._attn_implementation == ("eager" if attention == "auto" else "sdpa")


def test_a_lora_row_script_applies_peft_with_b_at_zero(tmp_path: Path) -> None:
    """A LoRA row's script: peft's LoraConfig as planned on the model it builds, the frozen
    base in the autocast dtype and the adapters in fp32 (as traced: models.lora), the
    planned optimizer (fused AdamW) over the adapters only; FSDP2's initialise (the model
    materialised from the meta device) starts every adapter as peft does, B at zero, so the
    first step is the base model's. The plan's JSON carries the same LoraConfig."""
    import runpy

    import torch

    from tilefit.recipe import Lora

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY}))
    work = load_workload(str(config), seq_len=16)
    base = _row("fsdp2", optimizer="adamw-fused")
    row = dataclasses.replace(base, recipe=dataclasses.replace(
        base.recipe, lora=Lora(rank=4, targets=("q_proj", "v_proj"))))
    script = tmp_path / TORCHRUN_SCRIPT_NAME
    script.write_text(launch_files(row, work)[TORCHRUN_SCRIPT_NAME])
    space = runpy.run_path(str(script))
    assert space["LORA"]["r"] == 4 and space["LORA"]["target_modules"] == ["q_proj", "v_proj"]
    from tilefit.planner.configs import multi_gpu_configs

    assert multi_gpu_configs(row, work)["peft_lora_config"] == space["LORA"]  # --json's
    model = space["build_model"](torch.device("meta"), False)
    # rank 4 on q (64 -> 2 heads x 32) and v (64 -> 1 KV head x 32) of 2 layers
    assert sum(p.numel() for p in space["trainable"](model)) == 2 * 4 * (64 + 64 + 64 + 32)
    assert {p.dtype for p in space["trainable"](model)} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    space["initialise"](model, torch.device("cpu"))
    named = dict(model.named_parameters())
    b = [t for n, t in named.items() if "lora_B" in n]
    a = [t for n, t in named.items() if "lora_A" in n]
    assert len(b) == 4 and all(bool((t == 0).all()) for t in b)
    assert all(bool(t.abs().sum() > 0) for t in a)
    # the planned optimizer, as the one-GPU snippets build it, over the adapters
    opt = space["make_optimizer"](space["trainable"](model))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 2 * 4 * 224


@pytest.mark.parametrize("to_none", [True, False])
def test_launch_scripts_clear_gradients_as_the_recipe_says(tmp_path: Path, to_none: bool) -> None:
    """Issue 44 item 4: the torchrun and accelerate scripts clear the gradients as the row's
    recipe does (zero_grad(set_to_none=False) keeps them allocated, zeroed), not always as
    PyTorch's default."""
    import runpy

    row = _row("ddp", precision="fp32")
    row = dataclasses.replace(row, recipe=dataclasses.replace(row.recipe,
                                                              zero_grad_to_none=to_none))
    files = launch_files(row, _mlp())
    script = tmp_path / TORCHRUN_SCRIPT_NAME
    script.write_text(files[TORCHRUN_SCRIPT_NAME])
    assert runpy.run_path(str(script))["ZERO_GRAD_TO_NONE"] is to_none
    for name in (TORCHRUN_SCRIPT_NAME, ACCELERATE_SCRIPT_NAME):
        calls = [line.strip() for line in files[name].splitlines() if ".zero_grad(" in line]
        assert calls == ["opt.zero_grad(set_to_none=ZERO_GRAD_TO_NONE)"]
