"""Which module an op is attributed to (compat.modules.ModulePath, the recorder) and the
estimate's per-module table (Estimate.modules): deterministic, each op to the module whose
forward or backward issued it, the rows adding up to the step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tilefit
from tilefit import Recipe
from tilefit.estimator import Estimate, estimate_recipe
from tilefit.estimator.result import EXPOSED_COMMUNICATION, HOST_WAIT, OUTSIDE_MODULES
from tilefit.hardware import get_device
from tilefit.models import load_workload
from tilefit.recipe import Parallelism

HIDDEN, HEADS, KV_HEADS, INTER, SEQ, BATCH = 64, 4, 2, 128, 32, 2
KV_DIM = HIDDEN // HEADS * KV_HEADS  # 32: k_proj and v_proj have the same shape
TOKENS = SEQ * BATCH
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
         "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "vocab_size": 256, "max_position_embeddings": 64}
PSEUDO = {HOST_WAIT, EXPOSED_COMMUNICATION}


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return path


def _estimate(config: Path, world_size: int = 1) -> Estimate:
    device = get_device("h100")
    parallel = Parallelism(world_size=world_size, strategy="fsdp2" if world_size > 1 else None)
    work = load_workload(str(config), seq_len=SEQ)
    recipe = Recipe.for_model(work, batch_size=BATCH, parallel=parallel).on(device)
    return estimate_recipe(work, None, recipe, device)


@pytest.fixture(scope="module")
def one_gpu(llama_config: Path) -> Estimate:
    return _estimate(llama_config)


def _table(est: Estimate) -> dict[str, list[float]]:
    return {m.module: [m.time_s, m.flops, m.bytes, m.ops] for m in est.modules}


def test_gqa_projections_get_their_own_flops_by_hand(one_gpu: Estimate) -> None:
    flops = {m.module: m.flops for m in one_gpu.modules}
    attn = "model.layers.0.self_attn."
    # forward 2 T d_in d_out, backward twice that (the input's and the weight's gradients)
    assert flops[attn + "q_proj"] == 6 * TOKENS * HIDDEN * HIDDEN
    assert flops[attn + "k_proj"] == flops[attn + "v_proj"] == 6 * TOKENS * HIDDEN * KV_DIM
    assert flops[attn + "o_proj"] == 6 * TOKENS * HIDDEN * HIDDEN
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert flops[f"model.layers.1.mlp.{proj}"] == 6 * TOKENS * HIDDEN * INTER
    gemm_s: Counter[str] = Counter()
    for c in one_gpu.ops:
        if c.record.kind == "gemm":
            gemm_s[c.record.module] += c.time_s
    assert gemm_s[attn + "k_proj"] == gemm_s[attn + "v_proj"] > 0  # same GEMMs, same time


def test_two_processes_give_the_same_table(llama_config: Path, one_gpu: Estimate) -> None:
    """Module names hash differently in another process (PYTHONHASHSEED): the table may not
    depend on a set's order."""
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from pathlib import Path; import test_modules_attribution as t; "
            f"print(json.dumps(t._table(t._estimate(Path({str(llama_config)!r})))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}, check=True, timeout=300)
    table = json.loads(out.stdout.splitlines()[-1])
    assert table == _table(one_gpu)
    attn = "model.layers.1.self_attn."
    assert table[attn + "q_proj"][1] == 6 * TOKENS * HIDDEN * HIDDEN
    assert table[attn + "k_proj"][1] == table[attn + "v_proj"][1] == 6 * TOKENS * HIDDEN * KV_DIM


def _flops_by_module(model: Any, batch: Any, loss_fn: Any) -> Counter[str]:
    tr = tilefit.trace(model, batch, recipe=Recipe(optimizer="sgd"), gpu="cpu",
                       loss_fn=loss_fn)
    out: Counter[str] = Counter()
    for op in tr.ops_of_step(1):
        out[op.module] += op.flops
    return out


def test_a_no_op_dropout_gets_no_ops_its_neighbours_backward_stays_theirs() -> None:
    """Dropout(p=0) returns its input: ModTracker's hooks left it "running" for the rest of
    the backward, which then went to it."""
    n, d_in, d_hid, d_out = 4, 8, 16, 4

    def model() -> nn.Module:
        return nn.Sequential(OrderedDict(
            up=nn.Linear(d_in, d_hid), dropout=nn.Dropout(0.0), skip=nn.Identity(),
            down=nn.Linear(d_hid, d_out)))

    flops = _flops_by_module(model, torch.empty(n, d_in, device="meta"),
                             lambda m, x: m(x).sum())
    assert "dropout" not in flops and "skip" not in flops  # no op at all: they run none
    assert flops["up"] == 4 * n * d_in * d_hid  # forward and weight gradient (input: no grad)
    assert flops["down"] == 6 * n * d_hid * d_out


def test_phi3_residual_dropout_runs_nothing(tmp_path: Path) -> None:
    cfg = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
           "resid_pdrop": 0.0, "pad_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tr = tilefit.trace(load_workload(str(tmp_path / "config.json"), seq_len=16),
                       recipe=Recipe(batch_size=1), gpu="h100")
    dropouts = {op.module for op in tr.ops_of_step(1) if "dropout" in op.module}
    assert not dropouts
    mlp = Counter(op.module for op in tr.ops_of_step(1) if op.phase == "backward")
    assert mlp["model.layers.0.mlp.down_proj"] > 0 and mlp["model.layers.0.self_attn.o_proj"] > 0


def _check_adds_up(est: Estimate) -> None:
    total = sum(m.time_s for m in est.modules)
    assert total == pytest.approx(est.step_time_s, rel=0.01)
    compute = sum(c.time_s * c.repeats for c in est.ops if c.record.kind != "collective")
    assert sum(m.time_s for m in est.modules if m.module not in PSEUDO) == \
        pytest.approx(compute, rel=1e-9)


def test_rows_add_up_to_the_step_on_one_gpu(one_gpu: Estimate) -> None:
    _check_adds_up(one_gpu)
    rows = {m.module for m in one_gpu.modules}
    assert "(outside modules)" not in rows
    # a Hugging Face model computes its loss in its own forward; the HF Trainer's loop clips
    assert {OUTSIDE_MODULES["forward"], OUTSIDE_MODULES["backward"],
            OUTSIDE_MODULES["optimizer"]} <= rows
    loss = [c for c in one_gpu.ops if "nll_loss" in c.record.op]
    assert loss and all(c.record.module == "" for c in loss)


def test_rows_add_up_to_the_step_on_eight_gpus_with_fsdp2(llama_config: Path) -> None:
    est = _estimate(llama_config, world_size=8)
    assert est.parallel is not None and est.parallel.exposed_communication_s > 0
    _check_adds_up(est)
    exposed = {m.module: m.time_s for m in est.modules}[EXPOSED_COMMUNICATION]
    assert exposed == est.parallel.exposed_communication_s
