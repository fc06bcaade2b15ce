"""One rank of tests/test_tune_torchrun.py's Hugging Face case, launched by torchrun: the
Trainer joins the job itself (TrainingArguments on the CPU picks gloo); tune_trainer runs on
every rank with a smaller simulated device on rank 1, then train() runs DDP steps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from test_integration_hf import TokenData, gpt2, make_trainer
from tilefit.tuning.integrations.hf import tune_trainer

LIMITS_BYTES = (20_000_000, 15_000_000)  # rank 0, rank 1


def main(out_dir: str) -> None:
    trainer = make_trainer(gpt2(), TokenData(), Path(out_dir, "hf"))
    rank = dist.get_rank()  # the Trainer's arguments have joined the job
    result = tune_trainer(trainer, memory_limit_bytes=LIMITS_BYTES[rank], max_batch=32,
                          predicted_max_batch=8, measure_throughput=False)
    trainer.train()
    Path(out_dir, f"hf{rank}.json").write_text(json.dumps({
        "result": result.to_dict(), "world_size": trainer.args.world_size,
        "args": [trainer.args.per_device_train_batch_size,
                 trainer.args.gradient_accumulation_steps],
        "steps": trainer.state.global_step}))


if __name__ == "__main__":
    main(sys.argv[1])
    # leave without the interpreter's teardown: destroying the process group the Trainer
    # made (gloo) can abort a rank ("terminate called without an active exception", exit
    # code -6, once in a CI run) or hang it, after everything above has run and been written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
