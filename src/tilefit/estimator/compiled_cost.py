"""The cost of an op of a torch.compile graph (tilefit.tracing.compiled): a fused kernel
costs its traffic at the device's bandwidth and one launch, on its first op; the other ops
fused into it cost nothing; extern kernels (GEMMs, convolutions, attention, ops Inductor
cannot fuse) cost what they cost in eager mode (docs/references.md, section 19)."""

from __future__ import annotations

from tilefit.estimator.cost import CostContext, fresh_bytes_time_s, memory_time_s, op_time_s
from tilefit.hardware.device import Device
from tilefit.tracing.records import FusedKernel, OpRecord

# Inductor's generated kernels are costed at the elementwise family's share of the copy
# bandwidth: a fused kernel streams its inputs and outputs once, as a pointwise kernel does.
FUSED_FAMILY = "elementwise"


def kernel_time_s(kernel: FusedKernel, device: Device, ctx: CostContext) -> float:
    """One generated kernel: its reads and writes at the achieved bandwidth, one launch, and
    the first touch of the buffers it allocates (CPU)."""
    return memory_time_s(kernel.read_bytes + kernel.write_bytes, device, launches=1,
                         family_efficiency=ctx.efficiency.bandwidth[FUSED_FAMILY]) \
        + fresh_bytes_time_s(kernel.alloc_bytes, device)


def compiled_op_time_s(op: OpRecord, device: Device, ctx: CostContext) -> float:
    """The device time of an op of a compiled graph."""
    if op.kernel is not None:
        return kernel_time_s(op.kernel, device, ctx)
    if op.fused:
        return 0.0
    return op_time_s(op, device, ctx)


def compiled_launches(op: OpRecord, eager_launches: int) -> int:
    """Kernel launches of an op of a compiled graph: one per fused kernel, on its first op;
    none for the ops fused into it; an extern kernel's own."""
    if op.kernel is not None:
        return 1
    if op.fused or op.kind == "view":
        return 0
    return eager_launches
