"""torch.compile's mode="reduce-overhead": the compiled graphs replayed as CUDA graphs
(cudagraph trees; docs/references.md, section 22).

Time: the device runs the same kernels; the host, instead of launching each kernel of a
graph, replays the graph once (``HostModel.graph_replay_s``). What runs outside the graphs
(the optimizer step, zero_grad, the loss read, GradScaler) is issued as in eager mode.

Memory: the graphs allocate from one private memory pool that cudagraph trees keep for the
graphs between replays; the eager code (the optimizer step) cannot reuse it. So the pool's
own peak (what the graphs' ops allocate, live at once, plus the pool's copies of the graphs'
non-static inputs: the batch; parameters and buffers are static, the backward's saved
tensors are the forward graph's outputs already in the pool) is held through the step, and
the step's peak is that plus the most the eager code holds outside it at any moment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tilefit.compat.moe import EXPERT_LOOP_OPS
from tilefit.errors import TilefitError
from tilefit.tracing.records import OpRecord, StorageRecord, Trace
from tilefit.vocab import REDUCE_OVERHEAD


def graphed(tr: Trace) -> bool:
    """The trace's compiled graphs are replayed as CUDA graphs."""
    return tr.compiled and tr.compile_mode == REDUCE_OVERHEAD


def check_capturable(tr: Trace) -> None:
    """A TilefitError where a graph to replay holds an op that reads device values on the
    host: CUDA forbids the copy while a stream is captured, so cudagraph trees fail at the
    recording (transformers' per-expert loop reads its offsets; compat.moe.EXPERT_LOOP_OPS)."""
    if not graphed(tr):
        return
    blocker = next((op for op in tr.ops if op.compiled and op.op in EXPERT_LOOP_OPS), None)
    if blocker is None:
        return
    raise TilefitError(
        "torch.compile(mode=\"reduce-overhead\") cannot replay this step as CUDA graphs: "
        f"{blocker.op.rsplit('.', 1)[0]} (in {blocker.module or 'the step'}) reads device "
        "values on the host, which CUDA forbids while a graph is captured",
        expected="compiled graphs without a host sync",
        given="transformers' per-expert loop in the graph (experts whose weights are not "
        "bf16, under torch.compile)",
        fix="keep torch.compile's default mode (Recipe(compile=Compile(mode='default'))), or "
        "bf16 weights (Recipe(precision='bf16-true')), with which transformers calls torch's "
        "grouped GEMM")


def replay_starts(ops: Sequence[OpRecord]) -> list[bool]:
    """For each op, whether the host replays a graph there: the first op of each run of
    compiled ops of one graph (a phase of one micro-batch of one step)."""
    out: list[bool] = []
    prev: OpRecord | None = None
    for op in ops:
        out.append(op.compiled and (prev is None or not prev.compiled or (
            prev.step, prev.micro, prev.phase) != (op.step, op.micro, op.phase)))
        prev = op
    return out


def _in_pool(tr: Trace) -> Callable[[StorageRecord], bool]:
    compiled_at = {i for i, op in enumerate(tr.ops) if op.compiled}
    return lambda s: s.alloc_at in compiled_at


def static_input_copy_bytes(tr: Trace, *, rounded: bool = True) -> int:
    """The pool's copies of the forward graph's non-static inputs: the batch's tensors
    (cudagraph trees copy every input that is neither a parameter or buffer nor an output
    of a graph already in the pool into a placeholder of the pool at each replay)."""
    return sum(tr.target.round(s.nbytes) if rounded else s.nbytes
               for s in tr.storages if s.category == "inputs")


def graphed_peak(tr: Trace, *, rounded: bool = True) -> tuple[int, int, int]:
    """(peak bytes, the timeline index where the eager side peaks, the pool's bytes)."""
    in_pool = _in_pool(tr)
    pool = tr.live_bytes_timeline(rounded=rounded, keep=in_pool)
    outside = tr.live_bytes_timeline(rounded=rounded, keep=lambda s: not in_pool(s))
    pool_bytes = max(pool) + static_input_copy_bytes(tr, rounded=rounded)
    at = max(range(len(outside)), key=outside.__getitem__)
    return pool_bytes + outside[at], at, pool_bytes


def graphed_phase_peaks(tr: Trace, *, rounded: bool = True) -> tuple[int, int, int, int]:
    """Trace.phase_peaks under CUDA graphs, and the optimizer step's peak without
    accumulation: the pool's bytes (held through the step, the eager code cannot reuse
    them) plus the eager side's peak in each piece, so that the larger of the first and
    third is graphed_peak's. Without accumulation the pool holds only what micro-batch 0
    and the optimizer step need of it (its peak outside the later micro-batches: no
    earlier micro-batch's gradients)."""
    in_pool = _in_pool(tr)
    pool = tr.live_bytes_timeline(rounded=rounded, keep=in_pool)
    outside = tr.live_bytes_timeline(rounded=rounded, keep=lambda s: not in_pool(s))
    copies = static_input_copy_bytes(tr, rounded=rounded)
    pool_fb, pool_fb1, pool_opt = tr.timeline_phase_peaks(pool)
    fb, fb1, opt = tr.timeline_phase_peaks(outside)
    pool_bytes = max(pool_fb, pool_opt) + copies
    pool_1_bytes = max(pool_fb1, pool_opt) + copies
    return pool_bytes + fb, pool_1_bytes + fb1, pool_bytes + opt, pool_1_bytes + opt


def graphed_memory(tr: Trace, *, rounded: bool = True) -> tuple[int, dict[str, int]]:
    """The step's peak under CUDA graphs and its breakdown: the live tensors at the eager
    side's peak by category, and the pool's bytes beyond its tensors live then under
    "cudagraph_pool"."""
    peak, at, _ = graphed_peak(tr, rounded=rounded)
    breakdown = tr.breakdown_at(at, rounded=rounded)
    breakdown["cudagraph_pool"] = peak - sum(breakdown.values())
    return peak, breakdown
