"""A GAN: two models, two optimizers, fp16 autocast with one GradScaler, a loss read each step."""
import torch
from torch import nn

dev = torch.device("cuda")
gen = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32)).to(dev)
disc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4)
scaler = torch.amp.GradScaler("cuda")
bce = nn.BCEWithLogitsLoss()
for step in range(100):
    real = torch.randn(64, 32, device=dev)
    noise = torch.randn(64, 16, device=dev)
    with torch.autocast("cuda", dtype=torch.float16):
        fake = gen(noise)
        d_loss = bce(disc(real), torch.ones(64, 1, device=dev)) + \
            bce(disc(fake.detach()), torch.zeros(64, 1, device=dev))
    opt_d.zero_grad()
    scaler.scale(d_loss).backward()
    scaler.step(opt_d)
    with torch.autocast("cuda", dtype=torch.float16):
        g_loss = bce(disc(fake), torch.ones(64, 1, device=dev))
    opt_g.zero_grad()
    scaler.scale(g_loss).backward()
    scaler.step(opt_g)
    scaler.update()
    if step % 10 == 0:
        print(f"step {step}: d {d_loss.item():.3f} g {g_loss.item():.3f}")
