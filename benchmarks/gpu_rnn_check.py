"""What cuDNN's fused RNN does on the live GPU, for the trace to follow (issue 46, item 3;
needs CUDA).

On a CUDA target tilefit should trace nn.LSTM / nn.GRU / nn.RNN as cuDNN's fused RNN
(aten._cudnn_rnn) runs them. Two facts it needs are not published:
- the reserve space cuDNN keeps from the forward for the backward: PyTorch's own meta kernel
  returns an empty one ("TODO: Query cudnnGetRNNTrainingReserveSize"), and NVIDIA documents
  the query, not a formula;
- the dtype autocast runs it in: ATen's cuDNN RNN autocast kernel (AutocastRNN.cpp, as read
  for torch 2.1-2.3) casts input, states and the flattened weights to fp16 whatever the
  autocast dtype, bf16 included.
This measures both for a grid of shapes: the reserve tensor's bytes as _cudnn_rnn returns
them, and the output dtype of nn.LSTM under bf16 and fp16 autocast, with the step's peak
memory and time, so that the reserve can be fitted by mode, hidden size, batch, sequence,
layers and direction.

    python benchmarks/gpu_rnn_check.py [--json out.json]

Without CUDA it says so and exits 0; ``grid()`` and ``summary()`` are CPU-only and tested.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# (mode, hidden, batch, seq, layers, bidirectional): the reserve's terms, one at a time
BASE = ("LSTM", 256, 16, 64, 1, False)


def grid() -> list[tuple[str, int, int, int, int, bool]]:
    """The shapes measured: the base, then each term varied alone (mode, hidden, batch,
    sequence, layers, direction), so that a fit can separate them."""
    mode, hidden, batch, seq, layers, bidir = BASE
    out = [BASE]
    out += [(m, hidden, batch, seq, layers, bidir) for m in ("GRU", "RNN_TANH")]
    out += [(mode, h, batch, seq, layers, bidir) for h in (128, 512, 1024)]
    out += [(mode, hidden, b, seq, layers, bidir) for b in (1, 64)]
    out += [(mode, hidden, batch, s, layers, bidir) for s in (16, 256)]
    out += [(mode, hidden, batch, seq, n, bidir) for n in (2, 4)]
    out.append((mode, hidden, batch, seq, layers, True))
    return out


def _module(mode: str, hidden: int, layers: int, bidir: bool) -> Any:
    from torch import nn

    cls = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN}[mode]
    return cls(hidden, hidden, num_layers=layers, bidirectional=bidir, batch_first=True)


def measure(shape: tuple[str, int, int, int, int, bool], dtype: str) -> dict[str, Any]:
    """One shape on the GPU: the reserve bytes _cudnn_rnn returns (training), nn's output
    dtype under autocast ``dtype`` ("fp32": none), the step's peak memory and time."""
    import torch

    mode, hidden, batch, seq, layers, bidir = shape
    rnn = _module(mode, hidden, layers, bidir).cuda()
    x = torch.randn(batch, seq, hidden, device="cuda", requires_grad=True)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.autocast("cuda", dtype=low or torch.float16, enabled=low is not None):
        out = rnn(x)[0]
    out.float().sum().backward()
    end.record()
    torch.cuda.synchronize()
    return {"mode": mode, "hidden": hidden, "batch": batch, "seq": seq, "layers": layers,
            "bidirectional": bidir, "autocast": dtype, "output_dtype": str(out.dtype),
            "reserve_bytes": _reserve_bytes(rnn, x, mode, hidden, layers, bidir),
            "peak_bytes_over_start": torch.cuda.max_memory_allocated() - before,
            "step_ms": start.elapsed_time(end)}


def _reserve_bytes(rnn: Any, x: Any, mode: str, hidden: int, layers: int, bidir: bool) -> int:
    """The reserve space cuDNN returns for a training forward of ``rnn`` on ``x`` (fp32)."""
    import torch

    codes = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}
    weights = rnn._flat_weights
    directions = 2 if bidir else 1
    hx = torch.zeros(layers * directions, x.shape[0], hidden, device="cuda")
    cx = hx.clone() if mode == "LSTM" else None
    out = torch._cudnn_rnn(x, weights, 4, None, hx, cx, codes[mode], hidden, 0, layers,
                           True, 0.0, True, bidir, [], None)
    return int(out[3].numel() * out[3].element_size())


def run() -> list[dict[str, Any]]:
    rows = []
    for shape in grid():
        for dtype in ("fp32", "bf16", "fp16"):
            try:
                rows.append(measure(shape, dtype))
            except Exception as exc:  # report, don't lose the rest
                rows.append({"shape": list(shape), "autocast": dtype,
                             "error": f"{type(exc).__name__}: {exc}"})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the rows say: the output dtype under each autocast dtype, and the reserve per
    element of the base shape's states (reserve / (layers x directions x seq x batch x
    hidden)), for the fit to start from."""
    ok = [r for r in rows if "error" not in r]
    dtypes = {r["autocast"]: r["output_dtype"] for r in ok if r["mode"] == BASE[0]}
    per_state = [r["reserve_bytes"] / (r["layers"] * (2 if r["bidirectional"] else 1)
                                       * r["seq"] * r["batch"] * r["hidden"])
                 for r in ok if r["autocast"] == "fp32"]
    return {"status": "measured" if ok else "error", "rows": rows,
            "output_dtype_by_autocast": dtypes,
            "reserve_bytes_per_state_element": per_state,
            "errors": len(rows) - len(ok)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows and summary here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_rnn_check: no CUDA device here; nothing measured")
        return 0
    result = summary(run())
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
