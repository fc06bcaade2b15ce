"""How long tilefit.models takes to build catalog models inside FakeTensorMode, and its RSS.

Each figure comes from a fresh Python process (so "cold" includes the lazy import of the
model's transformers module, as a `tilefit estimate` run pays it):

  import_s         import torch + transformers + tilefit.models
  build_cold_s     first Workload.build() under FakeTensorMode
  build_warm_s     median of 5 further builds
  build_init_s     median of 5 builds WITH weight init run on fake tensors (what tilefit skips)
  meta_build_s     median of 5 builds under torch.device("meta") (parameter counting)
  fwd_bwd_s        make_batch + loss_fn + backward under plain FakeTensorMode (no tracer)
  rss_mib          peak resident set size of the process at the end

Run:  PYTHONPATH=src python benchmarks/bench_model_build.py [model ...] [--seq-len N]
Defaults: gpt2 and llama-3-8b at their default seq_len (1024, 2048), batch 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import contextlib, json, os, resource, statistics, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
t0 = time.perf_counter()
import torch
import transformers  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode
from tilefit.models import hf, load_workload
import_s = time.perf_counter() - t0
name = sys.argv[1]
w = load_workload(name, seq_len=int(sys.argv[2]) if sys.argv[2] != "-" else None)
seq_len = w.seq_len

def timed(fn, n=1):
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)

def fake_build():
    with FakeTensorMode():
        w.build()

build_cold_s = timed(fake_build)
build_warm_s = timed(fake_build, 5)
skip = hf._skip_init_without_data
hf._skip_init_without_data = contextlib.nullcontext
try:
    build_init_s = timed(fake_build, 5)
except Exception as exc:  # e.g. ViT's trunc_normal_ cannot run on fake tensors
    build_init_s = f"fails: {type(exc).__name__}"
hf._skip_init_without_data = skip

def meta_build():
    with torch.device("meta"):
        w.build()

meta_build_s = timed(meta_build, 5)

def step():
    with FakeTensorMode():
        model = w.build()
        w.loss_fn(model, w.make_batch(1)).backward()

fwd_bwd_s = timed(step)
print(json.dumps(dict(model=name, seq_len=seq_len, import_s=import_s, build_cold_s=build_cold_s,
    build_warm_s=build_warm_s, build_init_s=build_init_s, meta_build_s=meta_build_s,
    fwd_bwd_s=fwd_bwd_s,
    rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gpt2", "llama-3-8b"])
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args()
    print(f"{'model':<22}{'seq':>6}{'import s':>10}{'build cold':>12}{'build warm':>12}"
          f"{'with init':>11}{'meta':>8}{'fwd+bwd':>9}{'RSS MiB':>9}")
    for name in args.models:
        seq = "-" if args.seq_len is None else str(args.seq_len)  # "-": the model's default
        out = subprocess.run([sys.executable, "-c", CHILD, name, seq], capture_output=True,
                             text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        init = r["build_init_s"]
        init_text = f"{init:>11.3f}" if isinstance(init, float) else f"{'fails':>11}"
        seq_text = r["seq_len"] or "-"
        print(f"{r['model']:<22}{seq_text:>6}{r['import_s']:>10.2f}{r['build_cold_s']:>12.3f}"
              f"{r['build_warm_s']:>12.3f}{init_text}{r['meta_build_s']:>8.3f}"
              f"{r['fwd_bwd_s']:>9.2f}{r['rss_mib']:>9.0f}")


if __name__ == "__main__":
    main()
