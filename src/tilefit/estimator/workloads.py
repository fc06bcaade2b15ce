"""Estimating a tilefit Workload (catalog model, config.json, or factory) at a batch size."""

from __future__ import annotations

import functools
from typing import Any

from tilefit.errors import TilefitError
from tilefit.estimator import Estimate, estimate_strategy
from tilefit.estimator.collectives import check_world_size
from tilefit.estimator.zero import DEEPSPEED_DEFAULTS, ZeroConfig
from tilefit.estimator.zero_step import traced_setup
from tilefit.hardware import Device, get_device
from tilefit.models import Workload
from tilefit.tracing import Trace
from tilefit.tracing.gc_pause import gc_paused
from tilefit.vocab import Recipe, default_precision

__all__ = ["Recipe", "check_batch", "default_precision", "estimate_workload",
           "trace_workload"]


def trace_workload(workload: Workload, recipe: Recipe, device: str | Device, *,
                   graph_breaks: bool = False, world_size: int = 1,
                   strategy: str | None = None) -> Trace:
    from tilefit.tracing import trace

    check_batch(recipe.batch_size)
    dev = get_device(device)
    build_attention = "sdpa" if recipe.attention == "auto" else recipe.attention
    if workload.is_factory and recipe.attention != "auto":
        raise TilefitError(
            f"--attention {recipe.attention} applies to Hugging Face models",
            expected="auto for a plain nn.Module factory (its own code chooses)",
            given=recipe.attention, fix="drop --attention")
    model: Any = functools.partial(workload.build, build_attention)
    if recipe.peft:  # peft's LoRA, built on the meta device (tilefit.models.lora says why)
        from tilefit.models.lora import build_lora_model, lora_base_dtype

        check_lora(workload)
        model = build_lora_model(workload, build_attention, lora_base_dtype(recipe))
    return trace(
        model,
        workload.make_batch(recipe.batch_size, device="meta"),
        loss_fn=workload.loss_for(recipe.fused_ce), **recipe.step_options(),
        accumulation_steps=recipe.accumulation_steps, attention="auto", device=dev,
        graph_breaks=graph_breaks, world_size=world_size, strategy=strategy)


def check_lora(workload: Workload) -> None:
    """LoRA wraps a Hugging Face model's linear layers; a plain nn.Module factory is an
    error."""
    if workload.is_factory:
        raise TilefitError(
            "LoRA (peft) applies to Hugging Face models",
            expected="a catalog model or a config.json", given=workload.name,
            fix="drop --lora, or wrap the model with peft.get_peft_model in your own factory")


def estimate_workload(workload: Workload, recipe: Recipe, device: str | Device, *,
                      graph_breaks: bool = False, world_size: int = 1,
                      strategy: str | None = None, offload: bool = False,
                      zero_config: ZeroConfig = DEEPSPEED_DEFAULTS) -> Estimate:
    """The estimate of one training step (``recipe.compile``: as torch.compile runs its
    forward and backward, tilefit.tracing.compiled); ``graph_breaks``: list Dynamo's breaks;
    ``world_size`` GPUs with ``strategy`` (tilefit.estimator.estimate): one rank's step,
    ``recipe.batch_size`` being one rank's micro-batch; a ZeRO strategy (and ``offload``)
    modelled on the one-GPU trace (tilefit.estimator.zero), ``zero_config`` the bucket sizes
    of its DeepSpeed config."""
    dev = get_device(device)
    if world_size > 1:
        check_world_size(dev, world_size)
    traced_world, traced_strategy = traced_setup(world_size, strategy, offload)
    with gc_paused():  # the trace's objects are all alive while it is costed
        tr = trace_workload(workload, recipe, dev, graph_breaks=graph_breaks,
                            world_size=traced_world, strategy=traced_strategy)
        return estimate_strategy(tr, dev, world_size, strategy, offload, zero_config)


def check_batch(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TilefitError("the batch size must be a whole number >= 1",
                           expected="1, 2, 8, ...", given=repr(batch_size),
                           fix="pass --batch with a positive integer")
