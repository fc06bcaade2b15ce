"""FSDP2 as torchrun runs it: init_process_group("nccl"), a device mesh, fully_shard on each
block then the root with a bf16 MixedPrecisionPolicy, AdamW."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
            for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


if __name__ == "__main__":
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
    model = Net().cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 256, device="cuda")
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
