"""What an architecture fixes for every GPU of it, as formulas over a catalog entry's facts:
the dense peaks of an RTX part from its SM count and boost clock, and the share of the fp32
peak GEMMs on the CUDA cores reach (docs/references.md, sections 5 and 28). The GPUs' own
facts are data (hardware/catalog.toml)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# simt_gemm_factor: fp32 GEMMs on the CUDA cores (TF32 off) against the Tensor Core
# efficiency, per architecture, fitted on the public sweeps' fp32 rows
# (docs/references.md, section 28): Volta 1.076 (a V100 SGEMM reaches 93% of its fp32 peak),
# Hopper 0.964, Ada 0.809 (Ada's fp32 peak counts the lanes it shares with INT32, which a
# GEMM's address arithmetic needs). Ampere, Turing and Blackwell: no sweep, 1.0.
SIMT_GEMM_FACTOR: Mapping[str, float] = MappingProxyType(
    {"Volta": 1.076, "Hopper": 0.964, "Ada": 0.809})


def simt_gemm_factor(architecture: str) -> float:
    """The catalog's simt_gemm_factor for a GPU of ``architecture``."""
    return SIMT_GEMM_FACTOR.get(architecture, 1.0)


# Dense FLOPs per SM per clock of the Turing, GA10x, Ada and GB20x SMs (Turing, Ampere GA102,
# Ada and RTX Blackwell whitepapers; docs/references.md, section 5): fp32 on the CUDA cores
# (Turing 64 FMA lanes, the later ones 128), fp16 on the four Tensor Cores with fp16
# accumulation (Turing 8 x 64 FMA, the later ones 4 x 128). GeForce parts run fp16/bf16
# with fp32 accumulation, which PyTorch uses, at half that rate; the catalog lists the half.
FP32_PER_SM_CLOCK: Mapping[str, int] = MappingProxyType(
    {"Turing": 128, "Ampere": 256, "Ada": 256, "Blackwell": 256})
TENSOR_FP16_PER_SM_CLOCK = 1024


def rtx_peaks(arch: str, sms: int, boost_mhz: float, *, geforce: bool) -> dict[str, float]:
    """Dense TFLOP/s of an RTX part from its SM count and boost clock (the vendor's product
    page), to 0.1 TFLOP/s as datasheets round them.

    tf32 is half the fp16 rate and int8 twice the fp16-accumulate rate on every such part; fp8
    (Ada, Blackwell) twice the fp16 rate, except GeForce Blackwell, whose fp8 runs at twice
    the fp16-accumulate rate (measured; docs/references.md, section 5). Turing has no bf16,
    tf32 or fp8.
    """
    ghz = boost_mhz / 1000
    fp16_acc16 = sms * TENSOR_FP16_PER_SM_CLOCK * ghz / 1000
    fp16 = fp16_acc16 / 2 if geforce else fp16_acc16
    peaks = {"fp32": sms * FP32_PER_SM_CLOCK[arch] * ghz / 1000, "fp16": fp16,
             "int8": 2 * fp16_acc16}
    if arch != "Turing":
        peaks |= {"bf16": fp16, "tf32": fp16 / 2}
    if arch in ("Ada", "Blackwell"):
        peaks["fp8"] = 2 * (fp16_acc16 if geforce and arch == "Blackwell" else fp16)
    return {k: round(v, 1) for k, v in peaks.items()}


def rtx_source(sms: int, boost_mhz: float) -> str:
    """What a source gains when the peaks are rtx_peaks': how they were derived."""
    return f"; {sms} SMs at {boost_mhz:g} MHz boost x the per-SM rate"
