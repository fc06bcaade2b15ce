"""Mixture-of-experts layers traced under a routing assumption (``Recipe.routing``).

The router picks each token's top-k experts from values a fake tensor does not have, so how
many tokens each expert receives is assumed (vocab.ExpertRouting: balanced, or skewed with
the busiest expert's share). transformers' own experts code runs; the assumption answers what
it asks the data (compat.moe.RoutedExperts, for the eager loop) and gives each expert's rows
of a grouped GEMM to the cost model (Recorder.expert_counts, tracing.shapes.grouped_gemms).
The router's auxiliary loss is the model's own: transformers adds it to ``.loss`` when the
config sets ``output_router_logits`` (times ``router_aux_loss_coef``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from tilefit.compat.moe import (
    RoutedExperts,
    experts_dispatch_for,
    experts_implementation,
    experts_modules,
    loops_on,
    routing_of,
)
from tilefit.tracing.recorder import Recorder
from tilefit.vocab import ExpertRouting


class ExpertsTrace:
    """The MoE layers of one traced model and what their trace assumed."""

    def __init__(self, model: nn.Module, routing: ExpertRouting,
                 capability: tuple[int, int] | None = None) -> None:
        self.routing = routing
        self.capability = capability  # the target GPU's (None: a CPU target)
        self.experts = experts_modules(model)
        config = getattr(model, "config", None)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.mode = RoutedExperts(routing.counts)

    def counts(self, routed: int, experts: int) -> tuple[int, ...]:
        """Tokens per expert of a grouped GEMM's ``routed`` rows (tokens x top_k)."""
        cap = routed // self.top_k if self.top_k else None
        return self.routing.counts(routed, experts, cap)

    @contextlib.contextmanager
    def active(self, recorder: Recorder) -> Iterator[None]:
        """The routing in force while the step runs: the mode below ``recorder`` and each
        eager experts forward bracketed by hooks."""
        if not self.experts:
            yield
            return
        recorder.expert_counts = self.counts
        handles = []
        for module in self.experts:
            if experts_implementation(module) == "eager":
                handles.append(module.register_forward_pre_hook(self._begin, with_kwargs=True))
                handles.append(module.register_forward_hook(self._end))
        try:
            with self.mode, experts_dispatch_for(self.capability):
                yield
        finally:
            for h in handles:
                h.remove()

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tokens, top_k = routing_of(args, kwargs)
        self.mode.begin(tokens, top_k, int(module.num_experts))

    def _end(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.mode.end()

    def _loop_note(self) -> str:
        what = ("transformers' own per-expert loop (transformers::grouped_mm_fallback: the "
                "offsets read on the host, then one matmul per expert issued from Python)")
        if loops_on(self.capability):
            cc = ".".join(map(str, self.capability))
            return (f"the experts run through {what}: transformers calls torch's grouped "
                    f"GEMM on compute capability 8.0 or later only, this GPU has {cc}")
        return (f"under torch.compile the experts whose weights are not bf16 run through "
                f"{what}; bf16 weights (Recipe(precision='bf16-true')) take torch's grouped GEMM "
                "inside the graph")

    def notes(self) -> list[str]:
        """What the trace assumed, for Trace.warnings."""
        if not self.experts:
            return []
        first = self.experts[0]
        n = int(first.num_experts)
        how = "balanced: each expert receives tokens x top_k / experts" \
            if self.routing.busiest is None else (
                f"{self.routing.name}: the busiest expert receives {self.routing.busiest:g} "
                "of the routed tokens (at most every token once), the others share the rest")
        lines = [f"{len(self.experts)} mixture-of-experts layer(s) of {n} experts "
                 f"({experts_implementation(first)}) traced under routing {how} "
                 "(Recipe(routing='balanced'), or Recipe(routing='skewed:F'))"]
        if self.mode.expert_loops:
            lines.append(self._loop_note())
        if self.mode.fallback_grouped:
            lines.append("the experts' grouped GEMMs run in fp32 (or fp16): torch's "
                         "_grouped_mm takes its fallback there, the offsets copied to the "
                         "host (the host waits for the GPU) then one matmul per expert (the "
                         "fused grouped kernel is bf16 only; bf16 weights, "
                         "Recipe(precision='bf16-true'), use it)")
        return lines
