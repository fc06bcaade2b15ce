"""Data types as the GEMM rules see them: a name, a size in bytes, and whether the math runs
on Tensor Cores. No torch import here (the gemm / linear / gpus commands must start fast)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilefit.errors import TilefitError


@dataclass(frozen=True)
class DType:
    name: str  # canonical key, also the key of Device.peak_flops_per_s
    bytes: int  # element size
    tensor_core: bool  # runs on Tensor Cores (fp32 runs on the CUDA cores)
    torch_name: str  # the torch dtype that holds it (torch.<torch_name>)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bytes not in (1, 2, 4, 8):
            raise ValueError(f"element size must be 1, 2, 4 or 8 bytes, got {self.bytes}")


# tf32 stores fp32 (4 bytes) and multiplies on Tensor Cores; NVIDIA's alignment table lists it
# with fp32 inputs ("Matrix Multiplication Background" user's guide, Table 1).
FP32 = DType("fp32", 4, tensor_core=False, torch_name="float32",
             aliases=("float32", "float", "single"))
TF32 = DType("tf32", 4, tensor_core=True, torch_name="float32", aliases=("tensorfloat32",))
FP16 = DType("fp16", 2, tensor_core=True, torch_name="float16", aliases=("float16", "half"))
BF16 = DType("bf16", 2, tensor_core=True, torch_name="bfloat16", aliases=("bfloat16",))
FP8 = DType("fp8", 1, tensor_core=True, torch_name="float8_e4m3fn",
            aliases=("float8", "e4m3", "e5m2", "float8_e4m3fn"))
INT8 = DType("int8", 1, tensor_core=True, torch_name="int8", aliases=("i8",))

DTYPES: tuple[DType, ...] = (FP32, TF32, FP16, BF16, FP8, INT8)
DTYPE_NAMES: tuple[str, ...] = tuple(d.name for d in DTYPES)


def torch_dtype(name: str | DType) -> Any:
    """The torch dtype that holds a tilefit dtype (imports torch: call it only where torch is
    already in use)."""
    import torch

    return getattr(torch, parse_dtype(name).torch_name)


def parse_dtype(text: str | DType) -> DType:
    """A DType from its name or an alias (case-insensitive)."""
    if isinstance(text, DType):
        return text
    key = str(text).strip().lower().removeprefix("torch.")
    for d in DTYPES:
        if key == d.name or key in d.aliases:
            return d
    raise TilefitError(
        f"unknown dtype {text!r}",
        expected="one of " + ", ".join(DTYPE_NAMES),
        given=repr(text),
        fix="pass one of the names above (fp16 and bf16 are the usual training types)",
    )
