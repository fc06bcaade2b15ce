"""Benchmark of the tilefit Lightning callback on the real lightning.Trainer, on a simulated device
(the CPU with tilefit.tuning.simulate's memory cap).

For three LightningModules x three memory caps:

(a) tilefit: ``tilefit_batch_size_finder(memory_limit_bytes=cap)`` picks the batch at fit
    start, then the same Trainer trains ``--steps`` steps at that batch under the same cap
    (``simulated_memory_limit``): OOM yes/no (target: none);
(b) Lightning: ``Tuner(trainer).scale_batch_size(model, mode="binsearch")`` on a fresh copy
    of the module under the same cap (enforced during its trials), then ``--steps`` training
    steps at its batch under the cap. Its trials are counted (one per ``fit_loop.run()``).

Lightning's finder recognises an OOM only by its message (lightning.pytorch.utilities.memory.
is_oom_error: a RuntimeError whose one argument says "CUDA" and "out of memory"), so here the
simulated error is re-raised with such a message (LightningVisibleLimit).

    PYTHONPATH=src python benchmarks/bench_tune_lightning.py [--steps 5] [--no-throughput]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.tuner import batch_size_scaling as bss
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tilefit.tuning.executor import is_oom
from tilefit.tuning.integrations.lightning import simulated_memory_limit, tilefit_batch_size_finder
from tilefit.tuning.simulate import OOM_ERROR, MemoryLimitMode

MARGIN = 0.10  # tilefit's default: the budget is 90% of the cap
TARGETS = (24, 96, 384)  # caps at which a plain loop's peak at these batches is the budget
ROWS = 100_000  # samples per epoch: far above any batch here, so no length cap applies


# --- the modules ---


class Synthetic(Dataset):
    """Samples made on the fly from their index (a TensorDataset's views would make the
    simulated device count the whole dataset tensor as live)."""

    def __init__(self, make: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]):
        self.make = make

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.make(torch.Generator().manual_seed(i))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Dropout(0.1), nn.Linear(256, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class _Transformer(nn.Module):
    def __init__(self, d_model: int = 64, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                           dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def _image(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 16, 16, generator=g), torch.randint(0, 10, (), generator=g)


def _features(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, generator=g), torch.randint(0, 10, (), generator=g)


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 512, (32,), generator=g), torch.randint(0, 512, (32,), generator=g)


@dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[], nn.Module]
    sample: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


SPECS = (Spec("mlp", _mlp, _features), Spec("cnn", _cnn, _image),
         Spec("transformer", _Transformer, _tokens))


class Lit(L.LightningModule):
    def __init__(self, spec: Spec, batch_size: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spec, self.batch_size, self.model = spec, batch_size, spec.build()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Synthetic(self.spec.sample), batch_size=self.batch_size)


# --- the simulated device as Lightning's finder sees it ---


class LightningVisibleLimit(MemoryLimitMode):
    """The simulated OOM with the message Lightning's is_oom_error looks for."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except OOM_ERROR as exc:
            raise OOM_ERROR(f"CUDA out of memory (simulated): {exc}") from None


def cap_for(spec: Spec, batch: int) -> int:
    """A cap whose 90% budget is a plain loop's peak (2 AdamW steps) at ``batch``."""
    module = Lit(spec)
    opt = module.configure_optimizers()
    collate = DataLoader(Synthetic(spec.sample), batch_size=batch).collate_fn
    mode = MemoryLimitMode(None, [*module.parameters(), *module.buffers()])
    with mode:
        for _ in range(2):
            x, y = collate([spec.sample(torch.Generator().manual_seed(i)) for i in range(batch)])
            out = module.model(x)
            loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del x, y, out, loss
    return int(mode.peak_bytes / (1 - MARGIN)) + 1


def trainer(steps: int, callbacks: list[Any]) -> L.Trainer:
    """A CPU Trainer; its root dir (where Lightning's finder writes its checkpoint) is a
    temporary folder."""
    return L.Trainer(accelerator="cpu", max_steps=steps, enable_progress_bar=False,
                     logger=False, enable_checkpointing=False, enable_model_summary=False,
                     callbacks=callbacks, default_root_dir=tempfile.mkdtemp())


def train_oom(fit: Callable[[], Any]) -> bool:
    """Did the training raise the (simulated) device's OOM?"""
    try:
        fit()
    except Exception as exc:  # Lightning re-raises what the step raised
        if not is_oom(exc):
            raise
        return True
    return False


# --- one case ---


def run_tilefit(spec: Spec, cap: int, steps: int, throughput: bool) -> dict[str, Any]:
    module = Lit(spec)
    finder = tilefit_batch_size_finder(memory_limit_bytes=cap, margin=MARGIN,
                                       measure_throughput=throughput)
    limit = simulated_memory_limit(cap)
    t0 = time.perf_counter()
    oom = train_oom(lambda: trainer(steps, [finder, limit]).fit(module))
    result = finder.result
    return {"batch": result.batch_size, "max_fit": result.max_fitting_batch_size,
            "fit_trials": result.fit_trials,
            "tput_trials": len(result.trials) - result.fit_trials, "oom": oom,
            "peak": limit.peak_bytes, "s": time.perf_counter() - t0,
            "fit_s": sum(t.time_s for t in result.trials if t.kind == "fit")}


def run_lightning(spec: Spec, cap: int, steps: int) -> dict[str, Any]:
    """Lightning's finder with the cap enforced during its trials (each ``fit_loop.run()``):
    between trials, while the failed trial's exception still holds its activations, Lightning
    makes small tensors (setup_data) that a real GPU serves from its cache."""
    module = Lit(spec)
    tried: list[int] = []
    original = bss._try_loop_run
    mode = LightningVisibleLimit(None, [*module.parameters(), *module.buffers()])

    def counted(tr: Any, params: dict[str, Any]) -> None:
        tried.append(tr.lightning_module.batch_size)
        mode.limit_bytes = cap
        try:
            original(tr, params)
        finally:
            mode.limit_bytes = None

    bss._try_loop_run = counted
    limit = simulated_memory_limit(cap)
    tr = trainer(steps, [limit])
    t0 = time.perf_counter()
    try:
        with mode:
            chosen = Tuner(tr).scale_batch_size(module, mode="binsearch")
    finally:
        bss._try_loop_run = original
    tune_s = time.perf_counter() - t0
    oom = train_oom(lambda: tr.fit(module))
    return {"batch": chosen, "trials": len(tried), "oom": oom, "peak": limit.peak_bytes,
            "s": tune_s, "tried": tried}


# --- report ---


def header() -> list[str]:
    load = os.getloadavg()
    return [
        "tilefit Lightning callback vs Lightning's BatchSizeFinder (binsearch), simulated device",
        f"python {sys.version.split()[0]}, torch {torch.__version__}, lightning {L.__version__}",
        f"cpus {os.cpu_count()}, torch threads {torch.get_num_threads()}, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"cap: 90% of it is a plain loop's peak at batch {TARGETS}; tilefit margin {MARGIN:.0%};"
        " Lightning: 3 steps per trial, margin 5% on the batch, init 2",
        "",
        f"{'model':<12}{'cap MB':>8} | {'tilefit: batch':>14}{'max fit':>8}{'fit tr':>7}"
        f"{'fit s':>6}{'tput tr':>8}{'all s':>6}{'train OOM':>10}{'peak/cap':>9} | "
        f"{'Lightning: batch':>16}{'trials':>7}{'s':>6}{'train OOM':>10}{'peak/cap':>9}",
        "(fit s: tilefit's fit trials; all s: tuning with the timing phase and the training; "
        "Lightning's s: its finder alone)",
    ]


def row(spec: Spec, cap: int, ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    def ratio(peak: int | None) -> str:
        return "-" if peak is None else f"{peak / cap:.3f}"

    return (f"{spec.name:<12}{cap / 1e6:>8.2f} | {ours['batch']:>14}{ours['max_fit']:>8}"
            f"{ours['fit_trials']:>7}{ours['fit_s']:>6.1f}{ours['tput_trials']:>8}"
            f"{ours['s']:>6.0f}{'yes' if ours['oom'] else 'no':>10}{ratio(ours['peak']):>9} | "
            f"{theirs['batch']:>16}{theirs['trials']:>7}{theirs['s']:>6.1f}"
            f"{'yes' if theirs['oom'] else 'no':>10}{ratio(theirs['peak']):>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps after tuning")
    parser.add_argument("--no-throughput", action="store_true",
                        help="tilefit without its timing phase (the largest fit is chosen)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # Lightning's num_workers and tips
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the finder's steps
    for line in header():
        print(line, flush=True)
    ooms, fit_trials, their_trials = 0, 0, 0
    for spec in SPECS:
        for target in TARGETS:
            cap = cap_for(spec, target)
            ours = run_tilefit(spec, cap, args.steps, not args.no_throughput)
            theirs = run_lightning(spec, cap, args.steps)
            print(row(spec, cap, ours, theirs), flush=True)
            ooms += ours["oom"]
            fit_trials += ours["fit_trials"]
            their_trials += theirs["trials"]
    cases = len(SPECS) * len(TARGETS)
    print(f"\ntilefit: {ooms} of {cases} trainings at the chosen batch ran out of memory "
          f"(target 0); fit trials {fit_trials} in all vs Lightning's {their_trials}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
