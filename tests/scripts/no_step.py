"""A script that evaluates and never calls optimizer.step()."""
import torch

model = torch.nn.Linear(4, 4).cuda()
with torch.no_grad():
    model(torch.randn(2, 4, device="cuda"))
