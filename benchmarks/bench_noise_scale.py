"""Benchmark of `tilefit.noise_scale` (docs/references.md, section 18): exact, real, cost.

1. Exact case. Linear least squares, x ~ N(0, C) with C diagonal, y = w*.x + e with
   e ~ N(0, s^2) independent of x, per-sample loss l = (w.x - y)^2 / 2, d = w - w*.
   The per-sample gradient is g = x (x.d - e), so the true gradient is G = E[g] = C d and
   |G|^2 = d'C^2 d. Its second moment, by Isserlis' theorem for Gaussian x
   (E[x_i x_j x_k x_l] = C_ij C_kl + C_ik C_jl + C_il C_jk) and E[e] = 0, E[e^2] = s^2:
       E[g g'] = E[x x' (x.d)^2] + s^2 C = C (d'Cd) + 2 C d d' C + s^2 C,
   so Sigma = E[g g'] - G G' = C (d'Cd + s^2) + C d d' C and
       tr(Sigma) = tr(C) (d'Cd + s^2) + |Cd|^2,   B_simple = tr(Sigma) / |G|^2.
   tilefit's estimate (from squared gradient norms at two batch sizes only) is compared with
   this at three parameter vectors, and the coverage of its 90% interval is counted over
   repeated measurements.
2. Real cases. scikit-learn's bundled digits (an MLP) and the English help text that ships
   with Python (pydoc_data.topics; a character-level MLP language model). Each is trained
   with plain SGD to a target loss on a fixed evaluation set at 8 or 9 batch sizes, the
   learning rate tuned per batch size (powers of 2, the best of each), averaged over seeds;
   S(B) = S_min (1 + B_crit / B) is fitted to the steps (eq. 2.11), and B_simple measured by
   tilefit on a reference run (batch 32, its best lr) after 10%, 25%, 50% and 100% of its steps
   is compared with the fitted B_crit. For digits the exact B_simple of the whole data set
   (per-sample gradients with torch.func) is printed beside tilefit's estimate.
3. Cost. tilefit.noise_scale with its defaults against the time of a training step (forward,
   backward, SGD step) at the big batch, on each task's model and a wider MLP.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_noise_scale.py [--quick]

Writes benchmarks/results_noise_scale_cpu.txt and benchmarks/noise_scale_cpu.png.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tilefit.tuning.noise import StepsFit, fit_steps_curve
from tilefit.tuning.noise_measure import noise_scale
from tilefit.tuning.options import NoiseMeasure

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results_noise_scale_cpu.txt"
PLOT = HERE / "noise_scale_cpu.png"
MEASURE = NoiseMeasure(batch_sizes=(8, 128), measurements=20)  # the real cases' measurement
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)  # points of the reference run measured
EARLY = 0.1  # "early in training": after the first tenth of the reference run
REFERENCE_BATCH = 32

LINES: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    LINES.append(text)


# ---- 1. the exact case -------------------------------------------------------------------------


def least_squares(d: int, s: float, distance: float, seed: int
                  ) -> tuple[nn.Module, Callable[[int], Any], float, float]:
    """A model at w = w* + distance * u, its data, and the closed-form |G|^2, tr(Sigma)."""
    torch.manual_seed(seed)
    scales = torch.linspace(0.5, 1.5, d)
    w_star = torch.randn(d)
    u = torch.randn(d)
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + distance * u / u.norm())[None])
    gen = torch.Generator().manual_seed(seed + 1)

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, d, generator=gen) * scales
        return x, x @ w_star + s * torch.randn(b, generator=gen)

    delta, c = (model.weight.detach()[0] - w_star).double(), (scales**2).double()
    g2 = float(((c * delta) ** 2).sum())
    trace = float(c.sum()) * (float((c * delta * delta).sum()) + s**2) + g2
    return model, make_batch, g2, trace


def half_mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()


def exact_case(quick: bool) -> bool:
    say("## 1. exact case: linear least squares, d = 32, s = 0.5, x ~ N(0, diag(0.5..1.5)^2)")
    say("distance | closed |G|^2 | est | closed tr(S) | est | closed B | est B | 90% CI | "
        "error | ok")
    ok = True
    for distance in (2.0, 0.5, 0.1):
        model, make_batch, g2, trace = least_squares(32, 0.5, distance, seed=0)
        batch_small, batch_big = (8, 64) if distance > 1 else (8, 512)
        r = noise_scale(model, make_batch, loss_fn=half_mse, device="cpu",
                        measure=NoiseMeasure(batch_sizes=(batch_small, batch_big),
                                             measurements=200))
        err = r.b_simple / (trace / g2) - 1
        ok &= abs(err) <= 0.10
        say(f"{distance} | {g2:.4g} | {r.gradient_sq_norm:.4g} | {trace:.4g} | "
            f"{r.trace_sigma:.4g} | {trace / g2:.4g} | {r.b_simple:.4g} | "
            f"[{r.b_simple_low:.4g}, {r.b_simple_high:.4g}] | {err:+.1%} | "
            f"{abs(err) <= 0.10}  (batch_sizes=({batch_small}, {batch_big}), 200 measurements)")
    runs = 40 if quick else 200
    model, make_batch, g2, trace = least_squares(32, 0.5, 0.5, seed=1)
    covered = sum(r.b_simple_low <= trace / g2 <= r.b_simple_high for r in (
        noise_scale(model, make_batch, loss_fn=half_mse, device="cpu") for _ in range(runs)))
    say(f"coverage of the 90% bootstrap interval with the defaults (batch_sizes=(8, 64), 10 "
        f"measurements) at distance 0.5 (B_simple {trace / g2:.4g}): {covered}/{runs} = "
        f"{covered / runs:.0%}")
    return ok


# ---- 2. real cases -------------------------------------------------------------------------


@dataclass
class Task:
    name: str
    x: torch.Tensor  # the training set's inputs
    y: torch.Tensor
    make_model: Callable[[], nn.Module]
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    target: float
    batch_sizes: tuple[int, ...]
    lrs: tuple[float, ...]
    max_steps: int

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(self.eval_x), self.eval_y))


def digits_task() -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target)

    def make_model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))

    return Task("digits (scikit-learn, 1797 images; MLP 64-64-10)", x, y, make_model, x, y,
                target=0.1, batch_sizes=(4, 8, 16, 32, 64, 128, 256, 512),
                lrs=tuple(0.025 * 2**k for k in range(9)), max_steps=20000)


CONTEXT = 8


class CharMLP(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.hidden = nn.Linear(16 * CONTEXT, 128)
        self.out = nn.Linear(128, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x).flatten(1))))


def text_task() -> Task:
    import pydoc_data.topics as topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    chars = sorted(set(text))
    code = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([code[c] for c in text])
    starts = torch.arange(len(data) - CONTEXT)
    x = data[starts[:, None] + torch.arange(CONTEXT)]  # every window of 8 characters
    y = data[starts + CONTEXT]  # the character after it
    ev = torch.randint(0, len(starts), (8192,), generator=torch.Generator().manual_seed(0))
    return Task(f"text (Python's pydoc_data help, {len(text):,} chars; char MLP, ctx 8)",
                x, y, lambda: CharMLP(len(chars)), x[ev], y[ev], target=2.4,
                batch_sizes=(8, 16, 32, 64, 128, 256, 512, 1024, 2048),
                lrs=tuple(0.1 * 2**k for k in range(7)),
                max_steps=12000)


def steps_to_target(task: Task, fetch: Callable[[torch.Tensor], Any], batch: int, lr: float,
                    seed: int, cap: int) -> int | None:
    """Plain SGD at (batch, lr) from a seeded init; the first step (checked every step up to
    50, then every 2%) at which the evaluation loss is at or below the target."""
    torch.manual_seed(seed)
    model = task.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 100)
    for step in range(1, cap + 1):
        xb, yb = fetch(torch.randint(0, len(task.y), (batch,), generator=gen))
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % max(1, step // 50) == 0:
            value = task.eval_loss(model)
            if not math.isfinite(value):
                return None
            if value <= task.target:
                return step
    return None


def best_steps(task: Task, fetch: Callable[[torch.Tensor], Any], batch: int, seeds: int
               ) -> tuple[float, float]:
    """(mean steps over seeds, lr) at the best lr of the grid; runs over the best so far
    by 30% are cut short."""
    best: tuple[float, float] | None = None
    for lr in task.lrs:
        found = []
        for seed in range(seeds):
            cap = task.max_steps if best is None else int(best[0] * 1.3) + 1
            s = steps_to_target(task, fetch, batch, lr, seed, cap)
            if s is None:
                break
            found.append(s)
        if len(found) == seeds and (best is None or sum(found) / seeds < best[0]):
            best = (sum(found) / seeds, lr)
    assert best is not None, f"no lr reached the target at batch {batch}"
    return best


def reference_measurements(task: Task, fetch: Callable[[torch.Tensor], Any], lr: float,
                           steps: float) -> list[tuple[float, int, float, Any, float | None]]:
    """(fraction, step, eval loss, tilefit's NoiseScale, exact B_simple or None) along a
    reference run at REFERENCE_BATCH."""
    torch.manual_seed(0)
    model = task.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(100)
    data_gen = torch.Generator().manual_seed(7)

    def make_batch(b: int) -> Any:
        return fetch(torch.randint(0, len(task.y), (b,), generator=data_gen))

    out = []
    marks = {max(1, round(f * steps)): f for f in FRACTIONS}
    for step in range(1, max(marks) + 1):
        xb, yb = fetch(torch.randint(0, len(task.y), (REFERENCE_BATCH,), generator=gen))
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step in marks:
            r = noise_scale(model, make_batch, loss_fn=ce, device="cpu", measure=MEASURE)
            exact = exact_b_simple(model, task) if len(task.y) < 5000 else None
            out.append((marks[step], step, task.eval_loss(model), r, exact))
    return out


def run_weighted_b(measured: list[tuple[float, int, float, Any, float | None]]) -> float:
    """The B_crit eq. 2.11 predicts for a run whose noise scale changes. In phase j (up to
    the j-th measurement, noise scale B_j) the reference run at batch B_ref took ds_j =
    S_min,j (1 + B_j / B_ref) steps; summing S(B) = sum_j S_min,j (1 + B_j / B) over the
    phases gives S_min (1 + B_eff / B) with B_eff = sum_j S_min,j B_j / sum_j S_min,j."""
    weights, weighted, previous = 0.0, 0.0, 0
    for _, step, _, r, _ in measured:
        s_min_j = (step - previous) / (1 + r.b_simple / REFERENCE_BATCH)
        weights += s_min_j
        weighted += s_min_j * r.b_simple
        previous = step
    return weighted / weights


def ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def exact_b_simple(model: nn.Module, task: Task) -> float:
    """tr(Sigma) / |G|^2 of the whole (finite) data set from per-sample gradients."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, task.x, task.y)
    flat = torch.cat([v.reshape(len(task.y), -1) for v in per.values()], 1).double()
    g = flat.mean(0)
    return float(((flat - g) ** 2).sum(1).mean() / (g @ g))


def real_case(task: Task, fetch: Callable[[torch.Tensor], Any], seeds: int
              ) -> tuple[dict[int, float], StepsFit, list[Any], bool]:
    say(f"## 2. {task.name}: SGD to eval loss {task.target}, lr tuned per batch "
        f"(grid {task.lrs[0]:g} x 2^k), mean of {seeds} seeds")
    say("batch | steps | best lr")
    steps: dict[int, float] = {}
    lrs: dict[int, float] = {}
    for b in task.batch_sizes:
        steps[b], lrs[b] = best_steps(task, fetch, b, seeds)
        say(f"{b} | {steps[b]:.1f} | {lrs[b]:g}")
    fit = fit_steps_curve(list(steps), list(steps.values()))
    say(f"fit S(B) = S_min (1 + B_crit/B): S_min = {fit.s_min:.1f}, B_crit = {fit.b_crit:.1f}, "
        f"worst relative error {fit.max_relative_error:.0%}")
    measured = reference_measurements(task, fetch, lrs[REFERENCE_BATCH], steps[REFERENCE_BATCH])
    say(f"tilefit B_simple on the reference run (batch {REFERENCE_BATCH}, lr "
        f"{lrs[REFERENCE_BATCH]:g}), batch_sizes={MEASURE.batch_sizes}, "
        f"{MEASURE.measurements} measurements:")
    say("fraction | step | eval loss | B_simple | 90% CI | exact (whole data) | "
        "B_simple / B_crit | time_s")
    for frac, step, loss, r, exact in measured:
        say(f"{frac:.0%} | {step} | {loss:.3f} | {r.b_simple:.1f} | [{r.b_simple_low:.1f}, "
            f"{r.b_simple_high:.1f}] | {'' if exact is None else f'{exact:.1f}'} | "
            f"{r.b_simple / fit.b_crit:.2f} | {r.time_s:.2f}")
    weighted = run_weighted_b(measured)
    say(f"B_simple over the whole reference run, each phase weighted by its S_min share "
        f"(see run_weighted_b): {weighted:.1f}, / B_crit = {weighted / fit.b_crit:.2f}")
    early = next(r for frac, _, _, r, _ in measured if frac == EARLY)
    ok = 0.5 <= early.b_simple / fit.b_crit <= 2
    say(f"early ({EARLY:.0%}) B_simple {early.b_simple:.1f} vs fitted B_crit {fit.b_crit:.1f}: "
        f"ratio {early.b_simple / fit.b_crit:.2f}, within a factor of 2: {ok}")
    return steps, fit, measured, ok


# ---- 3. cost -------------------------------------------------------------------------------


def step_time_s(model: nn.Module, make_batch: Callable[[int], Any], batch: int) -> float:
    """Median over 3 repeats of 10 SGD steps at ``batch`` (after 3 warm-up steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            ce(model, make_batch(batch)).backward()
            opt.step()

    steps(3)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        steps(10)
        times.append((time.perf_counter() - start) / 10)
    return sorted(times)[1]


class CharTransformer(nn.Module):
    """A 2-layer causal transformer over 64 characters: compute grows with the batch."""

    def __init__(self, vocab: int, d: int = 128, length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(length, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(x) + self.pos, mask=self.mask, is_causal=True)
        return self.out(h).flatten(0, 1)


CostModel = tuple[str, Callable[[], nn.Module], Callable[[torch.Tensor], Any], int]


def cost_models(digits: Task, text: Task) -> list[CostModel]:
    """(name, model factory, fetch(indices) -> batch, samples) for the cost table."""
    stream = torch.cat([text.x[:, 0], text.x[-1, 1:]])  # the text again, as one sequence
    vocab = int(stream.max()) + 1

    def sequences(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = stream[idx[:, None] + torch.arange(65)]
        return w[:, :-1], w[:, 1:].flatten()

    return [
        (digits.name, digits.make_model, digits.batch, len(digits.y)),
        (text.name, text.make_model, text.batch, len(text.y)),
        ("wide MLP 64-1024-1024-10 on digits", lambda: nn.Sequential(
            nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 10)), digits.batch, len(digits.y)),
        ("char transformer on the text (2 layers, d 128, 64 chars)",
         lambda: CharTransformer(vocab), sequences, len(stream) - 65),
    ]


def cost(models: list[CostModel]) -> bool:
    say("## 3. cost: one noise_scale call with its defaults (batch_sizes=(8, 64), 10 "
        "measurements; wall time of the whole call, median of 3) in training steps at 64")
    say("model | step at 8 (ms) | step at 64 (ms) | noise_scale (ms) | in steps at 64 | <= 20")
    ok = True
    for name, make_model, fetch, n in models:
        torch.manual_seed(0)
        model = make_model()
        gen = torch.Generator().manual_seed(3)

        def make_batch(b: int, fetch: Any = fetch, gen: torch.Generator = gen,
                       n: int = n) -> Any:
            return fetch(torch.randint(0, n, (b,), generator=gen))

        step_8, step_64 = step_time_s(model, make_batch, 8), step_time_s(model, make_batch, 64)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            noise_scale(model, make_batch, loss_fn=ce, device="cpu")
            runs.append(time.perf_counter() - start)
        call_s = sorted(runs)[1]
        ratio = call_s / step_64
        ok &= ratio <= 20
        say(f"{name} | {step_8 * 1e3:.2f} | {step_64 * 1e3:.2f} | {call_s * 1e3:.1f} | "
            f"{ratio:.1f} | {ratio <= 20}")
    return ok


# ---- the plot and main ----------------------------------------------------------------------


def plot(results: list[tuple[Task, dict[int, float], StepsFit, list[Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    for ax, (task, steps, fit, measured) in zip(axes, results, strict=True):
        bs = sorted(steps)
        grid = [bs[0] * (bs[-1] / bs[0]) ** (i / 99) for i in range(100)]
        ax.loglog(bs, [steps[b] for b in bs], "o", label="measured steps to target")
        ax.loglog(grid, [fit.steps(b) for b in grid], "-",
                  label=f"fit: S_min={fit.s_min:.1f}, B_crit={fit.b_crit:.0f}")
        ax.axvline(fit.b_crit, color="C1", ls=":", lw=1)
        for i, (frac, _, _, r, _) in enumerate(measured):
            ax.axvspan(r.b_simple_low, r.b_simple_high, color=f"C{2 + i}", alpha=0.12)
            ax.axvline(r.b_simple, color=f"C{2 + i}", ls="--", lw=1,
                       label=f"tilefit B_simple at {frac:.0%}: {r.b_simple:.0f}")
        ax.set_xlabel("batch size B (samples)")
        ax.set_ylabel(f"SGD steps to eval loss {task.target}")
        ax.set_title(task.name.split(" (")[0], fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one seed, fewer coverage runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = 1 if args.quick else 2
    start_s = time.perf_counter()
    say(f"# benchmarks/bench_noise_scale.py{' --quick' if args.quick else ''}: "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), load average "
        f"{', '.join(f'{v:.2f}' for v in os.getloadavg())} at start")
    exact_ok = exact_case(args.quick)
    digits, text = digits_task(), text_task()
    results, real_ok = [], []
    for task, fetch in ((digits, digits.batch), (text, text.batch)):
        steps, fit, measured, ok = real_case(task, fetch, seeds)
        results.append((task, steps, fit, measured))
        real_ok.append(ok)
    plot(results)
    cost_ok = cost(cost_models(digits, text))
    say(f"## targets: exact within 10%: {exact_ok}; early B_simple within 2x of B_crit: "
        f"{' / '.join(str(o) for o in real_ok)}; cost <= 20 steps: {cost_ok}")
    say(f"total {time.perf_counter() - start_s:.0f} s, load average "
        f"{', '.join(f'{v:.2f}' for v in os.getloadavg())} at the end; plot: {PLOT.name}")
    RESULTS.write_text("\n".join(LINES) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
