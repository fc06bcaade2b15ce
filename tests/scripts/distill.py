"""Distillation: a frozen teacher in eval mode under no_grad, a student trained on its logits."""
import torch
from torch import nn

dev = "cuda"
teacher = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dev).eval()
for p in teacher.parameters():
    p.requires_grad_(False)
student = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(dev)
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
for _ in range(10):
    x = torch.randn(32, 64, device=dev)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean")
    loss.backward()
    opt.step()
    opt.zero_grad()
