"""QLoRA in the Hugging Face Trainer, as its users write it: Llama 3.2 1B from from_pretrained
with a BitsAndBytesConfig (nf4, double quantization, bf16 compute), prepare_model_for_kbit_training,
LoRA r=16 on q_proj and v_proj, per-device batch 4, sequence 512, bf16=True, the Trainer's
defaults otherwise. On a GPU it trains (with the weights from the Hub: pass
meta-llama/Llama-3.2-1B); under `tilefit run` it is predicted on the simulated GPU from the
config alone."""
import sys
import tempfile

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

NAME = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128256, (512,))
        return {"input_ids": ids, "labels": ids}


bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                         bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(NAME, quantization_config=bnb, device_map={"": 0})
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                         task_type="CAUSAL_LM"))
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, bf16=True,
                         max_steps=10, report_to=[], logging_steps=1000, save_strategy="no")
Trainer(model=model, args=args, train_dataset=Tokens()).train()
