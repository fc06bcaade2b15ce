"""A Hugging Face Trainer training GPT-2 on random tokens: per-device batch 8, sequence 1024,
bf16=True, the Trainer's defaults otherwise (issue 42, item 7's script). On a GPU it trains;
under `tilefit run` it is predicted on the simulated GPU."""
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 50257, (1024,))
        return {"input_ids": ids, "labels": ids}


model = GPT2LMHeadModel(GPT2Config())
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, bf16=True,
                         max_steps=10, report_to=[], logging_steps=1000, save_strategy="no")
Trainer(model=model, args=args, train_dataset=Tokens()).train()
