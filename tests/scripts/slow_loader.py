"""A loop whose data loading takes at least 50 ms a batch on the host (time.sleep stands in
for reading and decoding): tests/test_simulate.py reads the time between its steps."""
import time

import torch

model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters())
for _ in range(4):
    time.sleep(0.05)
    x = torch.randn(8, 64).cuda()
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
