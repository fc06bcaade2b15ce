"""When nothing fits on one GPU: the smallest sharded data-parallel setup that does.

Memory per GPU under full sharding (ZeRO stage 3, Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020, section 5.1 and Fig. 1:
model states (2 + 2 + K) x Psi / N_d for mixed precision with K = 12 for Adam): parameters,
gradients and optimizer state divide by N; activations and temporaries stay per GPU at the
micro-batch. FSDP2 (fully_shard) shards the same way and all-gathers one layer's parameters
at a time, with the next layer prefetched: two unsharded layers are added.

  per-GPU peak = (parameters + gradients + optimizer state) / N + working set(micro-batch)
                 + 2 x parameters / layers
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_GPUS = 64
PREFETCHED_LAYERS = 2


@dataclass(frozen=True)
class ShardedSetup:
    gpus: int
    micro_batch: int
    accumulation_steps: int
    per_gpu_peak_bytes: float
    state_bytes: float  # unsharded parameters + gradients + optimizer state
    work_peak_bytes: float
    compute_time_s: float  # per optimizer step, communication not modelled
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "micro_batch": self.micro_batch,
                "accumulation_steps": self.accumulation_steps,
                "predicted_per_gpu_memory_bytes": int(self.per_gpu_peak_bytes),
                "model_state_bytes_unsharded": int(self.state_bytes),
                "working_set_bytes": int(self.work_peak_bytes),
                "compute_time_s": self.compute_time_s, "fits": self.fits}


def per_gpu_bytes(state_bytes: float, work_peak_bytes: float, parameters_bytes: float,
                  layers: int, gpus: int) -> float:
    gathered = PREFETCHED_LAYERS * parameters_bytes / max(layers, 1) if gpus > 1 else 0.0
    return state_bytes / gpus + work_peak_bytes + gathered


def smallest_setup(global_batch: int,
                   candidates: list[tuple[int, float, float, float, float]],
                   layers: int, budget_bytes: float) -> ShardedSetup | None:
    """candidates: (micro_batch, state_bytes, gathered parameters_bytes (all layers, as
    computed), work_peak_bytes,
    micro_time_s) per micro-batch. The fewest GPUs N (N x micro x accumulation == global
    batch) whose per-GPU peak fits; at that N the largest micro-batch that fits."""
    for gpus in range(2, MAX_GPUS + 1):
        if global_batch % gpus:
            continue
        best: ShardedSetup | None = None
        for micro, state, params, work, micro_time in sorted(candidates):
            if (global_batch // gpus) % micro:
                continue
            peak = per_gpu_bytes(state, work, params, layers, gpus)
            if peak <= budget_bytes:
                accum = global_batch // gpus // micro
                best = ShardedSetup(gpus, micro, accum, peak, state, work,
                                    accum * micro_time, True)
        if best is not None:
            return best
    return None
