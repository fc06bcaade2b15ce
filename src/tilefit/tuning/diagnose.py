"""Why not even a batch of 1 fits: the persistent state against the budget, and what would
shrink it (tune's error when its search finds nothing)."""

from __future__ import annotations

from tilefit.errors import TilefitError
from tilefit.tuning.executor import Executor
from tilefit.tuning.request import TuneRequest
from tilefit.vocab import mixed_precision

# the mixed precision to suggest: bf16 autocast (tilefit.vocab)
MIXED = mixed_precision("bf16").name


def gib(nbytes: int) -> str:
    """Bytes in GiB, with the exact count where two decimals would read 0.00."""
    if nbytes >= 0.01 * 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**30:.2g} GiB ({nbytes:,} B)"


# What `tilefit plan` needs to rank every way of shrinking a step (its --global-batch is
# required; other optimizers and LoRA are ranked only when allowed).
PLAN_COMMAND = ("tilefit plan MODEL --gpu GPU --global-batch N --allow-optimizer-change "
                "--allow-peft")
PLAN_FIX = (f"`{PLAN_COMMAND}` ranks precisions, optimizers, gradient checkpointing, LoRA "
            "and offload by what fits")


def nothing_fits(ex: Executor, request: TuneRequest) -> TilefitError:
    """Why not even a batch of 1 fits: the persistent state alone exceeds the budget (say
    how much, and what would shrink it), or what it leaves is too little for one sample."""
    from tilefit.tuning.predict import persistent_state

    state = persistent_state(ex.local, ex.make_batch, loss_fn=ex.loss_fn,
                             optimizer=ex.optimizer, recipe=request.recipe,
                             device=request.device)
    budget = ex.budget_bytes
    of = "" if ex.capacity_bytes is None or budget == ex.capacity_bytes else \
        f" = {1 - request.margin:.0%} of {gib(ex.capacity_bytes)}"
    opt = ("optimizer state unknown (the step could not be traced)"
           if state.optimizer_state_bytes is None else
           f"optimizer state {gib(state.optimizer_state_bytes)} ({state.optimizer_source})")
    parts = (f"parameters and buffers {gib(state.parameters_bytes)} + gradients "
             f"{gib(state.gradients_bytes)} + {opt} = {gib(state.total_bytes)}")
    if budget is not None and state.total_bytes > budget:
        return TilefitError(
            f"the model's persistent state alone, {gib(state.total_bytes)}, exceeds the "
            f"memory budget of {gib(budget)}{of}: no batch can fit",
            expected="parameters, gradients and optimizer state within the budget, with "
            "room left for a batch's activations",
            given=parts,
            fix="a device with more memory, a lighter optimizer (tune(..., optimizer='sgd'), "
            "'adafactor' or 'adamw-8bit': less optimizer state), bf16 weights (tune(..., "
            "precision='bf16'): half the parameters, gradients and state), or LoRA; "
            f"{PLAN_FIX}")
    room = "" if budget is None else f", leaving {gib(budget - state.total_bytes)} of " \
        f"the {gib(budget)} budget{of}"
    return TilefitError(
        "not even a batch of 1 fits in the memory budget",
        expected="a step at batch 1 (its activations, and the optimizer step's temporaries) "
        "within the memory the persistent state leaves",
        given=f"batch size 1 ran out of memory; persistent state {parts}{room}",
        fix=f"gradient checkpointing, mixed precision (tune(..., precision={MIXED!r})), "
        "shorter samples (load_workload(..., seq_len=...) for a named model) or a smaller "
        f"TuneSearch(margin=...); {PLAN_FIX}")
