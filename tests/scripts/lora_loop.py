"""peft's LoRA on a from_pretrained GPT-2 in bf16 weights (its adapters in fp32), a plain loop."""
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("gpt2", dtype=torch.bfloat16)
config = LoraConfig(r=16, target_modules=["c_attn"], task_type="CAUSAL_LM")
model = get_peft_model(model, config).cuda()
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for _ in range(4):
    ids = torch.randint(0, 50257, (2, 128), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
