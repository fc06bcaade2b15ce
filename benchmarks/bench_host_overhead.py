"""The host side of eager PyTorch on this machine: seconds per issued op, by issuer.

Times real CPU steps of miniature GPT-2, Llama and BERT models (kernels well under a
microsecond, so the step is the host's issue time) and fits tilefit's HostModel
(tilefit.calibrate.host); prints each model's measured and fitted phase times. Run it three
times and compare: the spread is the machine's noise.

Run: PYTHONPATH=src python benchmarks/bench_host_overhead.py [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from tilefit.calibrate.host import measure_host

    torch.set_num_threads(args.threads)
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s), load average "
          f"{os.getloadavg()[0]:.2f}")
    fits = []
    for r in range(args.rounds):
        fit = measure_host()
        fits.append(fit.host)
        h = fit.host
        print(f"round {r + 1}: forward {h.forward_op_s * 1e6:.2f} us/op, backward "
              f"{h.backward_op_s * 1e6:.2f} us/op, optimizer {h.optimizer_op_s * 1e6:.2f} "
              f"us/op + {h.optimizer_tensor_s * 1e6:.2f} us/tensor")
        for s in fit.samples:
            pred = fit.predicted_s(s)
            row = ", ".join(f"{p} {s.time_s[p] * 1e3:.3f} ms (fit {pred[p] * 1e3:.3f}, "
                            f"{s.ops[p]} ops)" for p in s.time_s)
            print(f"  {s.model:18s} {row}; {s.param_tensors} tensors")
    for name in ("forward_op_s", "backward_op_s", "optimizer_op_s", "optimizer_tensor_s"):
        vals = [getattr(f, name) * 1e6 for f in fits]
        print(f"{name:20s} median {statistics.median(vals):.2f} us, spread "
              f"{min(vals):.2f}-{max(vals):.2f} us over {len(vals)} rounds")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
