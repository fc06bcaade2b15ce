"""How long `tilefit estimate` takes and how much memory it needs, on this machine.

Targets (issue 3): gpt2 --batch 8 --seq 1024 in under 3 s; llama-3-8b --batch 1 --seq 2048 in
under 10 s and under 1.5 GiB RSS. Printed: the whole CLI command (fresh process, imports
included, peak RSS of the child), and the estimate alone in a warm process (imports done),
next to a bare fake-tensor run of the same two steps (no tilefit recording) for reference.

    python benchmarks/bench_estimate_speed.py
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CASES = (("gpt2", 8, 1024, 3.0), ("llama-3-8b", 1, 2048, 10.0))


def cli_run(model: str, batch: int, seq: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tilefit", "estimate", model, "--batch", str(batch),
                    "--seq", str(seq), "--gpu", "a100-80gb", "--json"], check=True,
                   capture_output=True)
    wall = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 2**30
    return wall, rss_gib


def bare_fake_steps(model: str, batch: int, seq: int) -> float:
    """Two plain training steps on fake tensors: what any fake-tensor tracer must pay."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tilefit.models import load_workload

    w = load_workload(model, seq_len=seq)
    t0 = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = w.build("sdpa")
        b = w.make_batch(batch)
        opt = torch.optim.AdamW(m.parameters(), foreach=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pass
        for _ in range(2):
            loss = w.loss_fn(m, b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def warm_estimate(model: str, batch: int, seq: int) -> float:
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    w = load_workload(model, seq_len=seq)
    estimate_workload(w, Recipe(batch), "a100-80gb")  # warm the imports and caches
    t0 = time.perf_counter()
    estimate_workload(w, Recipe(batch), "a100-80gb")
    return time.perf_counter() - t0


def main() -> None:
    print(f"{'command':42} {'CLI wall s':>10} {'child RSS GiB':>13} {'warm s':>7} "
          f"{'bare fake s':>11} {'target s':>8}")
    for model, batch, seq, target in CASES:
        wall, rss = cli_run(model, batch, seq)
        warm = warm_estimate(model, batch, seq)
        bare = bare_fake_steps(model, batch, seq)
        label = f"estimate {model} --batch {batch} --seq {seq}"
        print(f"{label:42} {wall:10.2f} {rss:13.2f} {warm:7.2f} {bare:11.2f} {target:8.1f}")
    print("RSS is the maximum over the child processes so far (ru_maxrss).")


if __name__ == "__main__":
    main()
