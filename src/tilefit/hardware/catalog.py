"""The device catalog: datasheet facts for the GPUs people train on, each with its source.

Figures are dense (no 2:4 sparsity), from the vendors' datasheets and whitepapers as collected
in docs/references.md, section 5. Memory capacities are the datasheet's GB read as GiB
(HBM and GDDR capacities are binary); what CUDA can use is 0.5-1.5 GiB less, which the
estimator books as overhead. Bandwidths are the datasheet's GB/s (powers of ten).

GeForce parts (RTX 3090, 4090) run fp16/bf16 Tensor Core math with fp32 accumulation at half
the fp16-accumulate rate; PyTorch autocast accumulates in fp32, so the catalog lists the
fp32-accumulate figure, which is what training sees (GA102 and Ada whitepapers).
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

_DS = "NVIDIA {} datasheet"

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


def _gpu(
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


_AMPERE_DC = {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312, "int8": 624}
_HOPPER_SXM = {"fp32": 67, "tf32": 494.5, "fp16": 989, "bf16": 989, "fp8": 1979, "int8": 1979}

CATALOG: tuple[Device, ...] = (
    _gpu("v100", "NVIDIA Tesla V100 SXM2 32GB", "Volta", (7, 0), 80, 32, 900,
         {"fp32": 15.7, "fp16": 125}, _DS.format("V100"),
         ("tesla v100", "v100-sxm2", "v100 32gb", "tesla v100-sxm2-32gb", "v100-sxm2-32gb"),
         notes="no bf16, no tf32", link="nvlink2"),
    _gpu("v100-16gb", "NVIDIA Tesla V100 SXM2 16GB", "Volta", (7, 0), 80, 16, 900,
         {"fp32": 15.7, "fp16": 125}, _DS.format("V100"),
         ("v100 16gb", "tesla v100-sxm2-16gb", "v100-sxm2-16gb"), notes="no bf16, no tf32",
         link="nvlink2"),
    _gpu("t4", "NVIDIA Tesla T4", "Turing", (7, 5), 40, 16, 320,
         {"fp32": 8.1, "fp16": 65, "int8": 130}, _DS.format("T4"), ("tesla t4",),
         notes="no bf16, no tf32", link="pcie3"),
    _gpu("a10", "NVIDIA A10", "Ampere", (8, 6), 72, 24, 600,
         {"fp32": 31.2, "tf32": 62.5, "fp16": 125, "bf16": 125, "int8": 250},
         _DS.format("A10"), ("nvidia a10",), eff=EFF_A10, link="pcie4"),
    _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB", "Ampere", (8, 0), 108, 40, 1555, _AMPERE_DC,
         _DS.format("A100"), ("a100 40gb", "a100-sxm4-40gb", "a100 sxm 40gb", "a100-40g"),
         datacenter_align=True, eff=EFF_A100, link="nvlink3"),
    _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB", "Ampere", (8, 0), 108, 80, 2039, _AMPERE_DC,
         _DS.format("A100"), ("a100 80gb", "a100-sxm4-80gb", "a100 sxm 80gb", "a100-80g"),
         datacenter_align=True, eff=EFF_A100, link="nvlink3"),
    _gpu("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", "Ampere", (8, 0), 108, 80, 1935,
         _AMPERE_DC, _DS.format("A100"), ("a100 80gb pcie", "a100-pcie", "a100 pcie"),
         datacenter_align=True, eff=EFF_A100_PCIE, link="pcie4"),
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090", "Ampere", (8, 6), 82, 24, 936,
         {"fp32": 35.6, "tf32": 35.6, "fp16": 71, "bf16": 71, "int8": 284},
         "NVIDIA GA102 (Ampere GA102) whitepaper; fp16/bf16 with fp32 accumulate",
         ("3090", "rtx3090", "geforce rtx 3090"), link="pcie4"),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090", "Ada", (8, 9), 128, 24, 1008,
         {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3, "int8": 660.6},
         "NVIDIA Ada Lovelace (AD102) whitepaper; fp16/bf16 with fp32 accumulate",
         ("4090", "rtx4090", "geforce rtx 4090"), eff=EFF_RTX_4090, link="pcie4"),
    _gpu("l4", "NVIDIA L4", "Ada", (8, 9), 58, 24, 300,
         {"fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121, "fp8": 242, "int8": 242},
         _DS.format("L4") + " (sparse figures halved)", ("nvidia l4",), eff=EFF_L4,
         link="pcie4"),
    _gpu("l40s", "NVIDIA L40S", "Ada", (8, 9), 142, 48, 864,
         {"fp32": 91.6, "tf32": 183, "fp16": 362, "bf16": 362, "fp8": 733, "int8": 733},
         _DS.format("L40S"), ("nvidia l40s",), link="pcie4"),
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB", "Hopper", (9, 0), 132, 80, 3350, _HOPPER_SXM,
         _DS.format("H100"), ("h100", "h100 sxm", "h100-sxm5", "h100 80gb hbm3", "h100-80gb"),
         datacenter_align=True, eff=EFF_HOPPER, link="nvlink4"),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", "Hopper", (9, 0), 114, 80, 2000,
         {"fp32": 51, "tf32": 378, "fp16": 756, "bf16": 756, "fp8": 1513, "int8": 1513},
         _DS.format("H100"), ("h100 pcie", "h100-pcie-80gb"),
         datacenter_align=True, eff=EFF_H100_PCIE, link="pcie5"),
    _gpu("h200", "NVIDIA H200 SXM 141GB", "Hopper", (9, 0), 132, 141, 4800, _HOPPER_SXM,
         _DS.format("H200"), ("h200 sxm", "h200-sxm", "h200 141gb"),
         datacenter_align=True, eff=EFF_HOPPER, link="nvlink4"),
    _gpu("b200", "NVIDIA B200 180GB", "Blackwell", (10, 0), 148, 180, 8000,
         {"fp32": 80, "tf32": 1125, "fp16": 2250, "bf16": 2250, "fp8": 4500, "int8": 4500},
         "public tables quoting NVIDIA's B200 (HGX) figures; some list 192 GB",
         ("nvidia b200", "b200 180gb"), datacenter_align=True, eff=EFF_BLACKWELL,
         link="nvlink5"),
)  # fmt: skip
