"""A plan row: one recipe at one micro-batch, with its predicted memory and time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tilefit.recipe import Recipe


@dataclass(frozen=True)
class PlanRow:
    recipe: Recipe  # micro-batch, accumulation steps, precision, optimizer, ...
    predicted_peak_memory_bytes: int  # tensors only; the budget already excludes overhead
    predicted_step_time_s: float  # one optimizer step (all micro-batches)
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    budget_bytes: int
    offload: bool = False
    changes_optimizer: bool = False  # a different training algorithm than the user's
    fuses_optimizer: bool = False  # the user's optimizer as its fused kernel (same update)
    changes: tuple[str, ...] = field(default=())  # what it changes about training, in words
    friendly: bool = True  # micro-batch a multiple of 8 or a power of two
    world_size: int = 1  # GPUs of a data-parallel job (the micro-batch is one rank's)
    strategy: str | None = None  # its engine (a vocab.STRATEGIES name); None on one GPU
    # CPU memory per node the engine needs (DeepSpeed ZeRO: its own estimator's figure,
    # ZeRO-Offload's optimizer state included); None where not modelled
    host_memory_bytes: int | None = None
    # the host memory per node that figure is judged against (planner.host: the training
    # machine's RAM); None: not judged
    host_budget_bytes: int | None = None
    # what the caching allocator reserves at the peak (tensors + fragmentation, its replay,
    # tilefit.estimator.reserved); None where no reserved model applies (CPU offload, a
    # modelled DeepSpeed engine): the allocated peak decides there
    predicted_reserved_bytes: int | None = None
    # cudaMalloc retries per step after the allocator released its cache
    # (ReservedMemory.steady_alloc_retries): known from a full trace only (the chosen
    # plan's confirmation), 0 on the affine rows
    steady_alloc_retries: int = 0

    @property
    def micro_batch(self) -> int:
        return self.recipe.batch_size

    @property
    def accumulation_steps(self) -> int:
        return self.recipe.accumulation_steps

    @property
    def precision(self) -> str:
        return self.recipe.precision

    @property
    def optimizer(self) -> str:
        return self.recipe.optimizer

    @property
    def grad_checkpointing(self) -> bool:
        return self.recipe.grad_checkpointing

    @property
    def attention(self) -> str:
        return self.recipe.attention

    @property
    def peft(self) -> bool:
        return self.recipe.peft

    @property
    def global_batch(self) -> int:
        return self.recipe.global_batch * self.world_size

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens_per_s / self.world_size

    @property
    def memory_bytes(self) -> int:
        """What decides whether the row fits: the reserved peak where it is modelled, else
        the allocated peak."""
        if self.predicted_reserved_bytes is None:
            return self.predicted_peak_memory_bytes
        return self.predicted_reserved_bytes

    @property
    def fits_gpu(self) -> bool:
        """Whether the GPU's memory holds it (the budget: the GPU's less what the step's
        tensors cannot use)."""
        return self.memory_bytes <= self.budget_bytes

    @property
    def fits_host(self) -> bool:
        """Whether the host's memory holds the CPU memory it needs (true where either is
        unknown)."""
        return self.host_memory_bytes is None or self.host_budget_bytes is None or \
            self.host_memory_bytes <= self.host_budget_bytes

    @property
    def fits(self) -> bool:
        """Whether it fits the GPU and the host: what the ranking and the choice use."""
        return self.fits_gpu and self.fits_host

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.memory_bytes

    def recipe_label(self) -> str:
        return recipe_label(self.recipe, offload=self.offload, strategy=self.strategy,
                            world_size=self.world_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch, "accumulation_steps": self.accumulation_steps,
            "precision": self.precision, "optimizer": self.optimizer,
            "grad_checkpointing": self.grad_checkpointing, "attention": self.attention,
            "peft": self.peft, "quantize": self.recipe.quantize, "offload": self.offload,
            "world_size": self.world_size,
            "strategy": self.strategy, "host_memory_bytes": self.host_memory_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
            "predicted_peak_memory_bytes": self.predicted_peak_memory_bytes,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "headroom_bytes": self.headroom_bytes,
            "steady_alloc_retries": self.steady_alloc_retries,
            "predicted_step_time_s": self.predicted_step_time_s,
            "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu, "fits": self.fits, "changes_optimizer": self.changes_optimizer,
            "fuses_optimizer": self.fuses_optimizer,
            "changes": list(self.changes),
        }


def recipe_label(recipe: Recipe, *, offload: bool = False, strategy: str | None = None,
                 world_size: int = 1) -> str:
    """A recipe in the plan table's words: its precision, optimizer and flags."""
    parts = [] if strategy is None else [f"{strategy} x{world_size}"]
    parts += [recipe.precision, str(recipe.optimizer)]
    if recipe.fused_ce:  # the loss's logits never whole: the label must say so
        parts.append("fused-ce")
    if recipe.compile is not None:
        mode = recipe.compile.mode
        parts.append("compiled" if mode == "default" else f"compiled {mode}")
    if recipe.grad_checkpointing:
        parts.append("ckpt")
    if recipe.attention not in ("auto", "sdpa"):
        parts.append(recipe.attention)
    if recipe.peft:
        parts.append("lora")
    if recipe.quantize:
        parts.append(recipe.quantize)
    if offload:
        parts.append("offload")
    return " ".join(parts)
