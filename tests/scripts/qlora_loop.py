"""QLoRA as its users write it: a 4-bit base from from_pretrained with a BitsAndBytesConfig
(nf4, double quantization, bf16 compute), prepared for k-bit training, LoRA on the attention
projections, AdamW, bf16 autocast. ``python qlora_loop.py MODEL`` (a name or a folder).
``python qlora_loop.py MODEL bnb-defaults``: BitsAndBytesConfig's own defaults instead (fp4,
no double quantization, fp32 compute), the base loaded in fp32, no
prepare_model_for_kbit_training."""
import sys

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

defaults = sys.argv[2:] == ["bnb-defaults"]
if defaults:
    bnb = BitsAndBytesConfig(load_in_4bit=True)
else:
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(
    sys.argv[1], quantization_config=bnb, device_map={"": 0},
    dtype=torch.float32 if defaults else torch.bfloat16)
if not defaults:
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                         task_type="CAUSAL_LM"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
model.train()
for _ in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
