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


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from tilefit.tuning import tune

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = fresh(wrap=True)
    before = state_of(model, opt)
    reported: list[int] = []
    result = tune(model, make_batch, loss_fn=loss_fn, optimizer=opt, margin=0,
                  memory_limit_bytes=LIMITS_BYTES[rank], max_batch=MAX_BATCH, predict=False,
                  global_batch=2 * MAX_BATCH, on_trial=lambda t: reported.append(t.batch_size))
    restored = same(before, state_of(model, opt))
    dist.barrier()
    own = largest_fitting(LIMITS_BYTES[rank])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "result": result.to_dict(), "restored": restored, "reported": len(reported),
        "own_max": own}))
    dist.destroy_process_group()


def run_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           __file__, str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_ranks_agree_on_the_smaller_devices_batch_and_restore_everything(
        tmp_path: Path) -> None:
    r0, r1 = run_ranks(tmp_path)
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


if __name__ == "__main__":
    worker(sys.argv[1])
