"""accelerate's loop: Accelerator(mixed_precision="bf16") prepares the model, optimizer and data."""
import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(mixed_precision="bf16")
model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = DataLoader(TensorDataset(torch.randn(256, 128), torch.randint(0, 10, (256,))),
                  batch_size=32)
model, opt, data = accelerator.prepare(model, opt, data)
for x, y in data:
    loss = nn.functional.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
