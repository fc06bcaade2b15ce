"""The public API: one Recipe describes a step, Python and the CLI give the same numbers, a
user's own module gets the findings and plans its config gets, the old keywords still work
(with a warning naming the new spelling), and no public function takes more than eight
parameters."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tilefit
from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.recipe import Compile, Lora, Parallelism, Recipe
from tilefit.tracing.workload_traces import shared_traces

# a 2-layer GPT-2 small enough to audit in seconds: the same code path as the catalog's
TINY_GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2,
             "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 1000}
SEQ = 64


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_GPT2))
    return path


def _cli_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _findings(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    return [(f["rule"], round(f["predicted_speedup"], 9)) for f in rows]


def test_python_audit_and_the_cli_give_the_same_step_to_the_byte(tiny_config: Path) -> None:
    # `tilefit audit CONFIG` and tilefit.audit(CONFIG) both take Recipe.for_model's defaults
    # (the HF Trainer's loop: fused AdamW, clipping at 1.0, the loss read each micro-batch);
    # a 2-layer GPT-2 config goes through the same code as the catalog's gpt2, in seconds.
    # One scope: a step both ask for is traced once (tests/test_shared_traces.py: a shared
    # trace costs as a fresh one does); a step only one asks for is traced apart and differs
    with shared_traces():
        cli = _cli_json("audit", str(tiny_config), "--batch", "2", "--seq", str(SEQ))
        py = tilefit.audit(str(tiny_config), 2, seq_len=SEQ).to_dict()
    assert py["estimate"]["step_time_s"] == cli["estimate"]["step_time_s"]
    assert py["estimate"]["peak_memory_bytes"] == cli["estimate"]["peak_memory_bytes"]
    assert py["recipe"] == cli["recipe"]
    assert (py["recipe"]["optimizer"], py["recipe"]["max_grad_norm"],
            py["recipe"]["loss_sync"]) == ("adamw-fused", 1.0, True)
    assert _findings(py["findings"]) == _findings(cli["findings"])


def test_python_estimate_and_the_cli_agree_on_gpt2() -> None:
    cli = _cli_json("estimate", "gpt2", "--batch", "2", "--seq", str(SEQ), "--no-ops")
    py = tilefit.estimate(tilefit.load_workload("gpt2", seq_len=SEQ), 2).to_dict(
        include_ops=False)
    for key in ("step_time_s", "peak_memory_bytes", "memory_breakdown", "flops"):
        assert py[key] == cli[key], key
    assert cli["recipe"]["optimizer"] == "adamw-fused" and py["optimizer"] == "adamw-fused"


def _tiny_module() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = {k: v for k, v in TINY_GPT2.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(**config))


def _tokens(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def test_a_built_module_is_audited_as_its_config(tiny_config: Path) -> None:
    # (a factory building one is planned as its config: the plan test below)
    # the same findings the CLI gives on the module's config.json, batch and memory
    # what-ifs included (they re-trace the model, which tilefit rebuilds from its config)
    cli = _cli_json("audit", str(tiny_config), "--batch", "4", "--seq", str(SEQ))
    module = tilefit.audit(_tiny_module(), _tokens(4)).to_dict()
    assert _findings(module["findings"]) == _findings(cli["findings"])
    assert module["estimate"]["step_time_s"] == cli["estimate"]["step_time_s"]
    assert module["estimate"]["peak_memory_bytes"] == cli["estimate"]["peak_memory_bytes"]


def test_plan_takes_a_factory_as_its_config(tiny_config: Path) -> None:
    # a global batch of 1: one micro-batch, one trace per recipe (the rows still differ by
    # precision, attention and checkpointing); the factory's plan is its config's
    search = tilefit.PlanSearch(confirm=False)
    named = tilefit.plan(str(tiny_config), global_batch=1, seq_len=SEQ, search=search)
    factory = tilefit.plan(_tiny_module, _tokens(1), global_batch=1, search=search)
    rows = [(r.micro_batch, r.precision, r.predicted_step_time_s) for r in named.rows]
    assert len(rows) > 1
    assert [(r.micro_batch, r.precision, r.predicted_step_time_s) for r in factory.rows] == rows
    with pytest.raises(TilefitError, match="rebuilds the model"):
        tilefit.plan(torch.nn.Linear(4, 4), torch.zeros(2, 4), global_batch=8)


def test_every_recipe_field_reaches_the_traced_step() -> None:
    # each setting shows in what the trace records: clipping as a clip_grad phase, the loss
    # read as loss_check, accumulation as micro-batches, the optimizer's own kernels
    def build() -> torch.nn.Module:
        return torch.nn.Linear(32, 32)

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum()

    plain = tilefit.trace(build, torch.zeros(4, 32), loss_fn=loss, gpu="a100-80gb",
                          recipe=Recipe(precision="fp32", optimizer="sgd"))
    full = tilefit.trace(build, torch.zeros(4, 32), loss_fn=loss, gpu="a100-80gb",
                         recipe=Recipe(precision="fp32", optimizer="adamw-fused",
                                       max_grad_norm=0.5, loss_sync=True,
                                       accumulation_steps=3))
    phases = {op.phase for op in full.ops_of_step(1)}
    assert {"clip_grad", "loss_check"} <= phases
    assert not {"clip_grad", "loss_check"} & {op.phase for op in plain.ops_of_step(1)}
    assert full.accumulation_steps == 3
    assert any("_fused_adamw" in op.op for op in full.ops_of_step(1))
    assert plain.precision == full.precision == "fp32"


def test_recipe_for_model_uses_each_framework_s_defaults() -> None:
    hf = Recipe.for_model("gpt2", batch_size=4)
    assert (hf.optimizer, hf.max_grad_norm, hf.loss_sync, hf.batch_size) == \
        ("adamw-fused", 1.0, True, 4)
    assert Recipe.for_model(_tiny_module()).optimizer == "adamw-fused"
    plain = Recipe.for_model(torch.nn.Linear(2, 2))
    assert (plain.optimizer, plain.max_grad_norm, plain.loss_sync) == ("adamw", None, False)
    # an explicit None (--max-grad-norm none) is kept, not replaced by the default
    assert Recipe.for_model("gpt2", max_grad_norm=None).max_grad_norm is None

    def needs_values() -> torch.nn.Module:  # .item() has no value on the meta device
        torch.ones(1).item()
        return torch.nn.Linear(2, 2)

    # the factory is built on meta to see what it is; one that cannot be is not taken for a
    # Hugging Face model (its own error comes from the trace, which runs it on fake tensors)
    assert Recipe.for_model(needs_values).optimizer == "adamw"


def test_recipe_groups_and_validates_once() -> None:
    r = Recipe(compile=True, lora=True, parallel=Parallelism(8, "fsdp2"))
    assert r.compile == Compile("default") and r.lora == Lora() and r.parallel.engine == "fsdp2"
    assert Recipe(compile="reduce-overhead").compile_mode == "reduce-overhead"
    assert Parallelism(world_size=4).engine == "fsdp2" and Parallelism().engine is None
    with pytest.raises(TilefitError, match="did you mean adamw-8bit"):
        Recipe(optimizer="adam8bit")
    with pytest.raises(TilefitError, match=r"unknown torch\.compile mode"):
        Compile("max-autotune-typo")
    with pytest.raises(TilefitError, match="ZeRO only"):
        Parallelism(world_size=2, strategy="ddp", offload=True)
    with pytest.raises(TilefitError, match="whole number >= 1"):
        Recipe(batch_size=0)
    with pytest.raises(TilefitError, match="not both"):
        Recipe(fused_ce=True, compile=True)
    assert Recipe().on(tilefit.get_device("v100")).precision == "fp16-mixed"
    assert Recipe().on(tilefit.get_device("h100")).precision == "bf16-mixed"
    assert Recipe().to_dict()["compile"] is None
    assert Recipe(compile=True).to_dict()["compile"] == {"mode": "default",
                                                          "graph_breaks": False}


PUBLIC = ("trace", "estimate", "audit", "plan", "tune", "noise_scale", "analyze_gemm",
          "analyze_linear", "get_device", "load_workload", "estimate_trace")


@pytest.mark.parametrize("name", PUBLIC)
def test_no_public_function_takes_more_than_eight_parameters(name: str) -> None:
    params = [p for p in inspect.signature(getattr(tilefit, name)).parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(params) <= 8, f"tilefit.{name} takes {len(params)}: {[p.name for p in params]}"


def test_recipe_and_its_parts_are_exported() -> None:
    for name in ("Recipe", "Compile", "Parallelism", "Lora", "ZeroConfig", "PlanSearch"):
        assert name in tilefit.__all__ and getattr(tilefit, name) is not None
