"""The host side of eager PyTorch: what issuing one op costs the CPU.

Every op of an eager training step is issued from the host before the GPU can run it: the
forward from Python (module code, the Python binding, the dispatcher, autograd recording),
the backward from the autograd engine in C++, the optimizer from Python loops over the
parameters and its foreach calls. Each non-view op also launches a kernel. The figures
depend on the host CPU and the PyTorch version: ``tilefit calibrate`` measures them on the
machine it runs on (benchmarks/bench_host_overhead.py prints the fit), and the defaults
below are such a measurement, with its source (docs/references.md, section 14), scaled to
what an eager CUDA step pays per op (fitted on the public GPU corpus:
docs/references.md, section 15).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Who issues a phase's ops on the host: Python module code (the forward), the autograd engine
# (backward and checkpoint recompute), or the optimizer step's loops (clip_grad, optimizer,
# zero_grad, scaler: tilefit.vocab.OPTIMIZER_PHASES).
ISSUERS: tuple[str, ...] = ("forward", "backward", "optimizer")


def issuer_of(phase: str) -> str:
    if phase in ("forward", "loss_check"):  # Python code: the model's and the loop's
        return "forward"
    return "backward" if phase in ("backward", "recompute") else "optimizer"


# Host time of one cudagraph-trees replay: 128 us of cudagraph trees' runtime checks and
# 41 us of cudaGraphLaunch, measured for one graph on a GPU by PyTorch's developers (pytorch
# issue #150488; docs/references.md, section 22). Dynamo's guard check before a compiled
# call (176 us there) is left out, in both modes, as in the default mode's prediction.
GRAPH_REPLAY_S = 128e-6 + 41e-6


@dataclass(frozen=True)
class HostModel:
    """Seconds of host time per issued op, by who issues it."""

    forward_op_s: float  # an aten op of the forward (Python module code issues it)
    backward_op_s: float  # an aten op the autograd engine issues (backward, recompute)
    optimizer_op_s: float  # an aten op of the optimizer step (foreach calls, scaler)
    optimizer_tensor_s: float  # the optimizer's Python work per parameter tensor per step
    launch_s: float  # a CUDA kernel launch (cudaLaunchKernel) on top of issuing the op
    source: str = ""
    # one replay of a CUDA graph by torch.compile's cudagraph trees (mode="reduce-overhead"):
    # their Python checks and input copies, then cudaGraphLaunch, in place of every kernel
    # launch of the graph (docs/references.md, section 22)
    graph_replay_s: float = GRAPH_REPLAY_S

    def issue_s(self, phase: str) -> float:
        """Host seconds to issue one op of ``phase`` (its kernel launch aside)."""
        return getattr(self, f"{issuer_of(phase)}_op_s")

    def __post_init__(self) -> None:
        for name in ("forward_op_s", "backward_op_s", "optimizer_op_s", "optimizer_tensor_s",
                     "launch_s", "graph_replay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"HostModel.{name} must be >= 0, got {getattr(self, name)}")


# Measured on a 2-core AMD EPYC VM with torch 2.13 (CPU build), one thread: real steps of
# miniature GPT-2, Llama and BERT models (2 layers, width 64, 8 tokens) whose kernels take
# well under a microsecond, fitted per issuer (benchmarks/bench_host_overhead.py, median of
# three rounds: forward 11.8, backward 4.3, optimizer 14.6 us per op; the per-tensor term
# fitted to zero). The CPU kernels of those tiny ops stand in for the CUDA runtime's per-op
# work except the launch itself: a bare cuLaunchKernel takes 3.0 us of host time (PyTorch's
# tritonbench, GB200; docs/references.md, section 14).
CPU_MEASURED_HOST = HostModel(
    forward_op_s=11.8e-6, backward_op_s=4.3e-6, optimizer_op_s=14.6e-6,
    optimizer_tensor_s=0.0, launch_s=3.0e-6,
    source="measured on a 2-core AMD EPYC, torch 2.13 (docs/references.md, section 14)")

# An eager CUDA step issues each op more slowly than those CPU steps do. Fitted on the public
# GPU corpus's fit split (docs/references.md, section 15; benchmarks/bench_gpu_corpus.py:
# transformers BertLayer steps on a V100 with PyTorch 1.13 at host-bound batch sizes), the
# forward's per-op cost is 1.464x the CPU figure and the autograd engine's 3.678x (17.3 and
# 15.8 us per op; refitted when the GEMM model began storing output tiles after their main
# loops and the normalization and softmax shares were fitted on their own kernels,
# docs/references.md, section 28); the held-out batch sizes and launch-bound matmuls
# confirm both. The scales mix the CUDA path's
# own per-op work (device guards, streams, the caching allocator, the engine's device thread)
# with that host's CPU and PyTorch version. The optimizer's
# figure is not scaled: no record of the corpus tests it.
CUDA_FORWARD_ISSUE_SCALE = 1.464
CUDA_BACKWARD_ISSUE_SCALE = 3.678


def for_cuda(host: HostModel) -> HostModel:
    """The per-op issue costs of an eager CUDA step, from a CPU measurement of them."""
    return replace(host, forward_op_s=host.forward_op_s * CUDA_FORWARD_ISSUE_SCALE,
                   backward_op_s=host.backward_op_s * CUDA_BACKWARD_ISSUE_SCALE,
                   source=host.source + "; eager CUDA issue scales fitted on the GPU corpus "
                   "(docs/references.md, section 15)")


DEFAULT_HOST = for_cuda(CPU_MEASURED_HOST)
