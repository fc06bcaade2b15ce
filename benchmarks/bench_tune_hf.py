"""Benchmark of `tune_trainer` with the real transformers.Trainer: does the tuned batch train?

Three tiny models built from configs (GPT-2 loaded in eval mode as from_pretrained leaves it,
Llama with gradient_checkpointing=True and a custom compute_loss, BERT sequence classification
in bf16 autocast) x three simulated device sizes (memory_limit_bytes). For each case:
tune_trainer picks the micro-batch (the effective batch stays 240), then the same Trainer runs
trainer.train() for N steps at that batch under the same simulated device. Reported: the largest
fitting batch, the chosen one, fit trials, tuning time, the training run's peak against the
cap, whether it ran out of memory (target: never), whether that peak stayed within the budget
tune's trials were held to (the cap less the margin: tune modelled the Trainer's step, margin
unused), and whether the user's model, modes, checkpointing and arguments (besides the two
documented ones) came back unchanged.

    PYTHONPATH=src python benchmarks/bench_tune_hf.py [--steps 3] [--throughput] [--threads 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset

from tilefit.tuning.integrations.hf import train_with_memory_limit, tune_trainer
from tilefit.tuning.simulate import OOM_ERROR

EFFECTIVE = 240  # per_device x accumulation; many divisors, so the choice sits near the max
VOCAB = 256
SEQ_TOKENS = 32
CAPS_BYTES = (10_000_000, 20_000_000, 40_000_000)


class Tokens(Dataset):
    """Causal-LM or classification samples of SEQ_TOKENS tokens, plus an unused text column."""

    def __init__(self, classify: bool = False, n: int = 256) -> None:
        self.classify, self.n = classify, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = (torch.arange(SEQ_TOKENS) * 7 + i) % VOCAB
        labels = torch.tensor(i % 3) if self.classify else ids.clone()
        return {"input_ids": ids, "labels": labels, "text": "unused"}


class LabelSmoothingTrainer(transformers.Trainer):
    """A subclass with its own loss (label-smoothed cross entropy on fp32 logits)."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), label_smoothing=0.1)
        return (loss, outputs) if return_outputs else loss


def gpt2_eval() -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()  # as from_pretrained returns it


def llama() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def bert() -> Any:
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=VOCAB, num_labels=3,
                                     max_position_embeddings=64)
    return transformers.BertForSequenceClassification(config)


@dataclass(frozen=True)
class Case:
    name: str
    setup: str  # what the case exercises, for the table
    build: Callable[[], Any]
    classify: bool = False
    trainer_cls: type = transformers.Trainer
    args: tuple[tuple[str, Any], ...] = ()


CASES = (
    Case("gpt2", "eval-mode model", gpt2_eval),
    Case("llama", "gradient_checkpointing + custom compute_loss", llama,
         trainer_cls=LabelSmoothingTrainer, args=(("gradient_checkpointing", True),)),
    Case("bert-cls", "bf16 autocast, classification", bert, classify=True,
         args=(("bf16", True),)),
)


def make_trainer(case: Case, out_dir: str, steps: int) -> Any:
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=out_dir, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_strategy="no", per_device_train_batch_size=EFFECTIVE,
        gradient_accumulation_steps=1, max_steps=steps, **dict(case.args))
    return case.trainer_cls(model=case.build(), args=args,
                            train_dataset=Tokens(classify=case.classify))


def user_state(trainer: Any) -> tuple[Any, ...]:
    """What tune_trainer must leave alone: weights, modes, checkpointing, the other args."""
    model = trainer.model
    args = trainer.args.to_dict()
    for k in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        args.pop(k)
    weights = tuple(p.detach().clone() for p in model.parameters())
    modes = tuple(m.training for m in model.modules())
    checkpointing = tuple(sorted((name, k) for name, m in model.named_modules() for k in vars(m)
                                 if "checkpointing" in k or "require_grads" in k))
    return weights, modes, checkpointing, sorted(args.items())


def same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    weights_same = all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    return weights_same and a[1:] == b[1:]


def train_peak(trainer: Any, limit_bytes: int) -> int | None:
    """trainer.train() on the simulated device: its peak bytes, None when it ran out."""
    try:
        return int(train_with_memory_limit(trainer, limit_bytes).metrics["tilefit_peak_bytes"])
    except OOM_ERROR:
        return None


def run_case(case: Case, cap_bytes: int, steps: int, throughput: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = make_trainer(case, out_dir, steps)
        before = user_state(trainer)
        t0 = time.perf_counter()
        result = tune_trainer(trainer, memory_limit_bytes=cap_bytes,
                              measure_throughput=throughput)
        tune_s = time.perf_counter() - t0
        restored = same_state(before, user_state(trainer))
        t1 = time.perf_counter()
        peak = train_peak(trainer, cap_bytes)
        train_s = time.perf_counter() - t1
        assert result.budget_bytes is not None
        in_budget = peak is not None and peak <= result.budget_bytes
    args = trainer.args
    return {"model": case.name, "cap_B": cap_bytes, "max_fit": result.max_fitting_batch_size,
            "predicted": result.predicted_max_batch, "chosen": result.batch_size,
            "accum": args.gradient_accumulation_steps,
            "effective_kept": args.per_device_train_batch_size * args.gradient_accumulation_steps
            == EFFECTIVE, "fit_trials": result.fit_trials, "tune_s": tune_s,
            "train_steps": trainer.state.global_step, "train_peak_B": peak,
            "peak_of_cap": None if peak is None else peak / cap_bytes, "oom": peak is None,
            "restored": restored, "train_s": train_s, "within_budget": in_budget}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(" | ".join(rows[0]))
    for r in rows:
        print(" | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps after tuning")
    parser.add_argument("--throughput", action="store_true",
                        help="let tune time the candidates (default: untimed, so the chosen "
                        "batch is the largest divisor that fits: the hardest OOM check)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: these steps are tiny, and on a shared machine "
                        "more threads mostly wait)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    load_1m, load_5m, load_15m = os.getloadavg()
    print(f"# machine load (1/5/15 min): {load_1m:.2f} {load_5m:.2f} {load_15m:.2f}; "
          f"cpus {os.cpu_count()}; torch threads {torch.get_num_threads()}; torch "
          f"{torch.__version__}, transformers {transformers.__version__}; effective batch "
          f"{EFFECTIVE}; {opts.steps} training steps per case; throughput "
          f"{'timed' if opts.throughput else 'untimed'}")
    for case in CASES:
        print(f"# {case.name}: {case.setup}")
    rows = []
    for case in CASES:
        for cap in CAPS_BYTES:
            rows.append(run_case(case, cap, opts.steps, opts.throughput))
            r = rows[-1]
            print(f"  {case.name} cap {cap}: chosen {r['chosen']} (max {r['max_fit']}), "
                  f"oom {r['oom']}", file=sys.stderr)
    print_table(rows)
    ooms = sum(r["oom"] for r in rows)
    ok = ooms == 0 and all(r["restored"] and r["effective_kept"] for r in rows)
    in_budget = sum(r["within_budget"] for r in rows)
    print(f"\ncases: {len(rows)}; OOM in training at the tuned batch: {ooms}; fit trials mean "
          f"{sum(r['fit_trials'] for r in rows) / len(rows):.1f} max "
          f"{max(r['fit_trials'] for r in rows)}; state restored: "
          f"{sum(r['restored'] for r in rows)}/{len(rows)}; training peak within the budget "
          f"(the cap less the margin, as tune's trials): {in_budget}/{len(rows)}")
    load_1m, _, _ = os.getloadavg()
    print(f"# machine load at the end (1 min): {load_1m:.2f}")
    print("ALL TARGETS MET" if ok else "SOME TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
