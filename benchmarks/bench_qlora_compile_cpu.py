"""QLoRA on this CPU, eager and under torch.compile: tilefit's prediction against real steps.

A Llama-like model saved with random weights is loaded in nf4 by transformers' own
``from_pretrained`` (``BitsAndBytesConfig``, double quantization, bf16 compute: bitsandbytes'
CPU backend quantizes it), prepared by ``peft.prepare_model_for_kbit_training`` and given
peft's LoRA (r=16, alpha=32, all linear layers); its loss computation runs eager or compiled
for real (``torch.compile(fullgraph=True)``: bitsandbytes >= 0.46 compiles Linear4bit in one
graph, docs/references.md, section 33), trained with torch's AdamW (for-loop) under bf16
autocast. Measured as benchmarks/bench_compile_cpu.py measures compiled steps: the live
bytes of the model, its QuantState tensors and the batch, plus the highest live bytes the
CPU allocator's events (the profiler's memory events) reach over two steps after the first
(compiling) one. Predicted: ``tilefit.trace`` of the same config with
``Recipe(quantize="nf4", lora=Lora(), compile=...)`` on the CPU, its unrounded peak.

    OMP_NUM_THREADS=1 python benchmarks/bench_qlora_compile_cpu.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_compile_cpu import _storage_bytes, allocator_peak_bytes
from tilefit.bench.qlora import quant_state_tensors, real_qlora_model

# (hidden, tokens per sample) at batch 2, 2 layers, vocab 128
SIZES = ((64, 128), (256, 128))
BATCH = 2


def config(hidden: int, seq: int) -> dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
            "max_position_embeddings": max(64, seq), "tie_word_embeddings": False}


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def measure(model: torch.nn.Module, seq: int, compiled: bool) -> tuple[int, float, int]:
    """(peak bytes, first step's seconds, graph breaks) of real steps."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ids = torch.arange(BATCH * seq).reshape(BATCH, seq) % 128
    batch = {"input_ids": ids, "labels": ids.clone()}

    def loss_of(b: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**b).loss

    run = torch.compile(loss_of, fullgraph=True) if compiled else loss_of
    params = [p for p in model.parameters() if p.requires_grad]
    holder = {"opt": make_optimizer(params)}

    def step() -> None:
        loss = run(batch)
        loss.backward()
        del loss
        holder["opt"].step()
        holder["opt"].zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()  # compiles; then fresh optimizer state, as the prediction's two steps start
    first_s = time.perf_counter() - t0
    breaks = sum(counters["graph_break"].values())
    holder["opt"] = make_optimizer(params)
    base = _storage_bytes(list(model.parameters()), list(model.buffers()), batch,
                          quant_state_tensors(model))
    return base + allocator_peak_bytes(step), first_s, breaks


def predict(cfg: dict[str, Any], seq: int, compiled: bool, where: Path) -> int:
    from tilefit import Recipe, trace
    from tilefit.models import load_workload
    from tilefit.recipe import Lora

    (where / "config.json").write_text(json.dumps(cfg))
    work = load_workload(str(where / "config.json"), seq_len=seq)
    tr = trace(work, recipe=Recipe(batch_size=BATCH, precision="bf16-mixed", lora=Lora(),
                                   quantize="nf4", optimizer=make_optimizer,
                                   compile=compiled), gpu="cpu")
    return tr.peak(rounded=False)[0]


def main() -> int:
    import bitsandbytes
    import peft
    import transformers

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft "
          f"{peft.__version__}, bitsandbytes {bitsandbytes.__version__}; "
          f"{torch.get_num_threads()} torch thread(s), load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"{'workload':36} {'mode':8} {'real B':>10} {'pred B':>10} {'error':>7} "
          f"{'breaks':>6} {'1st step s':>10}")
    errors: dict[str, list[float]] = {"eager": [], "compiled": []}
    for hidden, seq in SIZES:
        cfg = config(hidden, seq)
        name = f"llama-like h{hidden} x2 layers, {BATCH}x{seq}"
        for compiled in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                model = real_qlora_model(cfg, Path(tmp), torch.bfloat16)
                real, first_s, breaks = measure(model, seq, compiled)
                pred = predict(cfg, seq, compiled, Path(tmp))
            mode = "compiled" if compiled else "eager"
            errors[mode].append(pred / real - 1)
            print(f"{name:36} {mode:8} {real:10,} {pred:10,} {pred / real - 1:+7.2%} "
                  f"{breaks:6} {first_s:10.1f}")
    for mode, errs in errors.items():
        print(f"{mode}: worst |error| {max(abs(e) for e in errs):.2%}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
