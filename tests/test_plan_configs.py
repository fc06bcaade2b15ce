"""A chosen plan's configs carry out the row: each snippet kind is executed on a tiny GPT-2 on
the CPU (plain PyTorch, the Trainer's, Lightning's) and the model, optimizer and arguments it
builds are checked against what the row says; the DeepSpeed JSON (deepspeed is not
installed) against the row and against transformers' own check of it. Also: the CPU memory
of an offload row, the notes of a plan where nothing fits, and how modelled (lower-bound)
step times rank against traced ones."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tilefit.planner import configs
from tilefit.planner.rows import PlanRow
from tilefit.recipe import Lora, Recipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 8
VOCAB = 96


def _row(micro: int = 2, accum: int = 2, *, offload: bool = False, step_s: float = 1.0,
         world: int = 1, strategy: str | None = None, peak: int = 1, **kw: Any) -> PlanRow:
    recipe = Recipe(batch_size=micro, accumulation_steps=accum, attention="sdpa",
                    max_grad_norm=1.0, **kw)
    g = micro * accum * world
    return PlanRow(recipe=recipe, predicted_peak_memory_bytes=peak,
                   predicted_step_time_s=step_s, samples_per_s=g / step_s, tokens_per_s=None,
                   mfu=0.0, budget_bytes=100, offload=offload, world_size=world,
                   strategy=strategy)


LORA = _row(precision="bf16-mixed", optimizer="adamw-fused", grad_checkpointing=True,
            lora=Lora(rank=4, alpha=8))
MIXED = _row(precision="bf16-mixed", optimizer="adamw-fused", grad_checkpointing=True)
PURE = _row(precision="bf16-true", optimizer="adamw")
EIGHT_BIT = _row(precision="bf16-mixed", optimizer="adamw-8bit")
OFFLOAD = _row(precision="bf16-true", optimizer="adamw-fused", grad_checkpointing=True,
               offload=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer GPT-2 (hidden 64) saved where from_pretrained(name) reads it."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                  n_positions=32)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return str(path)


def _dataset(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def _run(code: str, tiny: str, row: PlanRow) -> dict[str, Any]:
    ns: dict[str, Any] = {"name": tiny, "dataset": _dataset(row.global_batch), "lr": 1e-2}
    exec(compile(code, "<snippet>", "exec"), ns)
    return ns


def _base(model: Any) -> Any:
    """The transformers model under a peft wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_model(model: Any, row: PlanRow) -> None:
    """What the row says of the model: its weights' dtype, checkpointing, the adapters."""
    from tilefit.models.lora import lora_base_dtype

    base = _base(model)
    assert base.is_gradient_checkpointing == row.grad_checkpointing
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    if row.peft:
        import peft

        assert isinstance(model, peft.PeftModel)
        cfg = model.peft_config["default"]
        assert (cfg.r, cfg.lora_alpha) == (row.recipe.lora.rank, row.recipe.lora.alpha)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        assert not any(p.requires_grad for p in frozen)
        # the base as the tracer loads it (tilefit.models.lora), the adapters fp32
        assert {p.dtype for p in frozen} == {lora_base_dtype(row.recipe)}
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == \
            {torch.float32}
    else:
        want = {"fp32": torch.float32, "bf16": torch.bfloat16}[row.recipe.spec.param_dtype]
        assert {p.dtype for p in model.parameters()} == {want}
        assert all(p.requires_grad for p in model.parameters())


def _check_optimizer(opt: Any, model: Any, row: PlanRow) -> None:
    if row.optimizer == "adamw-8bit":
        import bitsandbytes

        assert type(opt) is bitsandbytes.optim.AdamW8bit
    else:
        want = {"adamw": (torch.optim.AdamW, None), "adamw-fused": (torch.optim.AdamW, True)}
        cls, fused = want[row.optimizer]
        assert type(opt) is cls and opt.defaults.get("fused") == fused
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in model.parameters() if p.requires_grad}


def test_plain_pytorch_snippet_runs_the_rows_loop(tiny: str) -> None:
    """The loop the plan writes is the loop it traced (issue 44 item 4): gradients cleared
    as the recipe says (zero_grad(set_to_none=False): kept, zeroed) and the loss read on the
    host after each micro-batch where it says so."""
    row = _row(precision="fp32", optimizer="adamw", zero_grad_to_none=False, loss_sync=True)
    ns = _run(configs.torch_loop(row), tiny, row)
    grads = [p.grad for p in ns["model"].parameters()]
    assert grads and all(g is not None and not g.any() for g in grads)
    assert isinstance(ns["running_loss"], float) and ns["running_loss"] > 0
    plain = configs.torch_loop(_row(precision="fp32", optimizer="adamw"))
    assert "set_to_none=True" in plain and "loss.item()" not in plain


@pytest.mark.parametrize("row", [LORA, MIXED, PURE, EIGHT_BIT],
                         ids=["lora", "mixed", "bf16-true", "adamw-8bit"])
def test_plain_pytorch_snippet_trains_the_row(tiny: str, row: PlanRow) -> None:
    ns = _run(configs.torch_loop(row), tiny, row)
    model, opt = ns["model"], ns["opt"]
    _check_model(model, row)
    _check_optimizer(opt, model, row)
    # one optimizer step ran through the checkpointed blocks: every adapter's B matrix
    # (zeros at init) moved, so the gradient reached each of them
    if row.peft:
        b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert b and all(p.abs().sum() > 0 for p in b)
        assert all(opt.state[p]["step"] == 1 for p in b)


def test_trainer_snippet_trains_the_lora_row(tiny: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the snippet's output_dir="out"
    row = LORA
    # on the CPU the Trainer wants use_cpu=True for bf16 (a GPU's run leaves it out)
    code = configs.hf_python(row).replace("output_dir='out',", "output_dir='out', use_cpu=True,")
    ns = _run(code, tiny, row)
    trainer, args = ns["trainer"], ns["args"]
    _check_model(trainer.model, row)
    hf = configs.hf_training_arguments(row)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2)
    assert args.gradient_checkpointing and args.bf16 and args.optim.value == hf["optim"]
    out = trainer.train()
    assert out.global_step == 3  # 3 epochs of one 2 x 2 step
    _check_optimizer(trainer.optimizer.optimizer, trainer.model, row)  # accelerate wraps it
    assert _base(trainer.model).is_gradient_checkpointing
    # the JSON form builds the same arguments with the real class (after training: a new
    # TrainingArguments resets accelerate's state under the Trainer)
    again = transformers.TrainingArguments(
        output_dir="out", use_cpu=True, **json.loads(configs.single_gpu_configs(
            row, "causal-lm")["hf_training_arguments_json"]))
    assert again.to_dict() == args.to_dict()


def test_lightning_snippet_builds_and_fits_the_lora_row(tiny: str) -> None:
    import lightning as L

    row = LORA
    code = configs.lightning_python(row)
    head, _, _ = code.partition("\ntrainer = ")
    ns = _run(head, tiny, row)
    module = ns["PlannedModule"](tiny)
    _check_model(module.model, row)
    _check_optimizer(module.configure_optimizers(), module.model, row)
    kwargs = configs.lightning(row)["trainer"]
    assert "trainer = L.Trainer(\n    accelerator='gpu'," in code
    trainer = L.Trainer(**{**kwargs, "accelerator": "cpu"}, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    assert trainer.accumulate_grad_batches == row.accumulation_steps
    # Lightning refuses gradient_clip_val with a fused optimizer under autocast: the module
    # clips in on_before_optimizer_step instead
    assert trainer.gradient_clip_val is None
    assert "def on_before_optimizer_step" in code and "clip_grad_norm_(" in code
    assert type(trainer.precision_plugin).__name__ == "MixedPrecision"
    assert trainer.precision_plugin.precision == "bf16-mixed"
    trainer.fit(module, ns["loader"])
    assert trainer.global_step == 1


def _trainer_mismatches(ds: dict[str, Any], args: Any) -> list[str]:
    """transformers' own check of a DeepSpeed JSON against TrainingArguments
    (HfTrainerDeepSpeedConfig.trainer_config_process, which TrainingArguments(deepspeed=...)
    runs and raises on), here without deepspeed installed: its methods on accelerate's
    HfDeepSpeedConfig, the base it has when deepspeed is."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig as Hf

    class Check(HfDeepSpeedConfig):  # type: ignore[misc]
        fill_match = vars(Hf)["fill_match"]
        fill_only = vars(Hf)["fill_only"]
        trainer_config_process = vars(Hf)["trainer_config_process"]

        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__(config)
            self._dtype = None
            self.mismatches: list[str] = []

    check = Check(ds)
    check.trainer_config_process(args)
    return check.mismatches


def test_offload_row_offloads_in_every_snippet(tiny: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from tilefit.estimator.offload import REDUCE_BUCKET_ELEMENTS

    row = OFFLOAD
    cfg = configs.single_gpu_configs(row, "causal-lm")
    ds = cfg["deepspeed"]
    # the JSON: ZeRO-2, the optimizer on the CPU with DeepSpeed's CPU AdamW, the row's batch,
    # precision, clipping and the bucket the offload model counts
    zero = ds["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"]) == (2, "cpu")
    assert zero["reduce_bucket_size"] == REDUCE_BUCKET_ELEMENTS
    assert ds["optimizer"]["type"] == "AdamW" and "torch_adam" not in ds["optimizer"]["params"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["train_batch_size"]) == (2, 2, 4)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 1.0
    # the Trainer: its arguments (less the JSON's path) build with the real class, and
    # transformers' own consistency check finds nothing the JSON contradicts
    hf = cfg["hf_training_arguments"]
    assert hf["deepspeed"] == "ds_config.json" and "optim" not in hf
    kwargs = {k: v for k, v in hf.items() if k != "deepspeed"}
    args = transformers.TrainingArguments(output_dir="out", use_cpu=True, **kwargs)
    assert _trainer_mismatches(ds, args) == []
    assert _trainer_mismatches(ds, transformers.TrainingArguments(
        output_dir="out", use_cpu=True, **{**kwargs, "learning_rate": 1e-3}))  # it can fail
    # plain PyTorch: the model as the row loads it, then DeepSpeed's engine with this JSON
    loop = cfg["pytorch_loop"]
    head, _, tail = loop.partition("import deepspeed\n")
    assert "has no optimizer offload" in head and "deepspeed.initialize(model=model" in tail
    ns = _run(head, tiny, row)
    _check_model(ns["model"], row)
    literal = next(line for line in tail.splitlines() if line.startswith("ds_config = "))
    assert ast.literal_eval(literal.split(" = ", 1)[1].split("  #")[0]) == ds
    # Lightning: the strategy Lightning registers as ZeRO-2 with the optimizer offloaded,
    # DeepSpeed's CPU Adam as that strategy asks
    light = cfg["lightning"]
    assert StrategyRegistry[light["trainer"]["strategy"]]["init_params"] == \
        {"stage": 2, "offload_optimizer": True}
    assert light["trainer"]["precision"] == "bf16-true"
    assert "DeepSpeedCPUAdam(" in cfg["lightning_python"]
    ast.parse(cfg["lightning_python"])
    ast.parse(cfg["hf_python"])


def test_offload_host_memory_is_deepspeeds_estimate() -> None:
    from tilefit.estimator.offload import offload_host_bytes

    # 7e9 parameters, AdamW's two states traced in bf16 (2 x 2 B each): DeepSpeed's
    # estimate_zero2_model_states_mem_needs(cpu_offload=True, one GPU) = 7e9 x max(4, 16)
    # x 1.5 = 168e9 B
    assert offload_host_bytes(7e9, 2 * 2 * 7e9, 2) == 168_000_000_000
    # fp32 weights (fp16-mixed's trace): the 8 B/param of state are fp32 already
    assert offload_host_bytes(7e9, 8 * 7e9, 4) == 168_000_000_000
    # SGD with momentum, 4 B/param of fp32 state: tilefit.estimator.zero puts its K = 4 + 4
    # + 4 for the 16 of DeepSpeed's Adam-only estimator: 1e9 x 12 x 1.5
    assert offload_host_bytes(1e9, 4e9, 4) == 18_000_000_000


# ---- modelled step times against traced ones ---------------------------------------------
def test_a_modelled_lower_bound_does_not_beat_a_traced_time() -> None:
    from tilefit.planner import multiplan, notes
    from tilefit.planner.rank import choose, rank

    fsdp = _row(world=8, strategy="fsdp2", step_s=1.0)
    zero3 = _row(world=8, strategy="zero3", step_s=0.8)  # faster, but a lower bound
    assert choose([zero3, fsdp], "throughput", False) is fsdp
    assert multiplan.best_fitting([zero3, fsdp]) is fsdp
    assert rank([zero3, fsdp], "throughput", False) == [fsdp, zero3]
    reason = notes.why(fsdp, [zero3, fsdp], "throughput", False)
    assert "lower bound" in reason and "zero3" in reason
    # alone, or where no traced row fits, the modelled row is chosen, and says so
    too_big = dataclasses.replace(fsdp, predicted_peak_memory_bytes=200)
    assert choose([zero3, too_big], "throughput", False) is zero3
    assert "lower bound" in notes.why(zero3, [zero3, too_big], "throughput", False)
    assert "lower bound" in notes.engine_model("zero3", 8)  # the fallback's method says it
    # memory is not a bound: the memory objective ranks it as any row
    small = dataclasses.replace(zero3, predicted_peak_memory_bytes=0)
    assert choose([small, fsdp], "memory", False) is small


# ---- a plan where nothing keeps the optimizer on the GPU ---------------------------------
@pytest.fixture()
def state(tiny: str) -> Any:
    """The planner's state for the tiny GPT-2 at global batch 8 on an A100's budget."""
    from tilefit.estimator.offload import OffloadLink
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.planner.search import depth_of
    from tilefit.planner.state import PlanState

    work = load_workload(str(Path(tiny) / "config.json"), seq_len=SEQ)
    return PlanState(work, get_device("a100-80gb"), 8, 70 * 2**30, "adamw-fused",
                     depth_of(work), OffloadLink())


def test_nothing_fits_notes_name_the_smallest_and_lora(state: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.planner import policy

    monkeypatch.setattr(policy, "_multi_gpu", lambda *a: None)  # not under test here
    # full fine-tuning rows over a 100-byte budget; micro-batch 8 x 1 the smallest
    big = [_row(1, 8, peak=300, precision="bf16-mixed", optimizer="adamw-fused"),
           _row(8, 1, peak=150, precision="bf16-mixed", optimizer="adamw-fused"),
           _row(2, 4, peak=200, precision="tf32", optimizer="adamw-fused")]
    assert policy.when_nothing_fits(state, big, "adamw-fused", True, 100,
                                    allow_peft=False) is None
    smallest, lora = state.notes[-2:]
    assert "the smallest such plan (bf16-mixed adamw-fused, micro-batch 8 x 1 " in smallest
    # LoRA traced for the note (peft itself), kept out of the plan: its rows fit 70 GiB
    assert lora.startswith("nothing fits without adapters, but LoRA adapters (")
    assert "PlanSearch(allow_lora=True) plans them" in lora
    assert not any(r.peft for r in state.rows)
    # with --allow-peft the note is not made (the plan has LoRA rows already)
    state.notes.clear()
    policy.when_nothing_fits(state, big, "adamw-fused", True, 100, allow_peft=True)
    assert not any("LoRA" in n for n in state.notes)


def test_offload_rows_carry_deepspeeds_cpu_estimate(state: Any, tiny: str) -> None:
    state.add(Recipe(precision="bf16-true", optimizer="adamw-fused", attention="sdpa"),
              offload=True)
    # DeepSpeed's estimate for AdamW on one GPU: 24 B per parameter (16 x its 1.5 buffer
    # factor), the parameters counted by transformers (GPT-2's tied head once); the traced
    # state is the allocator's (each of AdamW's 2 bf16 state tensors per parameter rounded
    # up to 512 B), widened to fp32 (x 2) and buffered (x 1.5)
    cfg = transformers.GPT2Config.from_pretrained(tiny)
    tensors = list(transformers.GPT2LMHeadModel(cfg).parameters())
    params = sum(t.numel() for t in tensors)
    rounding = 1.5 * 2 * 2 * len(tensors) * 512
    off = [r for r in state.rows if r.offload]
    assert off and all(24 * params <= r.host_memory_bytes <= 24 * params + rounding
                       for r in off)
    assert all(r.to_dict()["host_memory_bytes"] == r.host_memory_bytes for r in off)


def test_lightning_clips_a_fused_optimizer_as_its_precision_plugin_allows() -> None:
    # Lightning's mixed-precision plugin refuses gradient_clip_val with a fused optimizer
    # (the test above runs the bf16 hook); under fp16's loss scaler the hook would clip
    # scaled gradients, so the optimizer is the same update unfused, which it unscales
    fp16 = _row(precision="fp16-mixed", optimizer="adamw-fused")
    light = configs.lightning(fp16)
    assert light["trainer"]["gradient_clip_val"] == 1.0
    assert "foreach=True" in light["model"]["configure_optimizers"]
    assert "on_before_optimizer_step" not in configs.lightning_python(fp16)
    # no clipping, or an unfused optimizer: Lightning's own gradient_clip_val
    assert configs.lightning(MIXED)["trainer"]["gradient_clip_val"] is None
    assert configs.lightning(PURE)["trainer"]["gradient_clip_val"] == 1.0


def test_lightning_snippet_keeps_the_gradients_where_the_recipe_does(tiny: str) -> None:
    """Issue 44 item 4: Lightning's default zero_grad() frees the gradients; a recipe with
    zero_grad_to_none=False gets a module whose optimizer_zero_grad keeps them, zeroed, as
    the traced loop does. Run for a step in a real Trainer."""
    import lightning as L

    row = dataclasses.replace(LORA, recipe=dataclasses.replace(LORA.recipe,
                                                               zero_grad_to_none=False))
    code = configs.lightning_python(row)
    assert configs.lightning(row)["model"]["optimizer_zero_grad"] == configs.ZERO_GRAD_KEPT
    head, _, _ = code.partition("\ntrainer = ")
    ns = _run(head, tiny, row)
    module = ns["PlannedModule"](tiny)
    cleared: list[bool] = []
    planned = module.optimizer_zero_grad

    def spy(epoch: int, batch_idx: int, optimizer: Any) -> None:
        planned(epoch, batch_idx, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        cleared.append(all(p.grad is not None and not p.grad.any() for p in params))

    module.optimizer_zero_grad = spy
    trainer = L.Trainer(**{**configs.lightning(row)["trainer"], "accelerator": "cpu"},
                        max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, ns["loader"])
    # Lightning clears before each step's first micro-batch: the second time, after a step
    assert trainer.global_step == 2 and len(cleared) == 2 and cleared[1]
    assert "optimizer_zero_grad" not in configs.lightning(LORA)["model"]
