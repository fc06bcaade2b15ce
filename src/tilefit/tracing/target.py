"""What the target device would do, as far as a trace is concerned."""

from __future__ import annotations

from dataclasses import dataclass

from tilefit.errors import TilefitError
from tilefit.gemm import round_up
from tilefit.hardware import get_device
from tilefit.hardware.device import Device
from tilefit.vocab import Precision, check_precision_supported, gpus_supporting

# The CUDA caching allocator rounds every block up to a multiple of 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize = 512, round_size()), and
# torch.cuda.max_memory_allocated counts the rounded sizes.
CUDA_ROUND_BYTES = 512


@dataclass(frozen=True)
class Target:
    kind: str  # "cuda" or "cpu"
    compute_capability: tuple[int, int] | None
    alloc_round_bytes: int  # allocator rounding; 1 = plain bytes
    foreach: bool  # torch.optim's default implementation on this device
    sms: int = 0  # the GPU's SMs (bitsandbytes' choice of 4-bit GEMM kernel reads them)

    @classmethod
    def from_device(cls, device: Device) -> Target:
        if device.kind == "cpu":
            # torch.optim uses the foreach path only on CUDA/XPU by default
            # (torch/optim/optimizer.py: _default_to_fused_or_foreach and
            # _get_foreach_kernels_supported_devices), the for-loop path on the CPU.
            return cls("cpu", None, 1, foreach=False)
        return cls("cuda", device.compute_capability, CUDA_ROUND_BYTES, foreach=True,
                   sms=device.sms)

    def round(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        return round_up(nbytes, self.alloc_round_bytes)

    @property
    def sm(self) -> int:
        cc = self.compute_capability or (0, 0)
        return cc[0] * 10 + cc[1]


def resolve_target(device: str | Device) -> tuple[Target, Device | None]:
    """The target semantics for ``device``; "cpu" needs no Device to trace."""
    if isinstance(device, str) and device.strip().lower() == "cpu":
        return Target("cpu", None, 1, foreach=False), None
    dev = get_device(device)
    return Target.from_device(dev), dev


def check_device_options(spec: Precision, device: Device | None) -> None:
    """The precision against the target (the recipe checked the rest when it was made)."""
    if device is not None:
        check_precision_supported(spec, device)
    elif spec.requires == "fp8":
        raise TilefitError(
            f"precision {spec.name} runs fp8 GEMMs on a GPU's Tensor Cores, not on the CPU",
            expected="a GPU with fp8 Tensor Cores: " + ", ".join(gpus_supporting("fp8")),
            given="estimate(..., gpu='cpu')",
            fix="pass estimate(..., gpu='h100') (or another GPU above)")
