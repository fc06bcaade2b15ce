"""The Hugging Face Trainer on a small GPT-2, its defaults but bf16=True (per-device batch 4,
sequence 64): tests/test_simulate.py runs it under the simulated GPU."""
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 128}


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 256, (64,))
        return {"input_ids": ids, "labels": ids}


if __name__ == "__main__":
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                             bf16=True, max_steps=10, report_to=[], save_strategy="no",
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens()).train()
