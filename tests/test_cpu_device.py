"""get_device("cpu"): this machine's CPU, measured by a short probe when not calibrated."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device


def meminfo_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def test_cpu_device_fields() -> None:
    import torch

    d = get_device("cpu")
    assert d.kind == "cpu" and d.name == "cpu" and d.compute_capability is None
    assert d.sms == torch.get_num_threads()
    # /proc/meminfo's MemTotal excludes the kernel's reserved pages: within 5% of sysconf's.
    assert d.memory_bytes == pytest.approx(meminfo_total_bytes(), rel=0.05)
    assert d.alignment_bytes == 16 and d.multiple("fp32") == 4 and d.multiple("bf16") == 8
    assert d.source.startswith("measured on this machine")
    # Any CPU that runs torch does > 1 GFLOP/s fp32 and copies at > 1 GB/s; none of today's
    # do 100 TFLOP/s or 10 TB/s per socket.
    assert 1e9 < d.peak("fp32") < 1e14
    assert 1e9 < d.bandwidth_bytes_per_s < 1e13
    assert 0 < d.launch_overhead_s < 1e-3
    assert get_device("CPU") is d or get_device("CPU").peak("fp32") == d.peak("fp32")


def test_cpu_gemm_model_without_profile_by_hand() -> None:
    import dataclasses

    d = dataclasses.replace(get_device("cpu"), peak_flops_per_s={"fp32": 1e11},
                            bandwidth_bytes_per_s=5e10, launch_overhead_s=2e-6)
    # 32^3 fp32, uncalibrated terms from peak 1e11 FLOP/s, bandwidth 5e10 B/s, call 2 us:
    # math 2*32768*1e-11 = 6.5536e-7; pack A and B 2 * 1024 * (2*4/5e10) = 3.2768e-7;
    # write C 1024 * 4/5e10 = 8.192e-8; total 2e-6 + 1.06496e-6 = 3.06496e-6
    a = analyze_gemm(32, 32, 32, "fp32", d)
    assert a.predicted_time_s == pytest.approx(3.06496e-6)
    assert a.math_time_s == pytest.approx(6.5536e-7)
    small, large = a, analyze_gemm(2048, 2048, 2048, "fp32", d)
    small = analyze_gemm(32, 32, 32, "fp32", d)
    large = analyze_gemm(2048, 2048, 2048, "fp32", d)
    assert small.predicted_tflops < 0.5 * large.predicted_tflops
    assert large.predicted_tflops <= d.peak("fp32") / 1e12
    assert small.waves == 1 and small.split_k == 1
    assert "GFLOP/s" in large.verdict


def test_the_cpu_probe_runs_once_per_process() -> None:
    from tilefit.hardware.cpu import probe_cpu

    first, second = get_device("cpu"), get_device("host")
    assert probe_cpu.cache_info().misses == 1
    assert first.peak_flops_per_s == second.peak_flops_per_s
    assert first.launch_overhead_s == second.launch_overhead_s
