"""The device catalog: datasheet facts for the GPUs people rent and own, each with its source.

Figures are dense (no 2:4 sparsity), from the vendors' datasheets and whitepapers as collected
in docs/references.md, section 5. Memory capacities are the datasheet's GB read as GiB
(HBM and GDDR capacities are binary); what CUDA can use is 0.5-1.5 GiB less, which the
estimator books as overhead. Bandwidths are the datasheet's GB/s (powers of ten).

This module holds the data-center parts (Volta and later); ``catalog_rtx`` the RTX
workstation and GeForce cards (Turing and later, 8 GB or more). GeForce parts run fp16/bf16
Tensor Core math with fp32 accumulation at half the fp16-accumulate rate; PyTorch autocast
accumulates in fp32, so the catalog lists the fp32-accumulate figure, which is what training
sees (GA102 and Ada whitepapers).
"""

from __future__ import annotations

from tilefit.hardware.catalog_rtx import RTX
from tilefit.hardware.device import Device
from tilefit.hardware.gpu_entry import (
    EFF_A10,
    EFF_A100,
    EFF_A100_PCIE,
    EFF_BLACKWELL,
    EFF_DEFAULT,
    EFF_H100_PCIE,
    EFF_HOPPER,
    EFF_L4,
    EFF_RTX_4090,
    SIMT_GEMM_FACTOR,
    gpu,
)

__all__ = ["CATALOG", "DATACENTER", "EFF_A10", "EFF_A100", "EFF_A100_PCIE", "EFF_BLACKWELL",
           "EFF_DEFAULT", "EFF_H100_PCIE", "EFF_HOPPER", "EFF_L4", "EFF_RTX_4090",
           "SIMT_GEMM_FACTOR"]

_DS = "NVIDIA {} datasheet"

_AMPERE_DC = {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312, "int8": 624}
_HOPPER_SXM = {"fp32": 67, "tf32": 494.5, "fp16": 989, "bf16": 989, "fp8": 1979, "int8": 1979}
# H100 NVL and H200 NVL: the datasheets' NVL columns (FP32 60; TF32 835, BF16/FP16 1,671,
# FP8/INT8 3,341 with sparsity, halved here)
_HOPPER_NVL = {"fp32": 60, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5,
               "int8": 1670.5}
_V100 = "no bf16, no tf32"

DATACENTER: tuple[Device, ...] = (
    # Volta (V100 datasheet: SXM2 and PCIe columns; V100S datasheet)
    gpu("v100", "NVIDIA Tesla V100 SXM2 32GB", "Volta", (7, 0), 80, 32, 900,
        {"fp32": 15.7, "fp16": 125}, _DS.format("V100"),
        ("tesla v100", "v100-sxm2", "v100 32gb", "tesla v100-sxm2-32gb", "v100-sxm2-32gb"),
        notes=_V100, link="nvlink2"),
    gpu("v100-16gb", "NVIDIA Tesla V100 SXM2 16GB", "Volta", (7, 0), 80, 16, 900,
        {"fp32": 15.7, "fp16": 125}, _DS.format("V100"),
        ("v100 16gb", "tesla v100-sxm2-16gb", "v100-sxm2-16gb"), notes=_V100,
        link="nvlink2"),
    gpu("v100-pcie-32gb", "NVIDIA Tesla V100 PCIe 32GB", "Volta", (7, 0), 80, 32, 900,
        {"fp32": 14, "fp16": 112}, _DS.format("V100") + " (PCIe column)",
        ("v100 pcie", "v100-pcie"), notes=_V100, link="pcie3"),
    gpu("v100-pcie-16gb", "NVIDIA Tesla V100 PCIe 16GB", "Volta", (7, 0), 80, 16, 900,
        {"fp32": 14, "fp16": 112}, _DS.format("V100") + " (PCIe column)", (),
        notes=_V100, link="pcie3"),
    gpu("v100s", "NVIDIA Tesla V100S PCIe 32GB", "Volta", (7, 0), 80, 32, 1134,
        {"fp32": 16.4, "fp16": 130}, _DS.format("V100S"), ("v100s-pcie-32gb", "v100s pcie"),
        notes=_V100, link="pcie3"),
    # Turing
    gpu("t4", "NVIDIA Tesla T4", "Turing", (7, 5), 40, 16, 320,
        {"fp32": 8.1, "fp16": 65, "int8": 130}, _DS.format("T4"), ("tesla t4",),
        notes="no bf16, no tf32", link="pcie3"),
    # Ampere GA10x (A2, A10, A40 datasheets) and GA100 (A30, A100 datasheets)
    gpu("a2", "NVIDIA A2", "Ampere", (8, 6), 10, 16, 200,
        {"fp32": 4.5, "tf32": 9, "fp16": 18, "bf16": 18, "int8": 36}, _DS.format("A2"),
        ("nvidia a2",), link="pcie4"),
    gpu("a10", "NVIDIA A10", "Ampere", (8, 6), 72, 24, 600,
        {"fp32": 31.2, "tf32": 62.5, "fp16": 125, "bf16": 125, "int8": 250},
        _DS.format("A10"), ("nvidia a10",), eff=EFF_A10, link="pcie4"),
    gpu("a40", "NVIDIA A40", "Ampere", (8, 6), 84, 48, 696,
        {"fp32": 37.4, "tf32": 74.8, "fp16": 149.7, "bf16": 149.7, "int8": 299.3},
        _DS.format("A40"), ("nvidia a40",), link="pcie4"),
    gpu("a30", "NVIDIA A30", "Ampere", (8, 0), 56, 24, 933,
        {"fp32": 10.3, "tf32": 82, "fp16": 165, "bf16": 165, "int8": 330}, _DS.format("A30"),
        ("nvidia a30",), datacenter_align=True, link="pcie4"),
    gpu("a100-40gb", "NVIDIA A100 SXM4 40GB", "Ampere", (8, 0), 108, 40, 1555, _AMPERE_DC,
        _DS.format("A100"), ("a100 40gb", "a100-sxm4-40gb", "a100 sxm 40gb", "a100-40g"),
        datacenter_align=True, eff=EFF_A100, link="nvlink3"),
    gpu("a100-80gb", "NVIDIA A100 SXM4 80GB", "Ampere", (8, 0), 108, 80, 2039, _AMPERE_DC,
        _DS.format("A100"), ("a100 80gb", "a100-sxm4-80gb", "a100 sxm 80gb", "a100-80g"),
        datacenter_align=True, eff=EFF_A100, link="nvlink3"),
    gpu("a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", "Ampere", (8, 0), 108, 40, 1555,
        _AMPERE_DC, _DS.format("A100") + " (40GB PCIe column)", ("a100 40gb pcie",),
        datacenter_align=True, link="pcie4"),
    gpu("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", "Ampere", (8, 0), 108, 80, 1935,
        _AMPERE_DC, _DS.format("A100"), ("a100 80gb pcie", "a100-pcie", "a100 pcie"),
        datacenter_align=True, eff=EFF_A100_PCIE, link="pcie4"),
    # Ada (L4, L40, L40S datasheets)
    gpu("l4", "NVIDIA L4", "Ada", (8, 9), 58, 24, 300,
        {"fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121, "fp8": 242, "int8": 242},
        _DS.format("L4") + " (sparse figures halved)", ("nvidia l4",), eff=EFF_L4,
        link="pcie4"),
    gpu("l40", "NVIDIA L40", "Ada", (8, 9), 142, 48, 864,
        {"fp32": 90.5, "tf32": 90.5, "fp16": 181.05, "bf16": 181.05, "fp8": 362, "int8": 362},
        _DS.format("L40") + " (half the L40S's Tensor rates)", ("nvidia l40",), link="pcie4"),
    gpu("l40s", "NVIDIA L40S", "Ada", (8, 9), 142, 48, 864,
        {"fp32": 91.6, "tf32": 183, "fp16": 362, "bf16": 362, "fp8": 733, "int8": 733},
        _DS.format("L40S"), ("nvidia l40s",), link="pcie4"),
    # Hopper (H100, H200, GH200 datasheets)
    gpu("h100-sxm", "NVIDIA H100 SXM5 80GB", "Hopper", (9, 0), 132, 80, 3350, _HOPPER_SXM,
        _DS.format("H100"), ("h100", "h100 sxm", "h100-sxm5", "h100 80gb hbm3", "h100-80gb"),
        datacenter_align=True, eff=EFF_HOPPER, link="nvlink4"),
    gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", "Hopper", (9, 0), 114, 80, 2000,
        {"fp32": 51, "tf32": 378, "fp16": 756, "bf16": 756, "fp8": 1513, "int8": 1513},
        _DS.format("H100"), ("h100 pcie", "h100-pcie-80gb"),
        datacenter_align=True, eff=EFF_H100_PCIE, link="pcie5"),
    gpu("h100-nvl", "NVIDIA H100 NVL 94GB", "Hopper", (9, 0), 132, 94, 3900, _HOPPER_NVL,
        _DS.format("H100") + " (NVL column, sparse figures halved)", ("nvidia h100 nvl",),
        datacenter_align=True, link="pcie5"),
    gpu("h200", "NVIDIA H200 SXM 141GB", "Hopper", (9, 0), 132, 141, 4800, _HOPPER_SXM,
        _DS.format("H200"), ("h200 sxm", "h200-sxm", "h200 141gb"),
        datacenter_align=True, eff=EFF_HOPPER, link="nvlink4"),
    gpu("h200-nvl", "NVIDIA H200 NVL 141GB", "Hopper", (9, 0), 132, 141, 4800, _HOPPER_NVL,
        _DS.format("H200") + " (NVL column, sparse figures halved)", ("nvidia h200 nvl",),
        datacenter_align=True, link="pcie5"),
    gpu("gh200", "NVIDIA GH200 96GB HBM3", "Hopper", (9, 0), 132, 96, 4000, _HOPPER_SXM,
        _DS.format("GH200") + " (96GB HBM3 column)", ("gh200 480gb", "gh200 96gb"),
        datacenter_align=True, eff=EFF_HOPPER, link="nvlink4"),
    gpu("gh200-144gb", "NVIDIA GH200 144GB HBM3e", "Hopper", (9, 0), 132, 144, 4900,
        _HOPPER_SXM, _DS.format("GH200") + " (144GB HBM3e column)", ("gh200 144g hbm3e",),
        datacenter_align=True, eff=EFF_HOPPER, link="nvlink4"),
    # Blackwell
    gpu("b200", "NVIDIA B200 180GB", "Blackwell", (10, 0), 148, 180, 8000,
        {"fp32": 80, "tf32": 1125, "fp16": 2250, "bf16": 2250, "fp8": 4500, "int8": 4500},
        "public tables quoting NVIDIA's B200 (HGX) figures; some list 192 GB",
        ("nvidia b200", "b200 180gb"), datacenter_align=True, eff=EFF_BLACKWELL,
        link="nvlink5"),
)  # fmt: skip

CATALOG: tuple[Device, ...] = DATACENTER + RTX
