"""How many kernels a multi-tensor op launches: torch.optim's foreach and fused optimizer
kernels, GradScaler's unscale and clip_grad_norm_'s foreach norm.

On a CUDA GPU, ``multi_tensor_apply`` walks the tensors of the first list in chunks of 65536
elements, one thread block per chunk, and launches a kernel whenever its argument block is
full: a maximum number of tensors (which depends on how many lists the kernel walks, its
depth) or of blocks (chunks). With CUDA >= 12.1 and a Volta or later GPU the kernel
argument may be 32 KB, and the limits are seven times those of the 4 KB argument
(aten/src/ATen/native/cuda/MultiTensorApply.cuh; docs/references.md, section 16). On the
CPU, the foreach ops fall back to one kernel call per tensor and the fused optimizers loop
over the tensors, one parallel region each. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

from tilefit.compat.moe import EXPERT_LOOP_OPS
from tilefit.hardware.device import Device
from tilefit.tracing.records import OpRecord, expert_loop_launches, grouped_fallback

CHUNK_ELEMENTS = 65536  # kChunkSize
# depth_to_max_tensors / _scalarlist / depth_to_max_blocks, for depth 1..5
MAX_TENSORS_4KB = (110, 64, 48, 36, 30)
MAX_TENSORS_SCALARLIST_4KB = (96, 64, 48, 36, 30)
MAX_BLOCKS_4KB = 320
LARGE_ARG_FACTOR = 7  # the 32 KB argument's limits: 7x (770, 448, ...; 2240 blocks)
LARGE_ARG_MIN_CAPABILITY = (7, 0)


def multi_tensor_launches(numels: Sequence[int], depth: int, *, large_arg: bool = True,
                          scalar_list: bool = False) -> int:
    """Kernel launches of one multi_tensor_apply call over tensors of ``numels`` elements
    walking ``depth`` lists: its loop, counted (empty tensors are skipped)."""
    if not numels:
        return 0
    d = min(max(depth, 1), len(MAX_TENSORS_4KB)) - 1
    factor = LARGE_ARG_FACTOR if large_arg else 1
    max_tensors = (MAX_TENSORS_SCALARLIST_4KB if scalar_list else MAX_TENSORS_4KB)[d] * factor
    max_blocks = MAX_BLOCKS_4KB * factor
    launches = blocks = tensors = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // CHUNK_ELEMENTS)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (tensors == max_tensors and last) or blocks == max_blocks:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1  # a partly done tensor carries over
    return launches + (1 if blocks else 0)


def kernel_launches(op: OpRecord, device: Device) -> int:
    """Kernels (GPU) or kernel calls (CPU) the op makes on ``device``: one for an ordinary
    op, none for one that runs on the host, the chunked launches of a multi-tensor op."""
    if op.on_host:
        return 0
    if op.op in EXPERT_LOOP_OPS:
        return expert_loop_launches(op)
    if grouped_fallback(op):
        return max(1, len(op.gemms))
    if op.multi_tensor is None:
        return 1
    depth, numels = op.multi_tensor
    if device.kind != "cuda":
        return max(1, sum(1 for n in numels if n))
    large = (device.compute_capability or (0, 0)) >= LARGE_ARG_MIN_CAPABILITY
    launches = multi_tensor_launches(numels, depth, large_arg=large,
                                     scalar_list="ScalarList" in op.op)
    if op.op.startswith("aten._foreach_norm"):
        launches += 1  # the per-tensor cleanup reduction after the chunked partial norms
    return max(1, launches)
