"""Measure the host side of eager PyTorch on this machine: seconds per issued op.

Real training steps of miniature models (the catalog's GPT-2, Llama and BERT blocks at
width 64, two layers, eight tokens: every kernel takes well under a microsecond) are timed
phase by phase; the same step traced by tilefit counts the ops each phase issues. The forward,
backward and optimizer costs per op are the pooled ratios of time to op count; the
optimizer's per-tensor Python work and per-op cost are fitted together by least squares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tilefit.hardware.host import DEFAULT_HOST, ISSUERS, HostModel, issuer_of

# Miniature versions of catalog models: the same module structure, tiny widths.
MINIATURES: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64},
    "llama-3.2-1b": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                     "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1},
    "bert-base-uncased": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 2, "vocab_size": 256},
}
SEQ_LEN = 8


@dataclass(frozen=True)
class HostSample:
    """One miniature model: measured seconds and traced op counts per phase."""

    model: str
    time_s: dict[str, float]  # fastest of the repeats, per phase
    ops: dict[str, int]  # aten ops the phase issues (tilefit's trace)
    param_tensors: int


@dataclass(frozen=True)
class HostFit:
    host: HostModel
    samples: tuple[HostSample, ...]
    threads: int

    def predicted_s(self, sample: HostSample) -> dict[str, float]:
        h = self.host
        return {"forward": sample.ops["forward"] * h.forward_op_s,
                "backward": sample.ops["backward"] * h.backward_op_s,
                "optimizer": sample.ops["optimizer"] * h.optimizer_op_s
                + sample.param_tensors * h.optimizer_tensor_s}


def measure_sample(name: str, *, repeats: int = 20, warmup: int = 5,
                   device: str = "cpu") -> HostSample:
    """Time real steps of one miniature model on ``device``, and count its ops from a trace.
    On a GPU the kernels of these tiny ops finish before the next is issued, so each phase's
    time (synchronised at its end) is the host's issue time of its ops, launches included."""
    import torch

    from tilefit.loop import Hooks, training_step
    from tilefit.models import load_workload
    from tilefit.quiet_imports import quiet_transformers
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    clock = _PhaseClock(device)
    hooks = Hooks(phase=clock.phase)

    work = load_workload(name, seq_len=SEQ_LEN).with_config(**MINIATURES[name])
    # plain PyTorch's loop in fp32 (no clipping, no loss read), the step traced below
    recipe = Recipe(batch_size=1, precision="fp32")
    with quiet_transformers():
        model = work.build("sdpa").to(device)
        model.train()
        batch = work.make_batch(1, device=device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        best = dict.fromkeys(ISSUERS, float("inf"))
        for i in range(warmup + repeats):
            clock.marks.clear()
            training_step(lambda: work.loss_fn(model, batch), opt, params, recipe,
                          hooks=hooks)
            spent = clock.spent_s()
            if i >= warmup:
                for issuer in ISSUERS:
                    best[issuer] = min(best[issuer], spent[issuer])
    # the CUDA target's op stream (foreach optimizer), fp32: no autocast casts
    tr = trace_workload(work, recipe, "a100-80gb")
    steady = tr.ops_of_step(1)
    ops = {issuer: sum(1 for o in steady if issuer_of(o.phase) == issuer)
           for issuer in ISSUERS}
    return HostSample(name, best, ops, len(params))


class _PhaseClock:
    """tilefit.loop's phase hook as a clock: each phase's start, the device synchronised
    first (its kernels finish before the next phase's time begins)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.marks: list[tuple[str, float]] = []

    def phase(self, name: str) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()
        self.marks.append((name, time.perf_counter()))

    def spent_s(self) -> dict[str, float]:
        """Seconds of the step marked so far, per issuer (hardware.host.issuer_of of each
        phase), up to now."""
        self.phase("")
        spent = dict.fromkeys(ISSUERS, 0.0)
        for (name, start), (_, end) in zip(self.marks, self.marks[1:], strict=False):
            spent[issuer_of(name)] += end - start
        return spent


def fit_host(samples: list[HostSample], *, launch_s: float = DEFAULT_HOST.launch_s,
             source: str = "") -> HostModel:
    """Per-op costs from measured samples (pooled ratios; least squares for the optimizer's
    per-op and per-tensor terms, clipped at zero)."""
    import numpy as np

    def ratio(phase: str) -> float:
        return sum(s.time_s[phase] for s in samples) / max(1, sum(s.ops[phase]
                                                                  for s in samples))

    a = np.array([[s.ops["optimizer"], s.param_tensors] for s in samples], dtype=float)
    y = np.array([s.time_s["optimizer"] for s in samples])
    (per_op, per_tensor), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_op < 0 or per_tensor < 0:  # degenerate samples: all of it per op
        per_op, per_tensor = ratio("optimizer"), 0.0
    return HostModel(forward_op_s=ratio("forward"), backward_op_s=ratio("backward"),
                     optimizer_op_s=float(per_op), optimizer_tensor_s=float(per_tensor),
                     launch_s=launch_s, source=source)


def measure_host(*, repeats: int = 20, device: str = "cpu") -> HostFit:
    """The host model of this machine (its CPU, its PyTorch). On the CPU the per-op costs
    stand for eager CUDA's after tilefit.hardware.host.for_cuda (the fitted CUDA path
    scales) plus a launch each; measured on a GPU ("cuda") they are eager CUDA's own,
    launches included (launch_s = 0: already in each op's figure)."""
    import platform

    import torch

    samples = [measure_sample(name, repeats=repeats, device=device) for name in MINIATURES]
    where = torch.cuda.get_device_name() if device != "cpu" else "the CPU"
    source = (f"measured on {platform.processor() or platform.machine()} issuing to {where}, "
              f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    launch_s = DEFAULT_HOST.launch_s if device == "cpu" else 0.0
    return HostFit(fit_host(samples, launch_s=launch_s, source=source), tuple(samples),
                   torch.get_num_threads())
