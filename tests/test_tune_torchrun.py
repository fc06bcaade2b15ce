"""tune under ``torchrun --nproc-per-node 2`` on the CPU (gloo), the model wrapped in DDP.

Rank 1 simulates a smaller device than rank 0, so on its own it would stop at a smaller
batch. Both ranks must return that smaller batch (found independently on each rank by a
plain loop under the same simulated cap), only rank 0 reports progress, and each rank's
weights, gradients, buffers and optimizer state come back bit for bit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
LIMITS_BYTES = (80_000, 60_000)  # rank 0, rank 1: simulated device sizes
MAX_BATCH = 64


class Net(nn.Module):
    """An MLP with a BatchNorm (buffers DDP broadcasts in each forward; 32 channels of 2
    values, so that it trains at batch 1) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Unflatten(1, (32, 2)),
                                  nn.BatchNorm1d(32), nn.Flatten(), nn.ReLU(),
                                  nn.Dropout(0.1), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 16), torch.randint(0, 4, (b,))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def fresh(wrap: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same weights on every rank, one real step taken (optimizer state exists) and
    gradients left in place."""
    torch.manual_seed(0)
    model: nn.Module = Net()
    if wrap:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model, make_batch(8)).backward()
    opt.step()
    loss_fn(model, make_batch(8)).backward()
    return model, opt


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()],
            "opt": copy.deepcopy(opt.state_dict()), "rng": torch.get_rng_state()}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def largest_fitting(limit_bytes: int) -> int:
    """A second method: two plain steps of the unwrapped model per batch size, in our own
    loop under the simulated cap, counting up until one runs out of memory."""
    from tilefit.tuning.simulate import OOM_ERROR, MemoryLimitMode

    best = 0
    for b in range(1, MAX_BATCH + 1):
        model, opt = fresh(wrap=False)
        model.train()
        live = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
                *(v for s in opt.state.values() for v in s.values())]
        try:
            with MemoryLimitMode(limit_bytes, live):
                for _ in range(2):
                    batch = make_batch(b)
                    loss_fn(model, batch).backward()
                    del batch
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        except OOM_ERROR:
            break
        best = b
    return best


CLI_ARGS = ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape", "32", "--gpu", "cpu",
            "--memory-limit", "400KB", "--global-batch", "32", "--max-batch", "16", "--json"]


def run_cli() -> dict[str, Any]:
    """`tilefit tune ... --json` on this rank (in the job torchrun launched): its exit
    code and what it wrote."""
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    out = CliRunner().invoke(app, CLI_ARGS)
    return {"exit_code": out.exit_code, "stdout": out.stdout, "stderr": out.stderr}


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from tilefit.tuning import TuneSearch, tune

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = fresh(wrap=True)
    before = state_of(model, opt)
    reported: list[int] = []
    result = tune(model, make_batch, loss_fn=loss_fn, optimizer=opt, search=TuneSearch(
        margin=0, memory_limit_bytes=LIMITS_BYTES[rank], max_batch=MAX_BATCH, predict=False,
        global_batch=2 * MAX_BATCH, on_trial=lambda t: reported.append(t.batch_size)))
    restored = same(before, state_of(model, opt))
    dist.barrier()
    own = largest_fitting(LIMITS_BYTES[rank])
    cli = run_cli()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "result": result.to_dict(), "restored": restored, "reported": len(reported),
        "own_max": own, "cli": cli}))
    dist.destroy_process_group()


def launch(script: str, out_dir: Path, name: str) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node 2 script out_dir``; each rank's ``{name}{rank}.json``."""
    if not torch.distributed.is_available():
        pytest.skip("no torch.distributed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        (str(ROOT / "src"), str(ROOT), str(ROOT / "tests")))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           script, str(out_dir)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [json.loads((out_dir / f"{name}{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One torchrun launch for both tests (a launch costs three torch imports)."""
    return launch(__file__, tmp_path_factory.mktemp("torchrun"), "rank")


def test_ranks_agree_on_the_smaller_devices_batch_and_restore_everything(
        ranks_out: list[dict[str, Any]]) -> None:
    r0, r1 = ranks_out
    assert 0 < r1["own_max"] < r0["own_max"] < MAX_BATCH  # rank 1 alone stops sooner
    for r in (r0, r1):
        res = r["result"]
        assert res["max_fitting_batch_size"] == r1["own_max"]  # the smaller device's
        assert res["world_size"] == 2
        assert res["global_batch"] == 2 * MAX_BATCH
        assert res["global_batch_size"] == res["batch_size"] * 2 * res["accumulation_steps"]
        assert res["global_batch_size"] == 2 * MAX_BATCH
        assert r["restored"]
    same_keys = ("batch_size", "max_fitting_batch_size", "accumulation_steps",
                 "samples_per_s", "candidates")
    assert {k: r0["result"][k] for k in same_keys} == {k: r1["result"][k] for k in same_keys}
    assert [(t["kind"], t["batch_size"], t["fits"]) for t in r0["result"]["trials"]] == \
        [(t["kind"], t["batch_size"], t["fits"]) for t in r1["result"]["trials"]]
    assert r0["reported"] == len(r0["result"]["trials"]) > 0  # rank 0 reports each trial
    assert r1["reported"] == 0  # rank 1 reports nothing


def test_the_cli_under_torchrun_prints_on_rank_0_only(ranks_out: list[dict[str, Any]]) -> None:
    r0, r1 = (r["cli"] for r in ranks_out)
    assert r0["exit_code"] == r1["exit_code"] == 0, r0["stderr"] + r1["stderr"]
    assert r1["stdout"] == r1["stderr"] == ""  # rank 1 prints nothing at all
    data = json.loads(r0["stdout"])
    assert "tune [" in r0["stderr"]  # rank 0's progress lines
    assert data["world_size"] == 2 and data["global_batch"] == 32
    # 16 samples on each rank per step: the micro-batch times the accumulation
    assert data["batch_size"] * data["accumulation_steps"] == 16
    assert data["global_batch_size"] == 32


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.slow
def test_the_hf_trainer_under_torchrun_agrees_and_trains(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r0, r1 = launch(str(ROOT / "tests" / "torchrun_hf_worker.py"), tmp_path, "hf")
    for r in (r0, r1):
        res = r["result"]
        assert r["world_size"] == res["world_size"] == 2
        # the Trainer's effective batch per device stays as its arguments said (120)
        assert r["args"][0] * r["args"][1] == 120 and r["args"][0] == res["batch_size"]
        assert res["global_batch_size"] == res["global_batch"] == 2 * 120
        assert r["steps"] == 2  # train() ran its DDP steps with the tuned arguments
    assert r0["result"]["trials"] == [
        {**t, "peak_memory_bytes": r0["result"]["trials"][i]["peak_memory_bytes"],
         "time_s": r0["result"]["trials"][i]["time_s"]}
        for i, t in enumerate(r1["result"]["trials"])]  # the same trials, the same outcomes
    assert r0["result"]["max_fitting_batch_size"] == r1["result"]["max_fitting_batch_size"]
