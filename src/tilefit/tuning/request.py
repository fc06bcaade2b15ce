"""tune's request: its ``TuneSearch`` (validated on its own) on the device and in the
torchrun job, checked for them; each error says what was expected and the fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tilefit.dtypes import parse_dtype
from tilefit.errors import TilefitError
from tilefit.recipe import AUTO, PLAIN_PYTORCH, Recipe
from tilefit.tuning.executor import OptimizerArg
from tilefit.tuning.noise import NoiseScale
from tilefit.tuning.options import TuneSearch
from tilefit.tuning.ranks import Ranks, current_ranks, rank_share
from tilefit.vocab import Precision, mixed_precision, parse_precision

CPU_MULTIPLE = 8  # the CPU has no Tensor Core rule; multiples of 8 suit SIMD widths
OBJECTIVE_RATE = "samples-per-s"


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TilefitError(
            f"unknown device {device!r}",
            expected="cuda, cuda:N or cpu",
            given=repr(device),
            fix="pass device='cuda' or device='cpu'",
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TilefitError(
                "device cuda was asked for but there is no CUDA GPU",
                expected="a machine with a CUDA GPU and a CUDA build of PyTorch",
                given="torch.cuda.is_available() is False",
                fix="use device='cpu' (with memory_limit_bytes to simulate a GPU's memory)",
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def preferred_multiple(device: torch.device, precision: str) -> int:
    """The batch multiple the device's Tensor Cores want for the dtype (Device.multiple:
    alignment bytes / element size, NVIDIA Matrix Multiplication guide Table 1)."""
    if device.type != "cuda":
        return CPU_MULTIPLE
    from tilefit.hardware import detect_live_device

    dtype = parse_precision(precision).compute_dtype
    try:
        return detect_live_device(device.index or 0).multiple(dtype)
    except TilefitError:  # a GPU missing from the catalog: the general 16-byte rule
        return max(1, 16 // parse_dtype(dtype).bytes)


@dataclass(frozen=True)
class TuneRequest:
    """tune's options, validated: the step each trial runs (``recipe``: its precision and
    loop; batch and accumulation are what tune searches), what to search and under which
    limits."""

    recipe: Recipe
    device: torch.device
    global_batch: int | None
    max_batch: int | None
    memory_limit_bytes: int | None
    margin: float
    steps_per_trial: int
    predicted_max_batch: int | None
    predict: bool
    measure_throughput: bool
    objective: str = "samples-per-s"
    noise_scale: float | NoiseScale | None = None
    ranks: Ranks = dataclasses.field(default_factory=Ranks)  # under torchrun; global_batch
    # above is then this rank's share
    routing: str = "balanced"  # TuneSearch.routing

    @property
    def precision(self) -> Precision:
        return self.recipe.spec

    @property
    def cap(self) -> int | None:
        """The largest batch to try: max_batch, and no more than the global batch."""
        if self.global_batch is None:
            return self.max_batch
        return self.global_batch if self.max_batch is None else min(self.max_batch,
                                                                     self.global_batch)


def current_job(objective: str, noise_scale: float | NoiseScale | None) -> Ranks:
    """The torchrun job this process is in (rank 0 of 1 outside one); the objective
    checked for it."""
    ranks = current_ranks()
    if ranks.distributed and objective != OBJECTIVE_RATE and noise_scale is None:
        raise TilefitError(
            "under torchrun, objective='time-to-loss' needs the noise scale given",
            expected="noise_scale=B_noise (measured once, on one process)",
            given="noise_scale=None (each rank would measure its own)",
            fix="measure it with `tilefit noise-scale` and pass "
            "tune(..., search=TuneSearch(noise_scale=...))")
    return ranks


def make_request(search: TuneSearch, *, recipe: Recipe, device: str | torch.device | None,
                 ranks: Ranks | None = None) -> TuneRequest:
    """tune's options for this device and job (the search's own are checked by TuneSearch;
    each error says what was expected and the fix): global_batch becomes this rank's share."""
    ranks = Ranks() if ranks is None else ranks
    dev = resolve_device(device)
    if dev.type == "cpu" and search.memory_limit_bytes is None and search.max_batch is None:
        raise TilefitError(
            "on the CPU tune needs a memory limit or a largest batch to stop at",
            expected="memory_limit_bytes (simulate a GPU's memory) or max_batch",
            given="neither",
            fix="pass tune(..., search=TuneSearch(memory_limit_bytes=16 * 2**30)) or "
            "TuneSearch(max_batch=...)",
        )
    return TuneRequest(
        recipe, dev, rank_share(search.global_batch, ranks),
        search.max_batch, search.memory_limit_bytes, search.margin, search.steps_per_trial,
        search.predicted_max_batch, search.predict,
        search.measure_throughput or search.objective != OBJECTIVE_RATE, search.objective,
        search.noise_scale, ranks,
        search.routing if search.routing != "balanced" else recipe.routing)


def check_model_and_optimizer(model: nn.Module, optimizer: OptimizerArg,
                              request: TuneRequest) -> None:
    if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TilefitError("optimizer must be an optimizer or a factory",
                           expected="torch.optim.AdamW(model.parameters()) or params -> Optimizer",
                           given=type(optimizer).__name__,
                           fix="pass optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4)")
    check_on_device(model, request.device)


def check_on_device(model: nn.Module, dev: torch.device) -> None:
    """An error unless every parameter is on ``dev`` (tilefit does not move the model)."""
    wrong = {str(p.device) for p in model.parameters() if p.device.type != dev.type
             or (dev.index is not None and p.device.index != dev.index)}
    if wrong:
        raise TilefitError(
            "the model is not on the device being tuned",
            expected=f"parameters on {dev}",
            given=f"parameters on {', '.join(sorted(wrong))}",
            fix=f"call model.to('{dev}') before tune (tilefit does not move your model)",
        )


# the Recipe fields that describe how the model is built or run beyond its loop: tune trains
# the model as the user built it, so each must keep its default (a field's name and how to
# say it on the model instead)
BUILT_ON_THE_MODEL: dict[str, str] = {
    "grad_checkpointing": "model.gradient_checkpointing_enable() (or checkpoint in forward)",
    "attention": "the model's own attention (attn_implementation= when you build it)",
    "compile": "torch.compile(model) before tune",
    "lora": "peft's get_peft_model(model, LoraConfig(...)) before tune",
    "quantize": "from_pretrained(..., quantization_config=BitsAndBytesConfig(...))",
    "fused_ce": "the fused loss in your loss_fn",
    "use_cache": "model.config.use_cache",
    "alloc_conf": "PYTORCH_CUDA_ALLOC_CONF in the environment",
}


def live_recipe(recipe: Recipe | None, precision: str | None, function: str = "tune"
                ) -> Recipe:
    """The step ``function`` (tune, noise_scale) runs on the live device: ``recipe`` (its
    loop: precision, clipping, the loss read, zero_grad), or plain PyTorch's loop in
    ``precision`` (default fp32); refused where it asks for what only the model's own
    build can do."""
    if recipe is not None and precision is not None:
        raise TilefitError(f"{function}() got recipe= and precision=",
                           expected="one of them", given="both",
                           fix=f"Recipe(precision={precision!r}, ...) alone")
    if recipe is None:
        return Recipe(**{**PLAIN_PYTORCH, "precision": precision or "fp32"})
    if recipe.precision == AUTO:
        raise TilefitError(f"{function} runs on the live device in the precision your loop "
                           "trains in",
                           expected="a precision named in the Recipe", given="precision='auto'",
                           fix=f"Recipe(precision={mixed_precision('bf16').name!r}) (or "
                           "another of tilefit.vocab's precisions)")
    defaults = Recipe()
    for name, instead in BUILT_ON_THE_MODEL.items():
        if getattr(recipe, name) != getattr(defaults, name):
            raise TilefitError(
                f"{function} trains the model you pass as you built it; Recipe({name}=...) "
                "describes how to build it",
                expected=f"Recipe({name}={getattr(defaults, name)!r}), the default",
                given=f"Recipe({name}={getattr(recipe, name)!r})",
                fix=f"build the model that way ({instead}) and leave {name} at its default")
    if recipe.optimizer != defaults.optimizer:
        raise TilefitError(f"{function} takes your optimizer itself, not the Recipe's",
                           expected=f"Recipe(optimizer={defaults.optimizer!r}), the default",
                           given=f"Recipe(optimizer={recipe.optimizer!r})",
                           fix=f"pass the optimizer as {function}(..., optimizer=...) and "
                           "leave the Recipe's at its default")
    if recipe.parallel.world_size > 1:
        raise TilefitError(f"{function} runs on one device per process; under torchrun it "
                           "runs on every rank", expected="Recipe(parallel=ONE_GPU)",
                           given=f"world_size={recipe.parallel.world_size}",
                           fix="launch your script with torchrun, one process per GPU, "
                           "and call it on every rank")
    return recipe
