"""plan --gpus N: the multi-GPU search from traces, its bad input, and the torchrun script it
writes, launched for two steps on this machine's CPU (2 ranks, gloo)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.planner import PlanSearch
from tilefit.planner.multiplan import check_divisible, multi_depth, nearest_multiples
from tilefit.planner.search import Depth
from tilefit.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]


def test_global_batch_that_does_not_divide_names_the_nearest_valid_values() -> None:
    # 18 samples on 4 GPUs: 4 x 4 = 16 and 4 x 5 = 20 are the multiples around it; 18's
    # divisors nearest 4 are 3 and 6
    assert nearest_multiples(18, 4) == (16, 20)
    with pytest.raises(TilefitError) as err:
        check_divisible(18, 4)
    text = str(err.value)
    assert "plan(..., global_batch=16) or plan(..., global_batch=20)" in text
    assert "Parallelism(world_size=3) or Parallelism(world_size=6)" in text
    check_divisible(16, 4)  # divides: no error
    r = CliRunner().invoke(app, ["plan", "gpt2", "--global-batch", "18", "--gpus", "4"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "--global-batch 16 or --global-batch 20, or --gpus 3 or --gpus 6" \
        in out, out


def test_unknown_strategy_is_refused_before_tracing() -> None:
    r = CliRunner().invoke(app, ["plan", "gpt2", "--global-batch", "16", "--gpus", "2",
                                 "--strategy", "fsdp9"])
    assert r.exit_code == 2 and "--strategy fsdp2" in r.output


def test_fsdp2_lever_traces_two_blocks_or_more() -> None:
    # FSDP2 wraps a list of >= 2 blocks: a deep model is swept at 2 and 3 layers
    assert multi_depth(Depth("num_hidden_layers", 32, (1, 2))).traced == (2, 3)
    assert multi_depth(Depth("num_hidden_layers", 3, (1, 2))) == Depth(None, 3, (3,))


def _plan_json(args: list[str]) -> dict:  # type: ignore[type-arg]
    r = CliRunner().invoke(app, ["plan", *args, "--gpus", "2", "--strategy", "fsdp2",
                                 "--gpu", "h100", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])  # type: ignore[no-any-return]


def test_plan_on_two_gpus_and_its_torchrun_script_runs_two_steps(tmp_path: Path) -> None:
    """plan the tests' tiny factory model for 2 GPUs with FSDP2 (the CLI writes the
    configs), then run the script under torchrun on the CPU: both ranks take two steps at the
    planned micro-batch and accumulation, which multiply back to the global batch. (The
    Hugging Face scripts are launched by benchmarks/bench_plan_launch_cpu.py: transformers'
    import in each rank would double this test's time.)"""
    out = tmp_path / "launch"
    d = _plan_json(["tests.fixtures.tiny_models:mlp", "--input-shape", "32",
                    "--global-batch", "8", "--write-configs", str(out)])
    best = d["best"]
    assert d["world_size"] == 2 and best["strategy"] == "fsdp2" and best["world_size"] == 2
    assert best["micro_batch"] * best["accumulation_steps"] * 2 == 8
    assert all(p["micro_batch"] * p["accumulation_steps"] * 2 == 8 for p in d["plans"])
    fastest = max((p for p in d["plans"] if p["fits"]), key=lambda p: p["samples_per_s"])
    assert (fastest["micro_batch"], fastest["precision"]) == (best["micro_batch"],
                                                              best["precision"])
    # the chosen plan traced in full agrees with the sweep (traced at 2 micro-batches)
    c = best["confirmation"]
    assert abs(c["peak_error"]) < 0.10 and abs(c["time_error"]) < 0.10
    assert best["tokens_per_s_per_gpu"] is None  # a factory's samples are not tokens
    assert sorted(f.name for f in out.iterdir()) == [
        "accelerate.yaml", "ds_config.json", "train_accelerate.py", "train_tilefit.py"]
    yaml = (out / "accelerate.yaml").read_text()
    assert "fsdp_version: 2" in yaml and "num_processes: 2" in yaml
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["zero_optimization"]["stage"] == 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          str(out / "train_tilefit.py"), "--steps", "2", "--record",
                          str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for rank in (0, 1)
             for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
    assert sorted((s["rank"], s["step"]) for s in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["micro_batch"] == best["micro_batch"] and s["world_size"] == 2
               and s["accumulation_steps"] == best["accumulation_steps"] for s in steps)
    assert all(math.isfinite(s["loss"]) for s in steps)


def test_hf_script_builds_the_planned_model_with_the_policy() -> None:
    """The script for a Hugging Face model is Python that carries the plan: its config, the
    micro-batch and accumulation, bf16 parameters in FSDP2's policy with fp32 reduction."""
    from tilefit.models import load_workload
    from tilefit.planner.launch import torchrun_script
    from tilefit.planner.rows import PlanRow
    from tilefit.recipe import Recipe

    work = load_workload("gpt2", seq_len=32).with_config(num_hidden_layers=2)
    row = PlanRow(recipe=Recipe(batch_size=4, accumulation_steps=2, precision="bf16-mixed",
                                grad_checkpointing=True, attention="sdpa"),
                  predicted_peak_memory_bytes=1, predicted_step_time_s=1.0, samples_per_s=1.0,
                  tokens_per_s=None, mfu=0.0, budget_bytes=2, world_size=4, strategy="fsdp2")
    text = torchrun_script(row, work)
    namespace: dict[str, object] = {}
    exec(compile(text.replace('if __name__ == "__main__":', "if False:"), "t.py", "exec"),
         namespace)
    assert namespace["MICRO_BATCH"] == 4 and namespace["ACCUMULATION_STEPS"] == 2
    assert namespace["GLOBAL_BATCH"] == 4 * 2 * 4 and namespace["GRAD_CHECKPOINTING"] is True
    assert namespace["AUTO_CLASS"] == "AutoModelForCausalLM" and namespace["STRATEGY"] == "fsdp2"
    import torch

    assert namespace["AUTOCAST_DTYPE"] is torch.bfloat16
    assert namespace["MODEL_CONFIG"]["n_layer"] == 2  # type: ignore[index]
    assert "reduce_dtype=torch.float32" in text


def test_plan_searches_deepspeed_zero_and_offload_as_estimate_models_them() -> None:
    """plan --gpus 2 --strategy zero2 on the tiny MLP: ZeRO-2 with and without ZeRO-Offload,
    in DeepSpeed's bf16 mode and TF32. Each row, made by the planner's sweep (traced at
    micro-batches 1 and 4 with accumulation 2, affine between), agrees with
    tilefit.estimate(strategy="zero2") run on that row's recipe; offloading moves the
    optimizer's fp32 partition (master weights, Adam's m and v: 12 bytes per parameter)
    and the fp32 gradient partition (4 bytes) off each GPU: 16 Psi / N bytes."""
    import dataclasses

    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload
    from tilefit.planner import plan
    from tilefit.recipe import Parallelism

    work = load_workload("tests.fixtures.tiny_models:mlp", input_shape=(32,))
    p = plan(work, gpu="h100", global_batch=8,
             recipe=Recipe(parallel=Parallelism(world_size=2, strategy="zero2")),
             search=PlanSearch(confirm=False))
    assert {(r.strategy, r.precision, r.offload) for r in p.rows} == {
        ("zero2", prec, off) for prec in ("bf16-true", "tf32") for off in (False, True)}
    assert all(r.micro_batch * r.accumulation_steps * 2 == 8 for r in p.rows)
    for r in p.rows:
        recipe = dataclasses.replace(r.recipe, parallel=Parallelism(2, "zero2", r.offload))
        est = estimate_workload(work, recipe, "h100")
        assert abs(r.predicted_peak_memory_bytes / est.peak_memory_bytes - 1) < 1e-3
        assert abs(r.predicted_step_time_s / est.step_time_s - 1) < 0.10
    psi = 32 * 64 + 64 + 64 * 10 + 10  # the MLP's parameters
    by = {(r.precision, r.micro_batch, r.offload): r.predicted_peak_memory_bytes
          for r in p.rows}
    moved = by[("bf16-true", 4, False)] - by[("bf16-true", 4, True)]
    assert abs(moved - 16 * psi / 2) <= 1024  # two of the allocator's 512-byte blocks
    # CPU memory per node, DeepSpeed's estimate_zero2_model_states_mem_needs: with offload
    # Psi x max(4 N, 16) x 1.5, its 16 bytes per parameter being 8 + Adam's state (here the
    # traced state on the GPU, AdamW's 8 bytes per parameter: its step counters are CPU
    # tensors, torch.optim's _init_group), without Psi x 4 x GPUs per node x 1.5 (N = 2)
    host = {r.offload: r.host_memory_bytes for r in p.rows if r.precision == "bf16-true"}
    assert host == {True: round(16 * psi * 1.5), False: round(psi * 4 * 2 * 1.5)}
    assert any("modelled" not in n and "ZeRO-Offload" in n for n in p.notes)


def test_zero_strategy_names_are_accepted_and_checked() -> None:
    from tilefit.planner.multiplan import engines_of, strategies_for, zero_recipe
    from tilefit.recipe import Recipe

    assert strategies_for("ZeRO3", 4) == ("zero3",)
    assert [(e.strategy, e.offload) for e in engines_of(("ddp", "zero1", "zero3"), 4)] == [
        ("ddp", False), ("zero1", False), ("zero3", False), ("zero3", True)]
    assert zero_recipe(Recipe(precision="bf16-mixed")).precision == "bf16-true"  # type: ignore[union-attr]
    assert zero_recipe(Recipe(precision="fp16-mixed")).precision == "fp16-true"  # type: ignore[union-attr]
    assert zero_recipe(Recipe(precision="tf32")).precision == "tf32"  # type: ignore[union-attr]
    assert zero_recipe(Recipe(precision="fp8-mixed")) is None
    r = CliRunner().invoke(app, ["plan", "gpt2", "--global-batch", "16", "--gpus", "2",
                                 "--strategy", "zero4"])
    assert r.exit_code == 2 and "--strategy" in r.output


def test_the_fallback_skips_ddp_only_where_its_rows_could_not_fit_or_show() -> None:
    """The multi-GPU fallback leaves DDP untraced where the model state every DDP rank holds
    (one GPU's traced parameters, gradients and AdamW state) is over the budget and enough
    other rows fit to fill what it shows: the shown rows are those of the full search. The
    premise is checked on real traces: every traced DDP row needs at least that state."""
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.planner.multiplan import MultiSpace, search_rows
    from tilefit.planner.rank import rank
    from tilefit.planner.search import sweep
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import shared_traces

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # a GPT-2 whose weights outweigh its activations (FSDP2 fits where DDP does not)
    work = load_workload("gpt2", seq_len=32).with_config(
        num_hidden_layers=2, n_embd=512, n_head=8, vocab_size=1024, bos_token_id=0,
        eos_token_id=0)
    dev = get_device("h100")
    recipe = Recipe(precision="bf16-mixed", optimizer="adamw", attention="sdpa")
    depth = Depth(None, 2, (2,))
    with shared_traces():
        one = sweep(work, recipe.with_batch(1, 1), [1, 4], depth, dev).samples[0]
        state = one.parameters_bytes + one.gradients_bytes + one.optimizer_state_bytes
        # fp32 weights, gradients, AdamW's m and v: 16 bytes per parameter (and the
        # allocator's rounding of each tensor)
        assert 16 * one.param_count <= state <= 16 * one.param_count * 1.01

        def search(budget: int, shown: int | None) -> tuple[list, int, list[str]]:  # type: ignore[type-arg]
            said: list[str] = []
            setup = MultiSpace(2, ("ddp", "fsdp2"), (recipe,), depth,
                               replica_state_bytes=state, shown=shown)
            rows, n = search_rows(work, dev, 8, budget, "adamw", setup, lambda r: r, [],
                                  said)
            return rows, n, said

        full, n_full, _ = search(round(state) - 1, None)
        ddp = [r for r in full if r.strategy == "ddp"]
        assert ddp and all(r.predicted_peak_memory_bytes >= state and not r.fits for r in ddp)
        fitting = sum(r.fits for r in full)
        assert fitting >= 2
        cut, n_cut, said = search(round(state) - 1, fitting)
        assert [r for r in full if r.strategy != "ddp"] == cut and n_cut == n_full - 2
        assert rank(cut, "throughput", False)[:fitting] == \
            rank(full, "throughput", False)[:fitting]
        assert said and "ddp on 2 GPUs was not traced" in said[0]
        # too few rows fit to fill what is shown, or a budget the state is under: traced
        assert search(round(state) - 1, fitting + 1)[0] == full
        assert search(round(state), fitting)[0] == \
            search(round(state), None)[0]


def test_lora_is_searched_on_ddp_and_fsdp2_not_on_zero() -> None:
    """--allow-peft on several GPUs: LoRA (the one-GPU plan's adapters, with and without
    checkpointing) beside full fine-tuning for a Hugging Face model, never for a factory;
    DeepSpeed ZeRO is given no LoRA recipe (its model does not partition a frozen base)."""
    from tilefit.hardware import get_device
    from tilefit.planner.multiplan import PEFT_NOT_ON_ZERO, multi_recipes, zero_recipe
    from tilefit.planner.space import peft_recipes
    from tilefit.recipe import Lora, Recipe

    h100 = get_device("h100")
    lora = Lora(rank=8, targets=("q_proj", "v_proj"))
    hf = multi_recipes(h100, "adamw", hf_model=True, lora=lora)
    assert [r for r in hf if r.peft] == peft_recipes(h100, "adamw", lora)
    assert {(r.lora, r.grad_checkpointing) for r in hf if r.peft} == {(lora, False),
                                                                     (lora, True)}
    assert not [r for r in multi_recipes(h100, "adamw", hf_model=False, lora=lora) if r.peft]
    assert zero_recipe(Recipe(precision="bf16-mixed", lora=lora)) is None
    assert zero_recipe(Recipe(precision="bf16-mixed")) is not None
    assert "ddp and fsdp2" in PEFT_NOT_ON_ZERO


def test_a_lora_plan_on_two_gpus_ranks_lora_rows(tmp_path: Path) -> None:
    """A tiny Llama planned on 2 GPUs under DDP with --allow-peft: its LoRA rows are traced,
    their peak below the full fine-tuning rows' at the same micro-batch (no gradients or
    optimizer state for the frozen base). Their scripts: tests/test_plan_launch.py, and
    benchmarks/bench_plan_launch_cpu.py launches them on 2 CPU ranks."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 128, "max_position_embeddings": 64}))
    r = CliRunner().invoke(app, ["plan", str(config), "--seq", "16", "--global-batch", "2",
                                 "--gpus", "2", "--strategy", "ddp", "--gpu", "h100",
                                 "--allow-peft", "--lora-rank", "8", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    lora = [p for p in d["plans"] if p["peft"]]
    full = [p for p in d["plans"] if not p["peft"] and p["precision"] == lora[0]["precision"]]
    assert lora and all(p["strategy"] == "ddp" for p in lora)
    for p in lora:
        same = [f for f in full if (f["micro_batch"], f["grad_checkpointing"]) ==
                (p["micro_batch"], p["grad_checkpointing"])]
        peak = "predicted_peak_memory_bytes"
        assert same and p[peak] < same[0][peak]
    assert not any("--allow-peft is not planned" in n for n in d["notes"])
