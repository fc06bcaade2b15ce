"""What a trace records: one row per aten op, one row per tensor storage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tilefit.compat.moe import EXPERT_LOOP_OPS
from tilefit.html_repr import HtmlRepr
from tilefit.tracing.target import Target
from tilefit.vocab import CATEGORIES, MICRO_PHASES, PHASES, Category, OpKind, Phase

__all__ = ["CATEGORIES", "MICRO_PHASES", "PHASES", "Collective", "FusedKernel", "GemmShape",
           "OpRecord",
           "StorageRecord", "Trace"]


@dataclass(frozen=True)
class GemmShape:
    """A (batched) GEMM an op performs: batch x (M x K) @ (K x N) in ``dtype``."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str  # tilefit dtype name: fp32, fp16, bf16


@dataclass(frozen=True)
class FusedKernel:
    """One kernel Inductor generates from several ops of a compiled graph
    (tilefit.tracing.inductor_fusion): what it reads from and writes to memory, once."""

    id: int  # unique within the trace
    ops: int  # the ops fused into it (views excluded)
    read_bytes: int  # values made outside it, each read once
    write_bytes: int  # its values used outside it (or saved for backward), each written once
    alloc_bytes: tuple[int, ...] = ()  # the buffers it allocates (what it writes)


@dataclass(frozen=True)
class Collective:
    """A collective an op issues: what it does, its payload and its group.

    ``nbytes`` is NCCL's "size" of the operation (nccl-tests' convention,
    docs/references.md, section 20): the whole buffer for all-reduce and broadcast, the
    gathered output for all-gather, the input to scatter for reduce-scatter."""

    name: str  # all_reduce, all_gather, reduce_scatter, broadcast, ...
    nbytes: int
    group_size: int



def grouped_fallback(op: OpRecord) -> bool:
    """``aten._grouped_mm`` outside bf16: ATen's fallback (``_grouped_mm_fallback``, in
    aten/src/ATen/native/GroupedMMUtils.h) copies the offsets to the host (a sync) and runs
    one ``mm`` per group, each its own kernel (docs/references.md, section 40)."""
    return op.op == "aten._grouped_mm.default" and op.dtype != "bfloat16"


def reads_expert_offsets(op: OpRecord) -> bool:
    """One matmul per expert after the experts' offsets are read on the host (the host waits
    for the device): transformers' per-expert loop (compat.moe.EXPERT_LOOP_OPS) or ATen's
    grouped-GEMM fallback (``grouped_fallback``)."""
    return op.op in EXPERT_LOOP_OPS or grouped_fallback(op)


def expert_loop_launches(op: OpRecord) -> int:
    """Kernels an expert-loop op launches: its zero fills (one per output) and its GEMMs."""
    return len(op.output_shapes) + len(op.gemms)


@dataclass(frozen=True)
class OpRecord:
    op: str  # aten overload, e.g. "aten.mm.default"
    phase: Phase  # tilefit.vocab.PHASES
    module: str  # the innermost module's path, "" for code outside any module
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    dtype: str  # torch dtype of the first output (or input) tensor, e.g. "bfloat16"
    flops: int  # from torch.utils.flop_counter's formulas where it has one
    bytes: int  # bytes read + written by the kernel(s); 0 for views
    kind: OpKind  # tilefit.vocab.OP_KINDS: what the cost model does with it
    step: int  # 0: first step (lazy optimizer state), 1: steady-state step
    micro: int  # micro-batch index within the step
    gemms: tuple[GemmShape, ...] = ()
    alloc_bytes: tuple[int, ...] = ()  # sizes of the storages this op allocated
    attention: dict[str, Any] | None = None  # backend, causal, b, hq, hkv, sq, sk, d
    # a multi-tensor op (torch.optim's foreach and fused kernels): how many tensor lists its
    # kernel touches and the element counts of the first list, which decide how many kernels
    # multi_tensor_apply launches (tilefit.estimator.multitensor)
    multi_tensor: tuple[int, tuple[int, ...]] | None = None
    # runs on the host on the target: its tensors live in host memory there (torch.optim's
    # step counters beside CUDA parameters), so it launches no kernel and never waits for
    # the device
    on_host: bool = False
    # ran inside a torch.compile graph (tilefit.tracing.compiled): no per-op Python issue
    # cost; ``fused``: Inductor fuses it into a generated kernel, whose whole traffic and one
    # launch ``kernel`` carries on the kernel's first op (the others cost nothing); an op of
    # a compiled graph that is not fused runs as an extern ATen kernel, costed as in eager
    compiled: bool = False
    fused: bool = False
    kernel: FusedKernel | None = None
    collective: Collective | None = None  # kind "collective": what it communicates
    # its FLOP formula (torch.utils.flop_counter's) failed: the error's first line; flops is 0
    flops_error: str | None = None
    # the host waits for the device after issuing it: the code called torch.cuda.synchronize()
    # (or Event.synchronize) next (tilefit.simulation)
    then_synchronized: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StorageRecord:
    uid: int
    nbytes: int
    alloc_at: int  # event index (op count) when it became live; -1 if before the trace
    free_at: int | None  # event index when freed; None if alive at the end
    category: Category
    phase: Phase  # the phase that allocated it ("setup" for pre-existing storages)
    module: str


@dataclass(frozen=True)
class ReferenceKernel:
    """One of transformers' optional kernels (mamba-ssm, causal-conv1d,
    flash-linear-attention) that the step ran as transformers' reference PyTorch code
    (tilefit.tracing.kernels), and the module that called it."""

    name: str  # transformers' name for the kernel: mamba_inner_fn, chunk_gated_delta_rule
    package: str  # the import name of its package: mamba_ssm, causal_conv1d, fla
    installed: bool  # the package imports where the step was traced
    module: str  # the calling module's path, as OpRecord.module


@dataclass(frozen=True)
class Trace(HtmlRepr):
    target: Target
    precision: str
    optimizer: str
    attention: str
    grad_checkpointing: bool
    accumulation_steps: int
    # micro-batches traced per step: min(accumulation, 2) for the tracer's loop, which
    # replays the second for the rest; all of them for a simulated script (every one ran)
    traced_micro_steps: int
    ops: tuple[OpRecord, ...]
    storages: tuple[StorageRecord, ...]
    n_events: int
    param_count: int
    trainable_param_count: int
    samples_per_micro_batch: int
    tokens_per_micro_batch: int | None
    warnings: tuple[str, ...] = field(default=())
    trainable_param_tensors: int = 0  # parameter tensors the optimizer steps
    compiled: bool = False  # forward and backward as torch.compile runs them
    # with compiled: a vocab.CompileMode ("reduce-overhead": its graphs replayed as CUDA
    # graphs; the same ops, issued and held in memory differently: tilefit.estimator)
    compile_mode: str = "default"
    world_size: int = 1  # ranks of the data-parallel group; the trace is rank 0's
    strategy: str | None = None  # a vocab.STRATEGIES name, None on one GPU
    # the recipe's PYTORCH_CUDA_ALLOC_CONF (None: the environment's, read when estimated)
    alloc_conf: str | None = None
    # transformers' optional kernels traced as its reference PyTorch code, one per calling
    # module (tilefit.tracing.kernels)
    reference_kernels: tuple[ReferenceKernel, ...] = ()

    # ---- memory -------------------------------------------------------------------------
    def live_bytes_timeline(self, *, rounded: bool = True,
                            keep: Callable[[StorageRecord], bool] | None = None) -> list[int]:
        """Live tensor bytes after each event (index 0 = before the first op), of every
        storage or of those ``keep`` selects."""
        delta = [0] * (self.n_events + 2)
        for s in self.storages:
            if keep is not None and not keep(s):
                continue
            size = self.target.round(s.nbytes) if rounded else s.nbytes
            delta[s.alloc_at + 1] += size
            if s.free_at is not None:
                delta[s.free_at + 1] -= size
        out, live = [], 0
        for d in delta:
            live += d
            out.append(live)
        return out

    def peak(self, *, rounded: bool = True) -> tuple[int, int]:
        """(peak live bytes, the timeline index where it first occurs)."""
        timeline = self.live_bytes_timeline(rounded=rounded)
        best = max(range(len(timeline)), key=timeline.__getitem__)
        return timeline[best], best

    def phase_peaks(self, *, rounded: bool = True) -> tuple[int, int, int]:
        """(peak during forward/backward/recompute, the same over micro-batch 0 only -- the
        peak without accumulation --, peak during the optimizer step, zero_grad and loss
        scaler). Each is close to affine in the batch size while their maximum is not: at
        small batches the optimizer step holds the peak, at large ones the backward."""
        return self.timeline_phase_peaks(self.live_bytes_timeline(rounded=rounded))

    def timeline_phase_peaks(self, timeline: list[int]) -> tuple[int, int, int]:
        """phase_peaks of any timeline of this trace's events (a share of its storages'
        live_bytes_timeline: CUDA graphs' pool or what is outside it)."""
        fb = fb1 = opt = 0
        for j, live in enumerate(timeline):
            op = self.ops[j - 1] if 0 < j <= len(self.ops) else None
            if op is not None and op.phase not in MICRO_PHASES:
                opt = max(opt, live)
                continue
            fb = max(fb, live)
            if op is None or op.micro == 0:
                fb1 = max(fb1, live)
        return fb, fb1, opt

    def phase_peak_indices(self, *, rounded: bool = True) -> tuple[int, int]:
        """Timeline indices of the peak during forward/backward/recompute and of the peak
        during the optimizer step, zero_grad and loss scaler (phase_peaks' first and last)."""
        timeline = self.live_bytes_timeline(rounded=rounded)
        fb = opt = 0
        for j, live in enumerate(timeline):
            op = self.ops[j - 1] if 0 < j <= len(self.ops) else None
            if op is not None and op.phase not in MICRO_PHASES:
                opt = j if live > timeline[opt] or opt == 0 else opt
            elif live > timeline[fb]:
                fb = j
        return fb, opt

    def breakdown_at(self, index: int, *, rounded: bool = True) -> dict[str, int]:
        """Live bytes by category at a timeline index."""
        out = dict.fromkeys(self.categories, 0)
        for s in self.storages:
            born = s.alloc_at + 1
            dead = None if s.free_at is None else s.free_at + 1
            if born <= index and (dead is None or dead > index):
                out[s.category] += self.target.round(s.nbytes) if rounded else s.nbytes
        return out

    @property
    def categories(self) -> tuple[str, ...]:
        """The memory categories of this trace: "communication" only on several GPUs."""
        # cudagraph_pool is the estimator's (tilefit.estimator.cudagraphs), no storage's
        return tuple(c for c in CATEGORIES if c != "cudagraph_pool" and (
            c != "communication" or self.strategy is not None))

    def ops_of_step(self, step: int) -> tuple[OpRecord, ...]:
        return tuple(o for o in self.ops if o.step == step)

    def repeats_per_step(self, op: OpRecord) -> int:
        """How often a steady-state op runs per optimizer step: micro-batch 0 once,
        micro-batch 1 (traced when accumulating) for the other a - 1 micro-batches, which
        accumulate into existing gradients; one traced micro-batch for all a; the
        optimizer step and what follows it once; every op once where every micro-batch
        was traced."""
        a = self.accumulation_steps
        if op.phase not in MICRO_PHASES or self.traced_micro_steps >= a:
            return 1
        if op.micro == 0 and (a == 1 or self.traced_micro_steps == 2):
            return 1
        return a if self.traced_micro_steps == 1 else a - 1
