"""Benchmark of `tilefit.tuning`'s batch search on a simulated device (CPU) or a real GPU.

CPU (default): three models x ten memory limits on the simulated device (memory_limit_bytes).
For each: tilefit's fit-trial count, the exactness of its largest fitting batch (checked by an
independent oracle: two plain training steps in this file's own loop under the same memory
accounting, at max and max + 1), the trial counts of Lightning's binsearch (init_val 2) and
accelerate's 0.9x walk-down from 128 on that same oracle, whether the chosen batch fits, and
whether the model/optimizer/RNG state came back bit for bit (one run per model is interrupted
mid-trial with KeyboardInterrupt).

    PYTHONPATH=src python benchmarks/bench_tune_search.py            # simulated device, CPU
    PYTHONPATH=src python benchmarks/bench_tune_search.py --device cuda
        # real GPU memory; adds the throughput check: the chosen batch's samples/s against the
        # best of an exhaustive sweep (every multiple of 8 up to the max, and the max)
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tilefit.tuning import TuneSearch, tune
from tilefit.tuning.search import accelerate_walkdown, lightning_binsearch
from tilefit.tuning.simulate import MemoryLimitMode

MARGIN = 0.10
STEPS = 2  # as tune's DEFAULT_STEPS_PER_TRIAL: the oracle must run the same workload


# --- the three models (factories: a fresh, seeded module each call) ---


def mlp(width: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Dropout(0.1), nn.Linear(width, 10))


def cnn(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10),
    )


class TinyTransformer(nn.Module):
    def __init__(self, d_model: int = 64, vocab: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                           dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


@dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def specs(scale: int) -> list[Spec]:
    seq = 32
    return [
        Spec("mlp", lambda: mlp(256 * scale),
             lambda b, d: (torch.randn(b, 64, device=d), torch.randint(0, 10, (b,), device=d)),
             _ce),
        Spec("cnn", lambda: cnn(16 * scale),
             lambda b, d: (torch.randn(b, 3, 16, 16, device=d),
                           torch.randint(0, 10, (b,), device=d)), _ce),
        Spec("transformer", lambda: TinyTransformer(64 * scale),
             lambda b, d: (torch.randint(0, 512, (b, seq), device=d),
                           torch.randint(0, 512, (b, seq), device=d)), _ce),
    ]


def fresh(spec: Spec, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = spec.build().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# --- the independent oracle: our own plain loop under the same accounting ---


class Oracle:
    """peak(b): the highest live bytes of STEPS plain training steps, cached per b."""

    def __init__(self, spec: Spec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.peaks: dict[int, int] = {}

    def peak(self, b: int) -> int:
        if b not in self.peaks:
            model, opt = fresh(self.spec, self.device)
            mode = MemoryLimitMode(None, [*model.parameters(), *model.buffers()])
            with mode:  # the usual loop: batch and loss stay bound until the next ones
                for _ in range(STEPS):
                    batch = self.spec.make_batch(b, self.device)
                    loss = self.spec.loss_fn(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                del batch, loss
            self.peaks[b] = mode.peak_bytes
        return self.peaks[b]

    def fits(self, budget_bytes: int) -> Callable[[int], bool]:
        return lambda b: self.peak(b) <= budget_bytes


# --- state equality ---


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "tensors": [t.detach().clone() for t in (*model.parameters(), *model.buffers())],
        "modes": [m.training for m in model.modules()],
        "opt": copy.deepcopy(opt.state_dict()),
        "rng": (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(),
                torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []),
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ok = all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"], strict=True))
    ok &= a["modes"] == b["modes"] and a["opt"]["param_groups"] == b["opt"]["param_groups"]
    ok &= a["opt"]["state"].keys() == b["opt"]["state"].keys()
    for k, s in a["opt"]["state"].items():
        ok &= all(torch.equal(v, b["opt"]["state"][k][n]) for n, v in s.items())
    ra, rb = a["rng"], b["rng"]
    ok &= torch.equal(ra[0], rb[0]) and np.array_equal(ra[1], rb[1]) and ra[2] == rb[2]
    ok &= all(torch.equal(x, y) for x, y in zip(ra[3], rb[3], strict=True))
    return bool(ok)


def interrupted_run(spec: Spec, device: torch.device, limit_bytes: int) -> bool:
    """tune with a KeyboardInterrupt raised in the 2nd trial's 2nd step: state restored?"""
    model, opt = fresh(spec, device)
    before = state_of(model, opt)
    calls = {"n": 0}

    def batch(b: int) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return spec.make_batch(b, device)

    try:
        tune(model, batch, loss_fn=spec.loss_fn, optimizer=opt, device=device,
             search=TuneSearch(memory_limit_bytes=limit_bytes, margin=MARGIN,
                               measure_throughput=False))
    except KeyboardInterrupt:
        pass
    else:
        return False
    return same_state(before, state_of(model, opt))


# --- the simulated-device benchmark ---

TARGET_MAX = (5, 9, 17, 31, 60, 113, 250, 477, 900, 1700)  # spread over 2.5 decades


def limits_for(oracle: Oracle) -> list[int]:
    """Memory limits whose budgets sit between the oracle's peaks at TARGET_MAX and one more
    sample (where the peak is flat in b, e.g. the MLP's optimizer-step peak at small batches,
    the exact maximum is larger than the target; exact_max says what it is)."""
    out = []
    for t in TARGET_MAX:
        budget = (oracle.peak(t) + oracle.peak(t + 1)) // 2
        out.append(int(budget / (1 - MARGIN)) + 1)
    return out


def exact_max(fits: Callable[[int], bool], claimed: int) -> int | None:
    """``claimed`` if it is the exact largest fitting batch (it fits and claimed + 1 does not:
    peak memory is non-decreasing in the batch size), else None."""
    return claimed if fits(claimed) and not fits(claimed + 1) else None


def run_simulated(device: torch.device, measure_throughput: bool) -> bool:
    rows = []
    all_ok = True
    for spec in specs(scale=1):
        oracle = Oracle(spec, device)
        limits = limits_for(oracle)
        restored_interrupt = interrupted_run(spec, device, limits[len(limits) // 2])
        all_ok &= restored_interrupt
        for limit in limits:
            budget = int(limit * (1 - MARGIN))
            fits = oracle.fits(budget)
            model, opt = fresh(spec, device)
            before = state_of(model, opt)
            t0 = time.perf_counter()
            result = tune(model, lambda b, s=spec: s.make_batch(b, device), loss_fn=spec.loss_fn,
                          optimizer=opt, device=device,
                          search=TuneSearch(memory_limit_bytes=limit, margin=MARGIN,
                                            measure_throughput=measure_throughput))
            elapsed_s = time.perf_counter() - t0
            restored = same_state(before, state_of(model, opt))
            truth = exact_max(fits, result.max_fitting_batch_size)
            light = lightning_binsearch(fits)
            accel = accelerate_walkdown(fits)
            ok = (result.max_fitting_batch_size == truth and fits(result.batch_size)
                  and restored and result.fit_trials < light.trials)
            all_ok &= ok
            print(f"  {spec.name} limit {limit}: tilefit {result.max_fitting_batch_size} in "
                  f"{result.fit_trials} fit trials, Lightning {light.trials}, ok={ok}",
                  file=sys.stderr, flush=True)
            rows.append((spec.name, limit, truth, result.max_fitting_batch_size,
                         result.fit_trials, light.trials, light.max_batch, accel.trials,
                         accel.max_batch, result.batch_size, fits(result.batch_size), restored,
                         restored_interrupt, elapsed_s, ok))
    header = ("model", "limit_B", "exact", "tilefit", "tf_trials", "L_trials", "L_result",
              "acc_trials", "acc_result", "chosen", "chosen_fits", "restored",
              "restored_interrupt", "time_s", "ok")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r))
    tf = [r[4] for r in rows]
    lt = [r[5] for r in rows]
    ac = [r[7] for r in rows]
    print(f"\nruns: {len(rows)}; exact max found: {sum(r[2] == r[3] for r in rows)}/{len(rows)}; "
          f"fewer fit trials than Lightning: {sum(a < b for a, b in zip(tf, lt, strict=True))}"
          f"/{len(rows)}; chosen batch fits: {sum(r[10] for r in rows)}/{len(rows)}; "
          f"state restored: {sum(r[11] for r in rows)}/{len(rows)}; interrupted runs (one per "
          f"model) restored: {all(r[12] for r in rows)}")
    print(f"fit trials  tilefit mean {np.mean(tf):.1f} max {max(tf)} | Lightning binsearch "
          f"mean {np.mean(lt):.1f} max {max(lt)} | accelerate mean {np.mean(ac):.1f} "
          f"max {max(ac)} (accelerate never exceeds 128; wrong max where exact > 128: "
          f"{sum(r[8] != r[2] for r in rows)}/{len(rows)})")
    return all_ok


# --- the GPU throughput check ---


def cuda_throughput_rows(scale: int) -> list[dict[str, Any]]:
    """For each model: tune on the live GPU, then an exhaustive sweep of candidate sizes
    (every multiple of 8 up to the max, and the max) measured in the same conditions; the
    chosen size's samples/s against the sweep's best (target: within 3%)."""
    from tilefit.tuning.executor import Executor
    from tilefit.tuning.state import snapshot

    device = torch.device("cuda")
    rows = []
    for spec in specs(scale):
        model, opt = fresh(spec, device)
        t0 = time.perf_counter()
        result = tune(model, lambda b, s=spec: s.make_batch(b, device), loss_fn=spec.loss_fn,
                      optimizer=opt, device=device,
                      search=TuneSearch(max_batch=8192, margin=MARGIN))
        elapsed_s = time.perf_counter() - t0
        top = result.max_fitting_batch_size
        sizes = sorted({*range(8, top + 1, 8), top})
        ex = Executor(model=model, make_batch=lambda b, s=spec: s.make_batch(b, device),
                      loss_fn=spec.loss_fn, optimizer=opt, snap=snapshot(model, opt),
                      precision="fp32", device=device, memory_limit_bytes=None, margin=MARGIN,
                      steps_per_trial=STEPS, warmup_steps=2, repeats=3, min_timed_steps=3)
        sweep = {b: max(r) for b in sizes if (r := ex.throughput(b, 1))}
        best_b = max(sweep, key=sweep.__getitem__)
        # the chosen size re-measured in the same sweep, so both sides share conditions
        chosen_rate = sweep.get(result.batch_size, result.samples_per_s or 0.0)
        rows.append({"model": spec.name, "max_fitting_batch": top, "chosen": result.batch_size,
                     "predicted_max_batch": result.predicted_max_batch,
                     "chosen_samples_per_s": chosen_rate, "sweep_best_batch": best_b,
                     "sweep_best_samples_per_s": sweep[best_b],
                     "ratio": chosen_rate / sweep[best_b], "fit_trials": result.fit_trials,
                     "tune_time_s": elapsed_s})
    return rows


def run_cuda(scale: int) -> bool:
    rows = cuda_throughput_rows(scale)
    print("model | max_fit | chosen | chosen_samples_per_s | sweep_best_b | "
          "sweep_best_samples_per_s | ratio | fit_trials | time_s")
    for r in rows:
        print(f"{r['model']} | {r['max_fitting_batch']} | {r['chosen']} | "
              f"{r['chosen_samples_per_s']:,.0f} | {r['sweep_best_batch']} | "
              f"{r['sweep_best_samples_per_s']:,.0f} | {r['ratio']:.3f} | {r['fit_trials']} | "
              f"{r['tune_time_s']:.1f}")
    return all(r["ratio"] >= 0.97 for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--no-throughput", action="store_true",
                        help="simulated runs: skip the timing phase (faster)")
    parser.add_argument("--scale", type=int, default=8, help="cuda: model width multiplier")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: the throughput target needs a GPU", file=sys.stderr)
            return 2
        ok = run_cuda(args.scale)
    else:
        ok = run_simulated(torch.device("cpu"), not args.no_throughput)
    print("\nALL TARGETS MET" if ok else "\nSOME TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
