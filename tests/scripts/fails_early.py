"""A script whose own code raises before it trains."""
import torch

model = torch.nn.Linear(4, 4).cuda()
raise ValueError("the data folder is missing")
