"""LoRA as the user configures it: tilefit.recipe.Lora one-to-one with peft.LoraConfig (rank,
alpha, dropout, targets, DoRA, modules to save), traced with peft itself. Counts are checked
against peft's own count on the real model and by hand; DoRA's memory after the step against
LoRA's plus its magnitude vectors, and its peak against a real CPU step (MemTracker)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
peft = pytest.importorskip("peft")

from tilefit.errors import TilefitError  # noqa: E402
from tilefit.models import Workload, load_workload  # noqa: E402
from tilefit.models.lora import peft_config  # noqa: E402
from tilefit.recipe import Lora, Recipe  # noqa: E402

# a Llama-like model of 2 layers, hidden 64: q 64->64, k and v 64->32, o 64->64, gate and up
# 64->128, down 128->64 (in, out)
LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 64, 128, 4, 2, 16, 512
TINY = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            vocab_size=VOCAB)
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
          "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
LINEAR_NAMES = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


def tiny() -> Workload:
    return load_workload("llama-3.2-1b", seq_len=16).with_config(**TINY)


def hand_count(rank: int, targets: tuple[str, ...], dora: bool = False) -> int:
    """r * (in + out) per adapted layer, plus DoRA's magnitude (one per output feature)."""
    per_layer = sum(rank * (SHAPES[t][0] + SHAPES[t][1]) + (SHAPES[t][1] if dora else 0)
                    for t in targets)
    return LAYERS * per_layer


def test_lora_defaults_are_what_lora_traced_before() -> None:
    assert Lora() == Lora(16, 32, 0.0, "all-linear", False, None)
    assert Recipe(lora=True).lora == Lora()
    assert peft_config("causal-lm") == peft_config("causal-lm", Lora()) == {
        "r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear",
        "task_type": "CAUSAL_LM"}


def test_lora_maps_one_to_one_onto_peft_lora_config() -> None:
    lora = Lora(rank=8, alpha=16, dropout=0.05, targets="q_proj, v_proj", dora=True,
                modules_to_save=["lm_head"])
    assert lora.targets == ("q_proj", "v_proj") and lora.modules_to_save == ("lm_head",)
    cfg = peft_config("causal-lm", lora)
    assert cfg == {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
                   "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM",
                   "use_dora": True, "modules_to_save": ["lm_head"]}
    real = peft.LoraConfig(**cfg)  # peft takes the dict as it is
    assert (real.r, real.lora_alpha, real.use_dora) == (8, 16, True)
    assert peft_config("image-cls")["modules_to_save"] == ["classifier"]


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"rank": 0}, "--lora-rank"), ({"rank": -4}, "--lora-rank"), ({"rank": 8.5}, "--lora-rank"),
    ({"alpha": 0}, "--lora-alpha"), ({"alpha": -1.0}, "--lora-alpha"),
    ({"dropout": 1.0}, "--lora-dropout"), ({"dropout": -0.1}, "--lora-dropout"),
    ({"targets": ""}, "--lora-targets"), ({"targets": ()}, "--lora-targets"),
    ({"modules_to_save": ["lm_head", ""]}, "--modules-to-save")])
def test_bad_settings_raise_with_the_fix(kwargs: dict[str, Any], flag: str) -> None:
    # issue 44 item 6: the library's fix is in Python (the Lora field), the CLI's the flag
    from tilefit.cli.words import cli_words

    with pytest.raises(TilefitError) as err:
        Lora(**kwargs)
    fix = err.value.fix or ""
    assert f"Lora({next(iter(kwargs))}=" in fix, err.value
    assert flag in cli_words(fix) and "Lora(" not in cli_words(fix)


def test_rank_8_on_q_and_v_counts_as_peft_and_by_hand() -> None:
    from tilefit.tracing.workload_traces import trace_workload

    work, lora = tiny(), Lora(rank=8, alpha=16, targets=("q_proj", "v_proj"))
    real = peft.get_peft_model(work.build("sdpa"), peft.LoraConfig(**peft_config(work.task,
                                                                                 lora)))
    trainable, _ = real.get_nb_trainable_parameters()
    traced = trace_workload(work, Recipe(batch_size=2, precision="bf16-mixed",
                                         attention="sdpa", lora=lora), "a100-80gb")
    # 2 layers x 8 x ((64 + 64) + (64 + 32)) = 3584
    assert traced.trainable_param_count == trainable == hand_count(8, ("q_proj", "v_proj"))
    assert trainable == 3584


def test_a_target_of_no_module_lists_the_linear_layers() -> None:
    from tilefit.tracing.workload_traces import trace_workload

    recipe = Recipe(batch_size=2, precision="bf16-mixed", attention="sdpa",
                    lora=Lora(targets=("v_proj", "q_prj")))
    with pytest.raises(TilefitError, match="q_prj") as err:
        trace_workload(tiny(), recipe, "a100-80gb")
    assert LINEAR_NAMES in (err.value.expected or "")
    assert "Lora(targets=('q_proj',))" in (err.value.fix or "")


def _after_step(lora: Lora) -> int:
    """Bytes alive after the traced step: parameters, optimizer state, whatever persists."""
    from tilefit.tracing.workload_traces import trace_workload

    tr = trace_workload(tiny(), Recipe(batch_size=2, precision="bf16-mixed", attention="sdpa",
                                       lora=lora), "a100-80gb")
    return sum(s.nbytes for s in tr.storages if s.free_at is None)


def test_dora_holds_lora_memory_plus_its_magnitudes_after_the_step() -> None:
    # DoRA's weight norm runs lora_B(lora_A(eye)) and detaches it: a graph the backward never
    # runs, freed at once in a real step (issue 28: the trace held two weight-sized tensors
    # per layer). After the step DoRA holds LoRA's memory plus one fp32 magnitude per output
    # feature of each adapted layer and its two AdamW moments (AdamW's step count of each
    # magnitude tensor is a CPU tensor: torch.optim's _init_group, neither fused nor
    # capturable).
    lora, dora = _after_step(Lora(rank=8)), _after_step(Lora(rank=8, dora=True))
    magnitudes = LAYERS * sum(out for _, out in SHAPES.values())  # 2 x 512 = 1024
    extra = 4 * magnitudes + 8 * magnitudes
    assert dora == pytest.approx(lora + extra, rel=0.01)
    assert dora - lora == extra == 12_288


def test_dora_cpu_peak_matches_a_real_peft_step() -> None:
    # a second method: PyTorch's MemTracker on two real CPU steps of the peft model (the
    # trace held DoRA's weight-norm graphs: 2,880,496 bytes predicted for 2,225,136 real)
    dora = True
    import torch

    from tilefit.bench.step import real_step_peak_bytes
    from tilefit.tracing import trace

    def build() -> Any:
        torch.manual_seed(0)
        config = peft.LoraConfig(**peft_config("causal-lm", Lora(rank=8, alpha=16, dora=dora)))
        return peft.get_peft_model(tiny().build("sdpa"), config)

    ids = torch.arange(2 * 32).reshape(2, 32) % VOCAB
    batch = {"input_ids": ids, "labels": ids.clone()}
    model = build().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            foreach=False)

    real = real_step_peak_bytes(model, opt, batch, lambda m, b: m(**b).loss)
    predicted = trace(build(), batch, recipe=Recipe(batch_size=2, precision="fp32",
                                                    optimizer="adamw"), gpu="cpu")
    assert predicted.trainable_param_count == hand_count(8, tuple(SHAPES), dora)
    assert abs(predicted.peak(rounded=False)[0] - real) <= 0.001 * real


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora") / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                "max_position_embeddings": 128, **TINY}))
    return path


def test_cli_lora_flags(tiny_config: Path) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    r = CliRunner().invoke(app, ["estimate", str(tiny_config), "--batch", "2", "--seq", "16",
                                 "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets",
                                 "q_proj,v_proj", "--lora-dropout", "0.1", "--dora",
                                 "--json", "--no-ops"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["recipe"]["lora"] == {"rank": 8, "alpha": 16, "dropout": 0.1,
                                     "targets": ["q_proj", "v_proj"], "dora": True,
                                     "modules_to_save": None}
    # 3584 adapter parameters and DoRA's magnitudes: 2 x (64 + 32)
    assert out["trainable_param_count"] == hand_count(8, ("q_proj", "v_proj"), True) == 3776


@pytest.mark.parametrize(("flags", "says"), [
    (["--lora-targets", "q_prj"], LINEAR_NAMES),
    (["--lora", "--modules-to-save", "score"], LINEAR_NAMES),
    (["--lora-rank", "0"], "--lora-rank"),
    (["--lora-alpha", "-2"], "--lora-alpha"),
    (["--lora-dropout", "1"], "--lora-dropout")])
def test_cli_bad_lora_input_exits_2(tiny_config: Path, flags: list[str], says: str) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    r = CliRunner().invoke(app, ["audit", str(tiny_config), "--batch", "2", "--seq", "16",
                                 *flags])
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split()), r.output


def test_plan_rows_and_configs_carry_the_users_lora(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import tilefit.planner
    from tilefit.cli.app import app
    from tilefit.hardware import get_device
    from tilefit.planner import PlanSearch, configs, space
    from tilefit.planner.rows import PlanRow

    lora = Lora(rank=8, targets=("q_proj", "v_proj"), dora=True)
    assert PlanSearch(lora=lora).allow_lora
    specs = space.peft_recipes(get_device("a100-80gb"), "adamw", lora)
    assert specs and all(s.lora == lora for s in specs)
    row = PlanRow(recipe=specs[0], predicted_peak_memory_bytes=1, predicted_step_time_s=1.0,
                  samples_per_s=1.0, tokens_per_s=None, mfu=0.1, budget_bytes=2)
    assert configs.single_gpu_configs(row, "causal-lm")["peft_lora_config"] == {
        "r": 8, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM", "use_dora": True}
    seen: list[Any] = []

    def stop(*args: Any, search: Any = None, **kwargs: Any) -> Any:
        seen.append(search)
        raise TilefitError("stopped here", expected="-", given="-", fix="-")

    monkeypatch.setattr(tilefit.planner, "plan", stop)
    r = CliRunner().invoke(app, ["plan", "gpt2", "--global-batch", "8", "--lora-rank", "8",
                                 "--lora-targets", "c_attn", "--dora"])
    assert r.exit_code == 2 and "stopped here" in r.output, r.output
    assert seen[0].allow_lora and seen[0].lora == Lora(rank=8, targets=("c_attn",), dora=True)
