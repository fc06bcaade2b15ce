"""DistributedDataParallel as torchrun runs it: init_process_group("nccl"), LOCAL_RANK, bf16."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
net = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
model = DDP(net.cuda(), device_ids=[local])
opt = torch.optim.AdamW(model.parameters())
for _ in range(5):
    x = torch.randn(32, 1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
