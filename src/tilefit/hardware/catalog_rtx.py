"""The catalog's RTX workstation and GeForce cards, Turing and later, with 8 GB or more.

Each card's figures come from its vendor page or datasheet: SM count, boost clock, memory and
bandwidth; its dense peaks are the SM count times its architecture's per-SM rate times the
boost clock (``gpu_entry.rtx_peaks``), which reproduces the whitepapers' and datasheets'
printed figures (tests/test_catalog.py checks them against those figures and NVIDIA's
"AI TOPS"). GeForce peaks are fp16/bf16 with fp32 accumulation, half the fp16-accumulate
rate (docs/references.md, section 5). The RTX 3090 and 4090 keep the whitepapers' own
figures.
"""

from __future__ import annotations

from tilefit.hardware.device import Device
from tilefit.hardware.gpu_entry import EFF_DEFAULT, EFF_RTX_4090, gpu, rtx_peaks

_TURING_WP = "NVIDIA Turing GPU architecture whitepaper (reference boost clock)"
_GA102_WP = "NVIDIA Ampere GA102 GPU architecture whitepaper"
_ADA_WP = "NVIDIA Ada Lovelace GPU architecture whitepaper"
_PAGE = "NVIDIA GeForce {} product page"
_BW_WP = "NVIDIA RTX Blackwell GPU architecture whitepaper"


def _rtx(
    name: str,
    display: str,
    arch: str,
    sms: int,
    boost_mhz: float,
    mem_gb: float,
    bw_gbs: float,
    source: str,
    aliases: tuple[str, ...] = (),
    *,
    geforce: bool = True,
) -> Device:
    """A card from its SMs, boost clock, memory and bandwidth. GeForce names also answer
    without their "rtx-" ("4090")."""
    cc = {"Turing": (7, 5), "Ampere": (8, 6), "Ada": (8, 9), "Blackwell": (12, 0)}[arch]
    short = (name.removeprefix("rtx-"),) if geforce and name.startswith("rtx-") else ()
    how = f"; {sms} SMs at {boost_mhz:g} MHz boost x the per-SM rate"
    notes = "fp16/bf16 with fp32 accumulate (half rate)" if geforce else ""
    if arch == "Turing":
        notes = "; ".join(filter(None, [notes, "no bf16, no tf32"]))
    link = {"Turing": "pcie3", "Blackwell": "pcie5"}.get(arch, "pcie4")
    return gpu(name, display, arch, cc, sms, mem_gb, bw_gbs,
               rtx_peaks(arch, sms, boost_mhz, geforce=geforce), source + how,
               short + aliases, eff=EFF_DEFAULT, notes=notes, link=link)


def _pro(name: str, display: str, arch: str, sms: int, boost_mhz: float, mem_gb: float,
         bw_gbs: float, source: str, aliases: tuple[str, ...] = ()) -> Device:
    """A workstation card: fp32 accumulation at the full Tensor Core rate."""
    return _rtx(name, display, arch, sms, boost_mhz, mem_gb, bw_gbs, source, aliases,
                geforce=False)


WORKSTATION: tuple[Device, ...] = (
    _pro("quadro-rtx-4000", "NVIDIA Quadro RTX 4000", "Turing", 36, 1545, 8, 416,
         "NVIDIA Quadro RTX 4000 datasheet"),
    _pro("quadro-rtx-5000", "NVIDIA Quadro RTX 5000", "Turing", 48, 1815, 16, 448,
         "NVIDIA Quadro RTX 5000 datasheet", ("rtx 5000 turing",)),
    _pro("quadro-rtx-6000", "NVIDIA Quadro RTX 6000", "Turing", 72, 1770, 24, 672,
         "NVIDIA Quadro RTX 6000 datasheet; Turing whitepaper", ("rtx 6000 turing",)),
    _pro("quadro-rtx-8000", "NVIDIA Quadro RTX 8000", "Turing", 72, 1770, 48, 672,
         "NVIDIA Quadro RTX 8000 datasheet", ("rtx 8000 turing",)),
    _pro("titan-rtx", "NVIDIA TITAN RTX", "Turing", 72, 1770, 24, 672,
         "NVIDIA TITAN RTX product page (130 Tensor TFLOPS)"),
    _pro("rtx-a4000", "NVIDIA RTX A4000", "Ampere", 48, 1560, 16, 448,
         "NVIDIA RTX A4000 datasheet", ("a4000",)),
    _pro("rtx-a4500", "NVIDIA RTX A4500", "Ampere", 56, 1650, 20, 640,
         "NVIDIA RTX A4500 datasheet", ("a4500",)),
    _pro("rtx-a5000", "NVIDIA RTX A5000", "Ampere", 64, 1695, 24, 768,
         "NVIDIA RTX A5000 datasheet", ("a5000",)),
    _pro("rtx-a5500", "NVIDIA RTX A5500", "Ampere", 80, 1665, 24, 768,
         "NVIDIA RTX A5500 datasheet", ("a5500",)),
    _pro("rtx-a6000", "NVIDIA RTX A6000", "Ampere", 84, 1800, 48, 768,
         "NVIDIA RTX A6000 datasheet; GA102 whitepaper, appendix C", ("a6000",)),
    _pro("rtx-4500-ada", "NVIDIA RTX 4500 Ada Generation", "Ada", 60, 2580, 24, 432,
         "NVIDIA RTX 4500 Ada datasheet", ("rtx 4500 ada generation", "4500 ada")),
    _pro("rtx-5000-ada", "NVIDIA RTX 5000 Ada Generation", "Ada", 100, 2550, 32, 576,
         "NVIDIA RTX 5000 Ada datasheet", ("rtx 5000 ada generation", "5000 ada")),
    _pro("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", "Ada", 142, 2505, 48, 960,
         "NVIDIA RTX 6000 Ada datasheet; " + _ADA_WP, ("rtx 6000 ada generation", "6000 ada")),
)  # fmt: skip

GEFORCE: tuple[Device, ...] = (
    # Turing
    _rtx("rtx-2070", "NVIDIA GeForce RTX 2070", "Turing", 36, 1620, 8, 448, _TURING_WP),
    _rtx("rtx-2070-super", "NVIDIA GeForce RTX 2070 SUPER", "Turing", 40, 1770, 8, 448,
         _PAGE.format("RTX 2070 SUPER")),
    _rtx("rtx-2080", "NVIDIA GeForce RTX 2080", "Turing", 46, 1710, 8, 448, _TURING_WP),
    _rtx("rtx-2080-super", "NVIDIA GeForce RTX 2080 SUPER", "Turing", 48, 1815, 8, 496,
         _PAGE.format("RTX 2080 SUPER")),
    _rtx("rtx-2080-ti", "NVIDIA GeForce RTX 2080 Ti", "Turing", 68, 1545, 11, 616, _TURING_WP),
    # Ampere
    _rtx("rtx-3060", "NVIDIA GeForce RTX 3060 12GB", "Ampere", 28, 1777, 12, 360,
         _PAGE.format("RTX 3060"), ("rtx 3060 12gb",)),
    _rtx("rtx-3060-ti", "NVIDIA GeForce RTX 3060 Ti", "Ampere", 38, 1665, 8, 448,
         _PAGE.format("RTX 3060 Ti")),
    _rtx("rtx-3070", "NVIDIA GeForce RTX 3070", "Ampere", 46, 1725, 8, 448,
         _GA102_WP + ", appendix A"),
    _rtx("rtx-3070-ti", "NVIDIA GeForce RTX 3070 Ti", "Ampere", 48, 1770, 8, 608,
         _PAGE.format("RTX 3070 Ti")),
    _rtx("rtx-3080", "NVIDIA GeForce RTX 3080 10GB", "Ampere", 68, 1710, 10, 760, _GA102_WP,
         ("rtx 3080 10gb",)),
    _rtx("rtx-3080-12gb", "NVIDIA GeForce RTX 3080 12GB", "Ampere", 70, 1710, 12, 912,
         _PAGE.format("RTX 3080")),
    _rtx("rtx-3080-ti", "NVIDIA GeForce RTX 3080 Ti", "Ampere", 80, 1665, 12, 912,
         _PAGE.format("RTX 3080 Ti")),
    gpu("rtx-3090", "NVIDIA GeForce RTX 3090", "Ampere", (8, 6), 82, 24, 936,
        {"fp32": 35.6, "tf32": 35.6, "fp16": 71, "bf16": 71, "int8": 284},
        _GA102_WP + "; fp16/bf16 with fp32 accumulate",
        ("3090", "rtx3090", "geforce rtx 3090"), notes="fp16/bf16 with fp32 accumulate (half "
        "rate)", link="pcie4"),
    _rtx("rtx-3090-ti", "NVIDIA GeForce RTX 3090 Ti", "Ampere", 84, 1860, 24, 1008,
         _PAGE.format("RTX 3090 Ti")),
    # Ada
    _rtx("rtx-4060", "NVIDIA GeForce RTX 4060", "Ada", 24, 2460, 8, 272,
         _PAGE.format("RTX 4060")),
    _rtx("rtx-4060-ti-8gb", "NVIDIA GeForce RTX 4060 Ti 8GB", "Ada", 34, 2535, 8, 288,
         _PAGE.format("RTX 4060 Ti")),
    _rtx("rtx-4060-ti-16gb", "NVIDIA GeForce RTX 4060 Ti 16GB", "Ada", 34, 2535, 16, 288,
         _PAGE.format("RTX 4060 Ti")),
    _rtx("rtx-4070", "NVIDIA GeForce RTX 4070", "Ada", 46, 2475, 12, 504,
         _PAGE.format("RTX 4070")),
    _rtx("rtx-4070-super", "NVIDIA GeForce RTX 4070 SUPER", "Ada", 56, 2475, 12, 504,
         _PAGE.format("RTX 4070 SUPER")),
    _rtx("rtx-4070-ti", "NVIDIA GeForce RTX 4070 Ti", "Ada", 60, 2610, 12, 504,
         _PAGE.format("RTX 4070 Ti")),
    _rtx("rtx-4070-ti-super", "NVIDIA GeForce RTX 4070 Ti SUPER", "Ada", 66, 2610, 16, 672,
         _PAGE.format("RTX 4070 Ti SUPER")),
    _rtx("rtx-4080", "NVIDIA GeForce RTX 4080", "Ada", 76, 2505, 16, 716.8, _ADA_WP),
    _rtx("rtx-4080-super", "NVIDIA GeForce RTX 4080 SUPER", "Ada", 80, 2550, 16, 736,
         _PAGE.format("RTX 4080 SUPER")),
    gpu("rtx-4090", "NVIDIA GeForce RTX 4090", "Ada", (8, 9), 128, 24, 1008,
        {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3, "int8": 660.6},
        _ADA_WP + " (AD102); fp16/bf16 with fp32 accumulate",
        ("4090", "rtx4090", "geforce rtx 4090"), eff=EFF_RTX_4090,
        notes="fp16/bf16 with fp32 accumulate (half rate)", link="pcie4"),
    # Blackwell (GB20x, sm_120)
    _rtx("rtx-5060", "NVIDIA GeForce RTX 5060", "Blackwell", 30, 2497, 8, 448,
         _PAGE.format("RTX 5060")),
    _rtx("rtx-5060-ti-8gb", "NVIDIA GeForce RTX 5060 Ti 8GB", "Blackwell", 36, 2572, 8, 448,
         _PAGE.format("RTX 5060 Ti")),
    _rtx("rtx-5060-ti-16gb", "NVIDIA GeForce RTX 5060 Ti 16GB", "Blackwell", 36, 2572, 16,
         448, _PAGE.format("RTX 5060 Ti")),
    _rtx("rtx-5070", "NVIDIA GeForce RTX 5070", "Blackwell", 48, 2512, 12, 672,
         _PAGE.format("RTX 5070")),
    _rtx("rtx-5070-ti", "NVIDIA GeForce RTX 5070 Ti", "Blackwell", 70, 2452, 16, 896,
         _PAGE.format("RTX 5070 Ti")),
    _rtx("rtx-5080", "NVIDIA GeForce RTX 5080", "Blackwell", 84, 2617, 16, 960,
         _PAGE.format("RTX 5080")),
    _rtx("rtx-5090", "NVIDIA GeForce RTX 5090", "Blackwell", 170, 2407, 32, 1792,
         _PAGE.format("RTX 5090") + "; " + _BW_WP),
)  # fmt: skip

RTX: tuple[Device, ...] = WORKSTATION + GEFORCE
