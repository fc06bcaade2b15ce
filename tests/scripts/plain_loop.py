"""A plain PyTorch loop as people write it: pick the GPU if there is one, bf16 autocast."""
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--accumulation", type=int, default=1)
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randn(256, 128)
labels = torch.randint(0, 10, (256,))
for _epoch in range(args.epochs):
    for i in range(0, 256, args.batch):
        x, y = data[i:i + args.batch].to(device), labels[i:i + args.batch].to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        if args.accumulation > 1:
            loss = loss / args.accumulation
        loss.backward()
        if (i // args.batch + 1) % args.accumulation == 0:
            opt.step()
            opt.zero_grad()
