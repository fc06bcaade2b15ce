"""Building a catalog entry: the cost-model terms every GPU shares, its link, and the dense
peaks of an RTX part derived from its SM count and boost clock (docs/references.md, section 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tilefit.hardware.device import ALIGN_DATACENTER_BYTES, GB, GIB, TB, Device

# gemm_efficiency: the per-SM main-loop rate of the best cuBLAS kernels on large, aligned
# shapes, as a fraction of the dense peak, before tile and wave quantization and the output
# tiles' stores (tilefit.gemm). Solved so that tilefit.gemm predicts the published "maximum
# achievable matmul FLOPs" (bf16, best of a large sweep; docs/references.md, sections 6 and
# 28) at the shape that reached it: A100 271.2 of 312 TFLOP/s at 1024 x 10240 x 5120 ->
# 0.916, the A100 PCIe its own figure, H100 794.5 of 989 at 2048 x 2048 x 13312 -> 0.870,
# B200 1745 of 2250 at 1792 x 16128 x 3072 -> 0.885 (benchmarks/derive_gemm_efficiency.py
# prints the derivation).
# NVIDIA's FC-layer guide quotes ~250 of 312 TFLOP/s on A100 for a 4096x1024 layer at large
# batch, which the model reproduces from 0.916. Parts with no published figure use the H100
# value until calibrated.
EFF_A100 = 0.916
EFF_A100_PCIE = 0.847  # its own figure: 252.9 of 312 at 2048 x 5120 x 6144 (300 W card)
EFF_HOPPER = 0.870
EFF_BLACKWELL = 0.885
EFF_DEFAULT = EFF_HOPPER
# GPUs with a published square-matmul sweep and no best-matmul figure (the corpus's source 1,
# zzc0721/torch-performance-test-data): the main-loop efficiency fitted on the sweep's fit
# sizes (1024, 4096, 10240; all dtypes) by benchmarks/bench_gpu_corpus.py and adopted because
# it lowers the held-out sizes' error (docs/references.md, section 28). What it holds is the
# card's sustained clock under its power limit as much as its kernels: the H100 PCIe (350 W)
# and the L4 (72 W) drop their clocks under a long GEMM; the RTX 4090 runs above its rated
# boost clock (its sweep passes the datasheet's fp16 and tf32 peaks), capped here at 1.0.
# The A10 (150 W) from its fp32 sweep (docs/references.md, section 29: 14.5 of 31.2 TFLOP/s
# at 6888^3), its Ampere CUDA-core factor being 1.0; the same source's fp16 and bf16 figures
# for the card (54, 56 of 125, size not stated) are within 9% of what it predicts.
EFF_H100_PCIE = 0.740
EFF_RTX_4090 = 1.0
EFF_L4 = 0.471
EFF_A10 = 0.500
# simt_gemm_factor: fp32 GEMMs on the CUDA cores (TF32 off) against the Tensor Core
# efficiency, per architecture, fitted the same way on the sweeps' fp32 rows
# (docs/references.md, section 28): Volta 1.076 (a V100 SGEMM reaches 93% of its fp32 peak),
# Hopper 0.964, Ada 0.809 (Ada's fp32 peak counts the lanes it shares with INT32, which a
# GEMM's address arithmetic needs). Ampere, Turing and Blackwell: no sweep, 1.0.
SIMT_GEMM_FACTOR: Mapping[str, float] = MappingProxyType(
    {"Volta": 1.076, "Hopper": 0.964, "Ada": 0.809})

# bandwidth_efficiency: a device-to-device copy on an H200 measured 4.3 of 4.8 TB/s (0.90,
# docs/references.md, section 6); used for every part until calibrated.
BW_EFF = 0.90

# launch_overhead_s: the floor of one CUDA kernel's time (launch latency and the
# prologue/epilogue of tiny kernels, a few microseconds on current parts; PyTorch's own
# benchmarks of empty kernels report 3-5 us). Replaced by calibration where measured.
LAUNCH_S = 4e-6

# Links between GPUs (docs/references.md, section 20): NVLink per GPU as the datasheets
# quote it (bidirectional: NVLink 2 300 GB/s, NVLink 3 600 GB/s, NVLink 4 900 GB/s, NVLink 5
# 1.8 TB/s), halved to one direction, which is what NCCL's bus bandwidth compares with; PCIe
# x16 per direction (Gen3 ~16, Gen4 ~32, Gen5 ~64 GB/s). NCCL reaches ~80% of NVLink
# (8x A100: 230-250 GB/s bus bandwidth of 300) and ~60% of PCIe (8x H100 PCIe: 35-45 of 64).
NVLINK_EFF = 0.80
PCIE_EFF = 0.60
# Network per GPU across nodes (docs/references.md, section 20): one NIC per GPU in DGX
# systems, 200 Gb/s HDR InfiniBand (DGX A100) or 400 Gb/s NDR (DGX H100, DGX B200): 25 and
# 50 GB/s.
_LINKS: dict[str, tuple[str, float, float, float]] = {  # name -> link, GB/s, eff, network GB/s
    "nvlink2": ("NVLink 2", 150, NVLINK_EFF, 0), "nvlink3": ("NVLink 3", 300, NVLINK_EFF, 25),
    "nvlink4": ("NVLink 4", 450, NVLINK_EFF, 50), "nvlink5": ("NVLink 5", 900, NVLINK_EFF, 50),
    "pcie3": ("PCIe 3.0 x16", 16, PCIE_EFF, 0), "pcie4": ("PCIe 4.0 x16", 32, PCIE_EFF, 0),
    "pcie5": ("PCIe 5.0 x16", 64, PCIE_EFF, 0),
}


def gpu(
    name: str,
    display: str,
    arch: str,
    cc: tuple[int, int],
    sms: int,
    mem_gib: float,
    bw_gbs: float,
    tflops: dict[str, float],
    source: str,
    aliases: tuple[str, ...],
    *,
    datacenter_align: bool = False,
    eff: float = EFF_DEFAULT,
    notes: str = "",
    link: str = "pcie4",
) -> Device:
    link_name, link_gbs, link_eff, network_gbs = _LINKS[link]
    return Device(
        name=name,
        display_name=display,
        architecture=arch,
        compute_capability=cc,
        sms=sms,
        memory_bytes=int(mem_gib * GIB),
        bandwidth_bytes_per_s=bw_gbs * GB,
        peak_flops_per_s={k: v * TB for k, v in tflops.items()},
        alignment_bytes=ALIGN_DATACENTER_BYTES if datacenter_align else 16,
        source=source,
        aliases=aliases,
        gemm_efficiency=eff,
        simt_gemm_factor=SIMT_GEMM_FACTOR.get(arch, 1.0),
        bandwidth_efficiency=BW_EFF,
        launch_overhead_s=LAUNCH_S,
        notes=notes,
        link_name=link_name,
        link_bytes_per_s=link_gbs * GB,
        link_efficiency=link_eff,
        network_bytes_per_s=network_gbs * GB,
    )


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
