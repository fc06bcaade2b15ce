"""CPU offload of the optimizer, DeepSpeed ZeRO-Offload style, as a model.

ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC 2021, section 4 and Fig. 2) keeps on the GPU only the 16-bit parameters (2 bytes/param)
and runs forward and backward there; the 16-bit gradients stream to the CPU bucket by bucket
as backward produces them; the fp32 master weights and the optimizer states live in CPU
memory and the optimizer step runs on the CPU (DeepSpeed's CPU-Adam); the updated 16-bit
parameters are copied back. The planner models it on a trace of the same recipe in pure
16-bit precision (the model cast to bf16, as DeepSpeed's bf16 mode does), or, on parts
without bf16, on the fp16 mixed-precision trace (conservative: autocast's weight copies are
then counted on top of the 16-bit parameters):

  GPU peak  = 16-bit parameters + one gradient bucket + the forward/backward working set
              (activations, temporaries and inputs of the trace, model state excluded)
  step time = accumulation x (forward + backward of one micro-batch)
              + PCIe: 16-bit gradients to the CPU + 16-bit parameters back (4 bytes/param)
              + CPU optimizer step: bandwidth-bound, OFFLOAD_CPU_BYTES_PER_PARAM of host
                memory traffic per parameter

The transfers are added to the step although DeepSpeed overlaps part of them with backward
(the paper's schedule, Fig. 5): the prediction is an upper bound on the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

# PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding / 8 = 31.5 GB/s per direction in
# theory; pinned-memory copies achieve about 25 GB/s (CUDA samples' bandwidthTest on
# A100/RTX 30xx/40xx hosts; NVIDIA's A100 PCIe datasheet lists 64 GB/s bidirectional).
PCIE_BYTES_PER_S = 25e9
# DeepSpeed's bucket for gradient reduction/offload: reduce_bucket_size defaults to 5e8
# elements (deepspeed/runtime/zero/config.py); the emitted config sets it explicitly.
REDUCE_BUCKET_ELEMENTS = 500_000_000
GRAD_BYTES_16BIT = 2
# Host memory traffic of one CPU-Adam update per parameter: fp32 master weight, exp_avg and
# exp_avg_sq each read and written (3 x 8 B), the fp32 gradient read (4 B) and the 16-bit
# parameter written for the copy back (2 B) = 30 B (DeepSpeed csrc/adam/cpu_adam_impl.cpp
# reads/writes exactly these streams; Adam is bandwidth-bound at 1-2 FLOP per byte).
OFFLOAD_CPU_BYTES_PER_PARAM = 30
# Achieved host memory bandwidth assumed for the CPU step: a dual-channel DDR5-5600 desktop
# peaks at 89.6 GB/s (2 x 8 B x 5600 MT/s), STREAM achieves ~60% of it; servers have more
# channels. Pass host_bandwidth_bytes_per_s to plan() for your machine.
HOST_BANDWIDTH_BYTES_PER_S = 50e9


@dataclass(frozen=True)
class OffloadLink:
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    host_bandwidth_bytes_per_s: float = HOST_BANDWIDTH_BYTES_PER_S


def offload_peak_bytes(parameters_16bit_bytes: float, work_peak_bytes: float,
                       param_count: float) -> float:
    bucket = min(REDUCE_BUCKET_ELEMENTS, param_count) * GRAD_BYTES_16BIT
    return parameters_16bit_bytes + bucket + work_peak_bytes


def offload_step_time_s(micro_time_s: float, accumulation_steps: int, param_count: float,
                        link: OffloadLink) -> float:
    transfer = param_count * (GRAD_BYTES_16BIT + 2) / link.pcie_bytes_per_s
    cpu_step = param_count * OFFLOAD_CPU_BYTES_PER_PARAM / link.host_bandwidth_bytes_per_s
    return accumulation_steps * micro_time_s + transfer + cpu_step


def offload_host_bytes(param_count: float, optimizer_state_bytes: float,
                       weight_bytes: int) -> int:
    """The CPU memory ZeRO-Offload needs on one GPU, as DeepSpeed's own estimator counts it
    (estimate_zero2_model_states_mem_needs with cpu_offload: fp32 master weights, fp32
    gradients and the optimizer's state, 16 bytes per parameter for Adam, times its 1.5
    buffer factor): tilefit.estimator.zero's stage-2 model on one GPU, offloaded.
    ``optimizer_state_bytes``: the traced optimizer's state, in the traced weights' dtype
    (``weight_bytes`` each); DeepSpeed keeps it in fp32, so it is widened as
    tilefit.estimator.zero_step.zero_inputs widens it."""
    from tilefit.estimator.zero import MASTER_BYTES, ZeroInputs, zero_memory

    params = max(int(param_count), 1)
    state = optimizer_state_bytes * MASTER_BYTES / weight_bytes
    inp = ZeroInputs(params=params, weight_bytes=weight_bytes,
                     optimizer_bytes_per_param=state / params, largest_layer_params=0)
    return zero_memory(inp, 2, 1, offload=True).host_bytes
