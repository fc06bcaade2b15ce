"""The planner's prose: the notes a plan carries and the reason for its choice, in words.

Pure functions of what the search found; the search decides when each is said."""

from __future__ import annotations

from tilefit.estimator.zero_step import is_zero
from tilefit.hardware import Device
from tilefit.planner import rank
from tilefit.planner.multigpu import MAX_GPUS
from tilefit.planner.rows import PlanRow
from tilefit.planner.search import Depth

FUSED_CE_UNDER_COMPILE = (
    "fused linear cross-entropy is not predicted under torch.compile "
    "(docs/references.md, section 17): recipes with both are left out")
FULL_DEPTH = "the model did not trace at fewer layers; traced at full depth"
PEFT_FACTORY = ("PEFT/LoRA is planned for Hugging Face models only (the adapters wrap "
                "their linear layers): PlanSearch(allow_lora=True, allow_quantize=True) adds no "
                "plans for a factory")
NO_SHARDED_SETUP = f"no sharded setup of up to {MAX_GPUS} GPUs fits (ZeRO-3 formula)"


def deep_model(depth: Depth, where: str | None = None) -> str:
    """Each recipe traced at a few layer counts and extrapolated; ``where``: on how many
    ranks, for a multi-GPU search."""
    traced = f"traced {where} at" if where else "traced at"
    pattern = "" if depth.period == 1 else (f" ({' and '.join(map(str, depth.traced))} "
                                            f"repeats of its {depth.period}-layer pattern)")
    return (f"deep model: each recipe {traced} {depth.layers_text(depth.traced)} of "
            f"{depth.layers} layers{pattern} and extrapolated (affine in the "
            f"{'layer' if depth.period == 1 else 'repeat'} count)")


def not_on_gpus(*, compile: bool, allow_optimizer_change: bool,
                allow_quantize: bool = False) -> list[str]:
    """Notes for the options a multi-GPU plan does not search yet (--allow-peft it does:
    LoRA on DDP and FSDP2)."""
    out = [f"{option} is not planned on several GPUs yet: ignored" for option, on in (
        ("PlanSearch(allow_quantize=True)", allow_quantize),
        ("Recipe(compile=Compile())", compile),
        ("PlanSearch(allow_optimizer_change=True)", allow_optimizer_change)) if on]
    out.append("on several GPUs other optimizers are not searched, and CPU offload only with "
               "DeepSpeed ZeRO-Offload (one GPU plans them: "
               "Recipe(parallel=Parallelism(world_size=1)))")
    return out


def over_budget(chosen: PlanRow, confirmed: PlanRow) -> str:
    """The chosen plan's full trace did not fit."""
    return (f"{chosen.recipe_label()} at micro-batch {chosen.micro_batch}: the full "
            f"trace needs {confirmed.memory_bytes / 2**30:.1f} GiB, "
            "over the budget; next plan tried")


def releasing(confirmed: PlanRow) -> str:
    """The chosen plan's full trace fits only by releasing the allocator's cache."""
    n = confirmed.steady_alloc_retries
    return (f"{confirmed.recipe_label()} at micro-batch {confirmed.micro_batch}: the full "
            "trace fits only by the caching allocator releasing its cache "
            f"({n} retr{'ies' if n > 1 else 'y'} in every step, num_alloc_retries; "
            "each release synchronizes the GPU, a cost its step time leaves out); the next "
            "plan tried, this one kept if none fits without")


def nothing_fits(device: Device, world_size: int, budget: int, global_batch: int) -> str:
    """The reason of a plan without a choice."""
    where = f"one {device.display_name}" if world_size == 1 else \
        f"{world_size} x {device.display_name}"
    return (f"nothing fits on {where} "
            f"(budget {budget / 2**30:.1f} GiB per GPU) at global batch {global_batch}")


def smallest_on_one_gpu(optimizer: str, smallest: PlanRow, budget: int,
                        state_bytes: float | None = None) -> str:
    """``smallest``: the smallest peak of the plans keeping ``optimizer`` on the GPU, over
    every micro-batch traced (policy.when_nothing_fits); ``state_bytes``: its model state,
    where that alone is over the budget."""
    plan = (f"{smallest.recipe_label()}, micro-batch {smallest.micro_batch} x "
            f"{smallest.accumulation_steps} accumulation steps")
    if state_bytes is None:
        return (f"with {optimizer} on the GPU alone nothing fits: the smallest such plan "
                f"({plan}) needs {smallest.memory_bytes / 2**30:.1f} GiB of "
                f"{budget / 2**30:.1f} GiB")
    return (f"with {optimizer} on the GPU alone nothing fits: the parameters, gradients and "
            f"optimizer state alone need {state_bytes / 2**30:.1f} GiB of "
            f"{budget / 2**30:.1f} GiB, so no micro-batch, checkpointing or fused loss "
            f"brings it under (traced: {plan}, {smallest.memory_bytes / 2**30:.1f} GiB)")


def state_over_budget(states: dict[str, float], untraced: list[str], budget: int) -> str:
    """Recipes whose model state (parameters, gradients, optimizer state) alone is over the
    budget: ``states`` (a description of each state: its bytes) were traced at their
    smallest micro-batch only; ``untraced``: the recipes keeping one of those states, not
    traced (PlanState.add)."""
    which = "; ".join(f"{what}: {b / 2**30:.1f} GiB" for what, b in states.items())
    said = (f"model state alone over the {budget / 2**30:.1f} GiB budget ({which}): such "
            "recipes were traced at their smallest micro-batch only")
    if not untraced:
        return said
    return (f"{said}, and {len(untraced)} more that keep the same state were not traced "
            f"({', '.join(untraced)})")


NOTHING_WITHOUT_ADAPTERS = "nothing fits without adapters"


def is_adapters_note(note: str) -> bool:
    """Whether ``note`` says what adapters would do (lora_would's, or PEFT_FACTORY's: none
    for a factory): the audit's way forward quotes it."""
    return note == PEFT_FACTORY or note.startswith(
        (NOTHING_WITHOUT_ADAPTERS, f"with the optimizer on the GPU {NOTHING_WITHOUT_ADAPTERS}"))


def lora_would(best: PlanRow | None, budget: int, *, offload_or_change_fits: bool,
               qlora: PlanRow | None = None) -> str:
    """Nothing fits with the full model's optimizer on the GPU and --allow-peft was not
    given: what LoRA's traced plan (``best``: the fastest that fits, else the smallest;
    None: not traced, peft missing) needs, and where that does not fit, QLoRA's (``qlora``,
    traced the same way; None: not traced). ``offload_or_change_fits``: a plan of the full
    model fits by CPU offload or another optimizer."""
    where = (f"with the optimizer on the GPU {NOTHING_WITHOUT_ADAPTERS}"
             if offload_or_change_fits else NOTHING_WITHOUT_ADAPTERS)
    if best is None:
        return (f"{where}; LoRA adapters (PlanSearch(allow_lora=True)) were not traced: "
                "pip install peft to see whether they fit")
    what = (f"LoRA adapters ({best.recipe_label()}, micro-batch {best.micro_batch}) "
            f"need {best.memory_bytes / 2**30:.1f} GiB of {budget / 2**30:.1f} GiB")
    if best.fits:
        return (f"{where}, but {what}: PlanSearch(allow_lora=True) plans them (trains "
                "adapters on a frozen base, not the model)")
    if qlora is None:
        return f"{where}, nor with LoRA adapters: {what} (PlanSearch(allow_lora=True))"
    on_4bit = (f"QLoRA ({qlora.recipe_label()}, micro-batch {qlora.micro_batch}: adapters on "
               f"a 4-bit base) needs {qlora.memory_bytes / 2**30:.1f} GiB")
    if qlora.fits:
        return (f"{where}, nor with LoRA adapters: {what}; but {on_4bit}: "
                "PlanSearch(allow_lora=True, allow_quantize=True) plans it (trains adapters on "
                "a frozen 4-bit base, not the model)")
    return f"{where}, nor with LoRA adapters: {what}; nor with QLoRA: {on_4bit}"


def nothing_traced_fits(first: int, fallback_counts: int, global_batch: int) -> str:
    return (f"nothing traced fits on {first} or the next {fallback_counts - 1} GPU counts "
            f"dividing global batch {global_batch}")


def why(row: PlanRow, rows: list[PlanRow], objective: str, allow_change: bool) -> str:
    """Why ``row`` was chosen, in one sentence."""
    fits = [r for r in rows if r.fits]
    what = ("the most samples/s" if objective == "throughput" else "the smallest peak memory")
    tiers = {0: "keeps your training algorithm on the GPU",
             1: "no plan fits with the optimizer on the GPU; CPU offload keeps the algorithm",
             2: "nothing else fits: it CHANGES THE OPTIMIZER"}
    t = rank.tier(row, allow_change)
    how = tiers[t]
    if row.changes_optimizer and allow_change:
        how = f"it changes the optimizer to {row.optimizer} (allowed)"
    if row.peft:
        how = ("it trains LoRA adapters instead of the full model (allowed by "
               "PlanSearch(allow_lora=True))")
    if row.recipe.quantize:
        how = (f"it trains LoRA adapters on a frozen {row.recipe.quantize} base instead of "
               "the full model (QLoRA, allowed by PlanSearch(allow_quantize=True))")
    gpus = f" x {row.world_size} GPUs ({row.strategy})" if row.strategy else ""
    return (f"{what} of the {len(fits)} plans that fit the budget; "
            f"{how}; micro-batch {row.micro_batch} x {row.accumulation_steps} "
            f"accumulation steps{gpus} = global batch {row.global_batch}"
            + lower_bounds(row, fits, objective))


def lower_bounds(row: PlanRow, fits: list[PlanRow], objective: str) -> str:
    """What the choice says of modelled step times (rank.modelled: a lower bound) for the
    throughput objective: a traced plan preferred to a faster bound, or a bound chosen
    because no traced plan fits."""
    if objective != "throughput":
        return ""
    if rank.modelled(row):
        return (f"; its step time is modelled (DeepSpeed {row.strategy} does not run on fake "
                "tensors), a lower bound: no traced plan of its kind fits")
    faster = [r for r in fits if rank.modelled(r) and r.samples_per_s > row.samples_per_s]
    if not faster:
        return ""
    best = max(faster, key=lambda r: r.samples_per_s)
    return (f"; DeepSpeed {best.strategy}'s {best.samples_per_s:.3g} samples/s is a modelled "
            "lower bound on its step time, not a traced time: a traced plan ranks first")


def engine_model(strategy: str | None, gpus: int) -> str:
    """How the chosen engine's figures were made, in words."""
    if is_zero(strategy):
        return (f"modelled: DeepSpeed {strategy} on {gpus} GPUs on top of one-GPU traces "
                "(DeepSpeed's engine does not run on fake tensors), its peak per GPU and its "
                "step with the communication the compute does not hide; that step time is a "
                "lower bound (DeepSpeed's bucket copies and hooks' host time are not costed): "
                "a traced engine that fits ranks before it")
    return (f"traced: rank 0 of {gpus} under {strategy} (PyTorch's fake process group), its "
            "peak per GPU and its step with the communication the compute does not hide")
