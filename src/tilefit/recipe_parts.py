"""The grouped parts of a Recipe (tilefit.recipe): ``Compile`` (torch.compile's mode and graph
breaks), ``Parallelism`` (GPUs, engine, offload, DeepSpeed's ``ZeroConfig`` buckets) and
``Lora`` (adapters as peft.LoraConfig takes them), each validated in its constructor.

Torch-free, like tilefit.vocab, whose names it uses and never re-maps.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilefit.errors import TilefitError
from tilefit.vocab import DEFAULT_STRATEGY, STRATEGIES, ZERO_STRATEGIES, check_compile_mode


def whole(value: object, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


@dataclass(frozen=True)
class Compile:
    """The forward and backward as torch.compile (Inductor) runs them; the optimizer step
    stays eager (tilefit.tracing.compiled)."""

    mode: str = "default"  # a vocab.CompileMode; "reduce-overhead" replays CUDA graphs
    graph_breaks: bool = False  # run Dynamo over the step first and list its graph breaks

    def __post_init__(self) -> None:
        check_compile_mode(self.mode, True)


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's zero_optimization settings that size buffers and collectives, at their
    defaults (deepspeed/runtime/zero/config.py, DeepSpeed 0.19.8); sizes in elements."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, True at stage 3 only

    def overlaps(self, stage: int) -> bool:
        return stage == 3 if self.overlap_comm is None else self.overlap_comm


DEEPSPEED_DEFAULTS = ZeroConfig()


@dataclass(frozen=True)
class Parallelism:
    """Data parallelism: ``world_size`` GPUs, one rank each, under ``strategy`` (ddp and
    fsdp2 traced under PyTorch's fake process group; zero1-3 DeepSpeed ZeRO, modelled on the
    one-GPU trace). The recipe's micro-batch is each rank's."""

    world_size: int = 1
    strategy: str | None = None  # None: one GPU, or DEFAULT_STRATEGY (fsdp2) on several
    offload: bool = False  # ZeRO-Offload: the optimizer and its state on the CPU
    zero: ZeroConfig = DEEPSPEED_DEFAULTS  # your DeepSpeed config's bucket sizes

    def __post_init__(self) -> None:
        if not whole(self.world_size, 1):
            raise TilefitError("the world size must be a whole number of GPUs >= 1",
                               expected="1, 2, 4, 8, ...", given=repr(self.world_size),
                               fix="pass Parallelism(world_size=8): the number of GPUs")
        if self.strategy is not None:
            key = str(self.strategy).strip().lower()
            if key not in (*STRATEGIES, *ZERO_STRATEGIES):
                raise TilefitError(
                    f"unknown data-parallel strategy {self.strategy!r}",
                    expected="one of " + ", ".join(STRATEGIES) + " (traced) or "
                    + ", ".join(ZERO_STRATEGIES) + " (DeepSpeed ZeRO, modelled)",
                    given=repr(self.strategy), fix="pass Parallelism(strategy='fsdp2') (sharded), "
                    "Parallelism(strategy='ddp') (replicated) or Parallelism(strategy='zero2') "
                    "(DeepSpeed ZeRO-2)")
            object.__setattr__(self, "strategy", key)
        if self.offload and self.strategy not in ZERO_STRATEGIES:
            raise TilefitError(
                "offload of the optimizer to the CPU is modelled for DeepSpeed ZeRO only",
                expected="strategy zero1, zero2 or zero3 with offload",
                given=f"offload with strategy {self.strategy!r}",
                fix="pass Parallelism(strategy='zero2', offload=True), or "
                "Parallelism(offload=False)")

    @property
    def engine(self) -> str | None:
        """The strategy that runs: the given one, fsdp2 on several GPUs without one, None on
        one GPU without one."""
        if self.strategy is None and self.world_size > 1:
            return DEFAULT_STRATEGY
        return self.strategy


ONE_GPU = Parallelism()


# peft's target_modules for every linear layer but the output head
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Lora:
    """LoRA adapters on a frozen base, one-to-one with peft.LoraConfig: rank (r), alpha
    (lora_alpha), dropout (lora_dropout), targets (target_modules: "all-linear" or module
    names such as ("q_proj", "v_proj")), dora (use_dora), modules_to_save (trained in full).
    The defaults are the rank-16, alpha-32 adapters on every linear layer but the output head
    that `tilefit plan --allow-peft` proposes (tilefit.models.lora)."""

    rank: int = 16  # peft's r
    alpha: float = 32  # peft's lora_alpha
    dropout: float = 0.0  # peft's lora_dropout
    targets: str | tuple[str, ...] = ALL_LINEAR  # peft's target_modules
    dora: bool = False  # peft's use_dora: weight-decomposed LoRA, a magnitude per output
    modules_to_save: tuple[str, ...] | None = None  # peft's modules_to_save

    def __post_init__(self) -> None:
        if not whole(self.rank, 1):
            raise TilefitError("the LoRA rank must be a whole number >= 1",
                               expected="e.g. 8, 16 or 64", given=repr(self.rank),
                               fix="pass Lora(rank=16)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not self.alpha > 0:
            raise TilefitError("the LoRA alpha must be a number > 0",
                               expected="e.g. twice the rank (32 for rank 16)",
                               given=repr(self.alpha),
                               fix="pass Lora(alpha=32)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:
            raise TilefitError("the LoRA dropout must be a probability in [0, 1)",
                               expected="e.g. 0.0 or 0.05", given=repr(self.dropout),
                               fix="pass Lora(dropout=0.05)")
        object.__setattr__(self, "targets", _lora_targets(self.targets))
        if self.modules_to_save is not None:
            object.__setattr__(self, "modules_to_save",
                               _module_names(self.modules_to_save, "modules_to_save"))
        if not isinstance(self.dora, bool):
            raise TilefitError("dora says whether peft's DoRA is on", expected="True or False",
                               given=repr(self.dora), fix="pass Lora(dora=True), or leave it out")

    @property
    def where(self) -> str:
        """Where the adapters are, in words: every linear layer, or the module names."""
        return "all linear layers" if isinstance(self.targets, str) else ",".join(self.targets)

    def label(self, quantize: str | None = None) -> str:
        """The adapters in a line: "LoRA r=16 alpha=32 on all linear layers", with the base's
        quantization when there is one ("... of an nf4 base")."""
        kind = "DoRA" if self.dora else "LoRA"
        base = f" of a frozen {quantize} base" if quantize else ""
        return f"{kind} r={self.rank} alpha={self.alpha:g} on {self.where}{base}"


def _lora_targets(value: object) -> str | tuple[str, ...]:
    """peft's target_modules: "all-linear", or module names (a tuple, a list, or one string
    of names separated by commas)."""
    if isinstance(value, str) and value.strip().lower() == ALL_LINEAR:
        return ALL_LINEAR
    return _module_names(value, "targets")


def _module_names(value: object, field: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    names = tuple(str(n).strip() for n in items) \
        if isinstance(items, (list, tuple)) and all(isinstance(n, str) for n in items) else ()
    if not names or not all(names):
        raise TilefitError(f"Lora({field}=...) names modules of the model",
                           expected="module names, e.g. ('q_proj', 'v_proj')"
                           + (" (or 'all-linear')" if field == "targets" else ""),
                           given=repr(value),
                           fix="pass Lora(targets=('q_proj', 'v_proj'))" if field == "targets"
                           else "pass Lora(modules_to_save=('lm_head',))")
    return names
