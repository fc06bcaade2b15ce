"""Profiles: save/load round trip, and get_device using them (and saying so)."""

from __future__ import annotations

import json

import pytest

from tilefit.errors import TilefitError
from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device
from tilefit.hardware.cpu import cpu_model_name, fresh_alloc_s_per_byte
from tilefit.hardware.profile import MODEL_CPU, MODEL_GPU, GemmFit, Profile
from tilefit.hardware.profiles import (
    clear_profile_cache,
    load_profile,
    profile_path,
    save_profile,
    stored_profile,
)


def cpu_profile(threads: int) -> Profile:
    fit = GemmFit(dtype="fp32", model=MODEL_CPU, call_overhead_s=1e-6, s_per_flop=1e-11,
                  s_per_a_element=1e-10, s_per_b_element=1e-10, s_per_c_element=2e-10,
                  misaligned_factor=0.5, shapes=30, median_error=0.05, p90_error=0.2)
    return Profile(device="cpu", display_name=cpu_model_name(), kind="cpu",
                   created="2026-11-29T12:00:00+00:00", torch_version="2.13.0",
                   threads=threads, peak_flops_per_s={"fp32": 1e11, "bf16": 4e11},
                   bandwidth_bytes_per_s=4e10, call_overhead_s=1e-6, gemm=(fit,), quick=True,
                   duration_s=12.0)


def h200_profile(launch_s: float) -> Profile:
    fit = GemmFit(dtype="bf16", model=MODEL_GPU, call_overhead_s=launch_s, gemm_efficiency=0.41)
    return Profile(device="h200", display_name="NVIDIA H200", kind="cuda",
                   created="2026-11-29T12:00:00+00:00", torch_version="2.13.0", threads=None,
                   peak_flops_per_s={"bf16": 989e12}, bandwidth_bytes_per_s=4.32e12, gemm=(fit,))


def write_behind_the_cache(profile: Profile) -> None:
    """Write a profile file the way another process would: not through save_profile."""
    path = profile_path(profile.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict()))


def test_round_trip(tilefit_cache) -> None:
    p = cpu_profile(2)
    path = save_profile(p)
    assert path == tilefit_cache / "profiles" / "cpu.json"
    back = load_profile("cpu")
    assert back is not None
    assert back.path == str(path)
    assert back.gemm == p.gemm and back.peak_flops_per_s == p.peak_flops_per_s
    assert back.to_dict() | {"path": ""} == p.to_dict()
    assert "path" not in json.loads(path.read_text())


def test_missing_and_unreadable() -> None:
    assert load_profile("cpu") is None
    profile_path("cpu").parent.mkdir(parents=True)
    profile_path("cpu").write_text('{"device": "cpu"}')
    with pytest.raises(TilefitError, match="unreadable"):
        load_profile("cpu")


def test_cpu_device_uses_profile_and_says_so() -> None:
    import torch

    path = save_profile(cpu_profile(torch.get_num_threads()))
    d = get_device("cpu")
    assert d.profile is not None
    assert d.source.startswith(f"calibrated profile {path} from 2026-11-29")
    assert d.peak("fp32") == 1e11 and d.bandwidth_bytes_per_s == 4e10
    assert json.loads(json.dumps(d.to_dict()))["profile"]["gemm"][0]["s_per_flop"] == 1e-11
    # Hand arithmetic with the profile's terms, M=N=K=100 (aligned):
    # 1e-6 + 2*1e6*1e-11 (2e-5) + 1e4*1e-10 (1e-6) + 1e4*1e-10 (1e-6) + 1e4*2e-10 (2e-6)
    assert analyze_gemm(100, 100, 100, "fp32", d).predicted_time_s == pytest.approx(2.5e-5)
    # M=101 (odd, misaligned, factor 0.5): (2.02e-5 + 1.01e-6 + 1e-6 + 2.02e-6) / 0.5 + 1e-6
    a = analyze_gemm(101, 100, 100, "fp32", d)
    assert a.predicted_time_s == pytest.approx(4.946e-5)
    assert a.alignment["m"].factor == 0.5 and a.alignment["n"].factor == 1.0
    # the profile has no first-touch figure: the once-per-process measurement fills it in
    assert d.fresh_alloc_s_per_byte == fresh_alloc_s_per_byte()


def test_cpu_profile_with_other_thread_count_is_ignored(monkeypatch) -> None:
    import torch

    save_profile(cpu_profile(torch.get_num_threads() + 7))
    d = get_device("cpu")
    assert d.profile is None
    assert "ignored" in d.source and "threads" in d.source
    monkeypatch.setenv("TILEFIT_NO_PROFILE", "1")
    assert load_profile("cpu") is None


def test_gpu_profile_replaces_efficiency() -> None:
    base = get_device("h200")
    assert base.profile is None
    path = save_profile(h200_profile(launch_s=5e-6))
    d = get_device("h200")
    assert d.profile is not None and d.profile.path == str(path)
    assert d.launch_overhead_s == 5e-6
    assert d.gemm_efficiency == base.gemm_efficiency  # dtypes without a fit keep the catalog's
    assert d.bandwidth_efficiency == pytest.approx(0.9)  # 4.32 / 4.8 TB/s
    assert d.source == f"{base.source}; calibrated profile {path} from 2026-11-29"
    # 8192^3 bf16 is math-bound and fills whole waves: math time scales as 1/efficiency.
    t_base = analyze_gemm(8192, 8192, 8192, "bf16", base).math_time_s
    t_cal = analyze_gemm(8192, 8192, 8192, "bf16", d).math_time_s
    assert t_cal / t_base == pytest.approx(base.gemm_efficiency / 0.41)
    # tf32 was not calibrated: its math time is the catalog model's
    assert analyze_gemm(8192, 8192, 8192, "tf32", d).math_time_s == pytest.approx(
        analyze_gemm(8192, 8192, 8192, "tf32", base).math_time_s)


def test_lookup_reads_a_profile_once_per_process() -> None:
    path = save_profile(h200_profile(launch_s=5e-6))
    first = get_device("h200")
    assert first.launch_overhead_s == 5e-6 and str(path) in first.source
    write_behind_the_cache(h200_profile(launch_s=7e-6))
    # get_device keeps what it read; load_profile reads the file now
    assert get_device("h200").launch_overhead_s == 5e-6
    assert stored_profile("h200") is first.profile
    fresh = load_profile("h200")
    assert fresh is not None and fresh.gemm[0].call_overhead_s == 7e-6
    clear_profile_cache()
    assert get_device("h200").launch_overhead_s == 7e-6


def test_an_absent_profile_is_remembered_until_one_is_saved() -> None:
    assert get_device("h200").profile is None
    write_behind_the_cache(h200_profile(launch_s=7e-6))
    assert get_device("h200").profile is None  # the absence was cached
    save_profile(h200_profile(launch_s=5e-6))  # a save in this process is seen at once
    assert get_device("h200").launch_overhead_s == 5e-6


def test_the_cache_follows_the_cache_dir_and_the_off_switch(tmp_path, monkeypatch) -> None:
    save_profile(h200_profile(launch_s=5e-6))
    assert get_device("h200").profile is not None
    monkeypatch.setenv("TILEFIT_NO_PROFILE", "1")
    assert get_device("h200").profile is None and stored_profile("h200") is None
    monkeypatch.delenv("TILEFIT_NO_PROFILE")
    assert get_device("h200").profile is not None
    monkeypatch.setenv("TILEFIT_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert get_device("h200").profile is None  # another cache dir, another (absent) file


def test_an_unreadable_profile_is_an_error_on_every_lookup() -> None:
    profile_path("h200").parent.mkdir(parents=True)
    profile_path("h200").write_text("{")
    for _ in range(2):
        with pytest.raises(TilefitError, match="unreadable"):
            get_device("h200")


def test_a_gpu_profiles_measured_host_replaces_the_default(tilefit_cache) -> None:
    # calibrate on a GPU machine stores eager PyTorch's per-op host costs measured there;
    # the device then issues ops at those costs, and the profile file round-trips them
    import dataclasses

    from tilefit.hardware.host import DEFAULT_HOST, HostModel

    host = HostModel(forward_op_s=7e-6, backward_op_s=5e-6, optimizer_op_s=6e-6,
                     optimizer_tensor_s=0.0, launch_s=0.0, source="measured here")
    save_profile(dataclasses.replace(h200_profile(5e-6), host=host))
    dev = get_device("h200")
    assert dev.host == host and dev.host != DEFAULT_HOST
    assert get_device("a100-80gb").host == DEFAULT_HOST  # other parts keep the default
