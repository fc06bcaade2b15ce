"""LoRA plans trace the peft library itself: peft.get_peft_model(model, LoraConfig(**the
config the plan emits)). The traced trainable parameter count is checked against peft's own
count on a real CPU model and against r * (in + out) summed over the wrapped layers."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
peft = pytest.importorskip("peft")

from tilefit.errors import TilefitError  # noqa: E402
from tilefit.models import Workload, load_workload  # noqa: E402
from tilefit.models.lora import LORA_RANK, peft_config  # noqa: E402
from tilefit.planner import PlanSearch  # noqa: E402
from tilefit.recipe import Lora  # noqa: E402

# Tiny configs: 2 layers, hidden 64, so that the real CPU model and its traces take ~1 s.
TINY = {
    "gpt2": dict(num_hidden_layers=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64),
    "llama-3.2-1b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=512),
}


def tiny(name: str) -> Workload:
    return load_workload(name, seq_len=16).with_config(**TINY[name])


def hand_lora_count(name: str, **changes: int) -> int:
    """r * (in + out) for each layer peft's "all-linear" wraps (the output head excluded), of
    the TINY config with ``changes``."""
    c = {**TINY[name], **changes}
    if name == "gpt2":  # Conv1D: c_attn d -> 3d, attn.c_proj d -> d, c_fc d -> 4d, c_proj 4d -> d
        d = c["n_embd"]
        shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
    else:
        d, i = c["hidden_size"], c["intermediate_size"]
        q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
        shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, i), (d, i), (i, d)]
    return c["num_hidden_layers"] * sum(LORA_RANK * (n_in + n_out) for n_in, n_out in shapes)


WRAPPED = {"gpt2": {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"},
           "llama-3.2-1b": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                            "mlp.down_proj"}}


def traced_trainable(work: Workload) -> int:
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    spec = Recipe(batch_size=2, precision="bf16-mixed", attention="sdpa", lora=True)
    return trace_workload(work, spec, "a100-80gb").trainable_param_count


@pytest.mark.parametrize("name", sorted(TINY))
def test_traced_trainable_count_is_peft_count(name: str) -> None:
    work = tiny(name)
    real = peft.get_peft_model(work.build("sdpa"), peft.LoraConfig(**peft_config(work.task)))
    trainable, _ = real.get_nb_trainable_parameters()
    assert traced_trainable(work) == trainable == hand_lora_count(name)


@pytest.mark.parametrize("name", sorted(TINY))
def test_peft_wraps_every_linear_but_the_head_on_a_16_bit_base(name: str) -> None:
    import torch

    from tilefit.models.lora import build_lora_model

    model = build_lora_model(tiny(name), "sdpa", torch.bfloat16)
    wrapped = {n for n, m in model.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert {".".join(n.split(".")[-2:]) for n in wrapped} == WRAPPED[name]
    assert len(wrapped) == TINY[name]["num_hidden_layers"] * len(WRAPPED[name])
    assert not any("lm_head" in n for n in wrapped)
    for n, p in model.named_parameters():  # peft froze the base; cast_floating made it 16-bit
        assert (p.dtype, p.requires_grad) == ((torch.float32, True) if "lora_" in n
                                              else (torch.bfloat16, False)), n


def test_task_type_follows_the_task() -> None:
    assert peft_config("causal-lm")["task_type"] == "CAUSAL_LM"
    assert peft_config("seq-cls")["task_type"] == "SEQ_CLS"
    assert peft_config("masked-lm")["task_type"] is None
    assert peft_config("image-cls")["modules_to_save"] == ["classifier"]


def test_lora_plan_emits_the_config_it_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.planner import plan

    seen: list[dict[str, Any]] = []
    real_get = peft.get_peft_model

    def spy(model: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        # before the call: peft rewrites target_modules="all-linear" into the layer names
        seen.append({k: getattr(config, k) for k in peft_config("causal-lm")})
        return real_get(model, config, *args, **kwargs)

    monkeypatch.setattr(peft, "get_peft_model", spy)
    # 35 M parameters, most of them in the (tied) embedding: LoRA's frozen 16-bit base saves
    # ~14 B each (0.4 GiB), more than the memory objective's tie (1% of the budget); a 24 GB
    # Ampere card: no fp8 rows to trace (compiled, the slowest traces); global batch 1: one
    # micro-batch, so each recipe is traced once, not at two micro-batches; one layer (the
    # same rows and best plan as two, each trace shorter)
    work = tiny("llama-3.2-1b").with_config(hidden_size=512, intermediate_size=1024,
                                            num_attention_heads=8, head_dim=64,
                                            vocab_size=64000, num_hidden_layers=1)
    p = plan(work, gpu="rtx-3090", global_batch=1,
             search=PlanSearch(objective="memory", confirm=False, allow_lora=True))
    assert p.best is not None and p.best.peft
    # LoRA eager and, on a GPU, compiled (torchtune's default), each with and without
    # checkpointing; on the CPU no compiled variant is searched
    lora_rows = {(r.grad_checkpointing, r.recipe.compile is not None) for r in p.rows if r.peft}
    assert lora_rows == {(False, False), (True, False), (False, True), (True, True)}
    from tilefit.hardware import get_device
    from tilefit.planner import space

    assert space.compiled(get_device("cpu"), [p.best.recipe]) == []
    emitted = p.configs["peft_lora_config"]
    assert seen and all(s == emitted for s in seen)
    assert emitted == {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                       "target_modules": "all-linear", "task_type": "CAUSAL_LM"}


def test_allow_peft_without_peft_says_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app
    from tilefit.planner import plan

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(TilefitError, match="pip install peft"):
        plan(tiny("gpt2"), gpu="a100-80gb", global_batch=8, search=PlanSearch(allow_lora=True))
    r = CliRunner().invoke(app, ["plan", "gpt2", "--gpu", "a100-80gb", "--global-batch", "8",
                                 "--allow-peft"])
    assert r.exit_code == 2 and "pip install peft" in r.output, r.output
    r = CliRunner().invoke(app, ["estimate", "gpt2", "--gpu", "a100-80gb", "--lora"])
    assert r.exit_code == 2 and "pip install peft" in r.output and "--lora" in r.output, r.output


@pytest.mark.parametrize("name", sorted(TINY))
def test_estimate_with_peft_traces_the_lora_model(name: str) -> None:
    # Recipe(lora=True) through estimate_workload (tilefit estimate --lora) traces the same
    # peft model as the plan: the adapters alone are trainable, and AdamW keeps its two fp32
    # moments (8 bytes per adapter parameter; each adapter matrix is a multiple of 512 bytes)
    # for them alone; its step counts are CPU tensors (torch.optim's _init_group: on the
    # parameter's device only when fused or capturable), not in the GPU's memory.
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.recipe import Recipe

    work = tiny(name)
    lora = Recipe(batch_size=2, precision="bf16-mixed", attention="sdpa", lora=True)
    est = estimate_workload(work, lora, "a100-80gb")
    full = estimate_workload(work, Recipe(batch_size=2, precision="bf16-mixed",
                                          attention="sdpa"), "a100-80gb")
    assert est.trainable_param_count == hand_lora_count(name) < est.param_count
    assert full.trainable_param_count == full.param_count
    assert est.param_count == full.param_count + hand_lora_count(name)
    assert est.memory_breakdown["optimizer_state"] == 8 * hand_lora_count(name)


def test_estimate_lora_flag_and_a_factory_model() -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app
    from tilefit.cli.words import cli_words
    from tilefit.tracing.workload_traces import check_lora

    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--gpu", "a10", "--lora",
                                      "--batch", "1", "--seq", "128"])
    assert result.exit_code == 0, result.output
    # Llama-3.2-1B: 16 layers x 16 x (q 2048+2048, k and v 2048+512, o 2048+2048, gate and
    # up 2048+8192, down 8192+2048) = 11,272,192 adapter parameters
    assert "(11.27 M trainable)" in result.output
    # a plain nn.Module factory has no linear layers peft knows to wrap: a clear error
    factory = Workload(name="mine:model", task="module", config=None, seq_len=None,
                       input_shape=(8,))
    with pytest.raises(TilefitError, match="LoRA") as err:
        check_lora(factory)
    assert "Recipe(lora=None)" in (err.value.fix or "")
    assert "drop --lora" in cli_words(err.value.fix or "")


def test_audit_and_fused_loss_with_peft() -> None:
    # audit(peft=True) audits the LoRA step and re-traces its what-ifs with the adapters on;
    # the fused loss unwraps the peft model to the transformers model its adapters sit in
    # (it raised AttributeError on the PeftModel's output).
    from tilefit.advise import audit
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.recipe import Recipe

    # one layer: the audit's what-ifs re-traced with the adapters on, as on two, in half the ops
    work = tiny("llama-3.2-1b").with_config(num_hidden_layers=1)
    result = audit(work, gpu="a100-80gb",
                   recipe=Recipe(batch_size=2, precision="bf16-mixed", lora=Lora()))
    assert result.estimate.trainable_param_count == hand_lora_count("llama-3.2-1b",
                                                                    num_hidden_layers=1)
    fused = estimate_workload(work, Recipe(batch_size=2, precision="bf16-mixed",
                                           attention="sdpa", lora=True, fused_ce=True),
                              "a100-80gb")
    assert fused.trainable_param_count == hand_lora_count("llama-3.2-1b", num_hidden_layers=1)
    assert any(o.record.op.startswith("tilefit.ce_grad_") for o in fused.ops)
    with pytest.raises(TilefitError, match="peft"):
        import torch

        audit(torch.nn.Linear(4, 4), torch.randn(2, 4), gpu="a100-80gb", recipe=Recipe(lora=Lora()))


def test_lora_base_dtype_follows_the_precision() -> None:
    # Under autocast the frozen base is loaded in the autocast dtype; without autocast (fp32)
    # it stays fp32, since a 16-bit base could not take fp32 activations in a real run.
    import torch

    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models.lora import lora_base_dtype
    from tilefit.recipe import Recipe

    assert lora_base_dtype(Recipe(precision="bf16-mixed", lora=True)) == torch.bfloat16
    assert lora_base_dtype(Recipe(precision="fp16-mixed", lora=True)) == torch.float16
    assert lora_base_dtype(Recipe(precision="fp32", lora=True)) == torch.float32
    work = tiny("llama-3.2-1b")
    full = estimate_workload(work, Recipe(batch_size=2, precision="fp32", attention="sdpa"),
                             "a100-80gb")
    lora = estimate_workload(work, Recipe(batch_size=2, precision="fp32", attention="sdpa",
                                          lora=True), "a100-80gb")
    # every weight fp32, the adapters' 4 bytes each added to the base's
    assert lora.memory_breakdown["parameters"] >= full.memory_breakdown["parameters"] + \
        4 * hand_lora_count("llama-3.2-1b")
