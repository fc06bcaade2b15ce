"""The GEMM cost model against hand arithmetic and published figures."""

from __future__ import annotations

import dataclasses

import pytest

from tilefit.errors import TilefitError
from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device, list_devices

A100_40 = get_device("a100-40gb")


def test_fc_4096_intensity_at_batch_128() -> None:
    g = analyze_gemm(128, 4096, 4096, "fp16", A100_40)
    assert g.flops == 2 * 128 * 4096 * 4096  # = 4,294,967,296
    assert g.bytes == 2 * (128 * 4096 + 4096 * 4096 + 128 * 4096)  # = 35,651,584
    # 2*128*4096*4096 / (2*(128*4096+4096*4096+128*4096)) = 120.47
    assert g.arithmetic_intensity == pytest.approx(120.47, abs=0.005)
    assert g.ops_per_byte == pytest.approx(200.64, abs=0.005)  # 312e12 / 1555e9
    assert g.bound == "memory"


@pytest.mark.parametrize("batch", [1, 2, 8, 16, 32, 64, 100, 128])
def test_fc_4096_forward_memory_bound_up_to_128(batch: int) -> None:
    # FC-layer guide: 4096 -> 4096 fp16 on A100 is bandwidth-limited at batch <= 128
    assert analyze_gemm(batch, 4096, 4096, "fp16", A100_40).bound == "memory"


@pytest.mark.parametrize("batch", [256, 512, 1024, 4096])
def test_fc_4096_forward_math_bound_from_256(batch: int) -> None:
    # batch 256: 2*256*4096^2 / (2*(256*4096 + 4096^2 + 256*4096)) = 227.6 > 200.6
    assert analyze_gemm(batch, 4096, 4096, "fp16", A100_40).bound == "math"


def _ratio_cases() -> list[tuple[str, str]]:
    return [(d.name, dt) for d in list_devices() for dt in d.peak_flops_per_s]


@pytest.mark.parametrize(("gpu", "dtype"), _ratio_cases())
def test_batch_8_and_below_is_memory_bound_for_any_width(gpu: str, dtype: str) -> None:
    d = get_device(gpu)
    from tilefit.dtypes import parse_dtype

    s = parse_dtype(dtype).bytes
    # A GEMM with one dimension b <= 8 has intensity 2bNK / (s(bK + KN + bN)) < 2b/s <= 16/s
    # for any N, K; the catalog's smallest ops:byte ratio for each dtype is above that bound.
    assert d.ops_per_byte(dtype) > 16 / s
    for width in (1, 8, 64, 1000, 4096, 65536, 2**20):
        for b in range(1, 9):
            for m, n, k in ((b, width, width), (width, width, b), (b, width, 7 * width)):
                assert analyze_gemm(m, n, k, dtype, d).bound == "memory", (m, n, k)


@pytest.mark.parametrize("gpu", ["a100-40gb", "a100-80gb", "h100-sxm", "b200"])
def test_misaligned_k_is_slower_than_the_aligned_k_above(gpu: str) -> None:
    d = get_device(gpu)
    for m, n in ((4096, 4096), (128, 4096), (8192, 1024)):
        off = analyze_gemm(m, n, 4095, "fp16", d)
        on = analyze_gemm(m, n, 4096, "fp16", d)
        assert off.predicted_time_s > on.predicted_time_s
        assert not off.alignment["k"].aligned and off.alignment["k"].suggested == 4096
        assert on.alignment["k"].aligned


def test_odd_k_slower_than_even_k() -> None:
    # Matrix Multiplication Background guide, Figure 2 (cuBLAS 11): among K not divisible by
    # 8, even K runs faster than odd K
    odd = analyze_gemm(4096, 4096, 4095, "fp16", A100_40)
    even = analyze_gemm(4096, 4096, 4094, "fp16", A100_40)
    assert odd.predicted_time_s > even.predicted_time_s


@pytest.mark.parametrize("gpu", ["a100-40gb", "h100-sxm", "t4", "rtx-4090"])
def test_twice_the_gemm_takes_less_than_twice_the_time_while_memory_bound(gpu: str) -> None:
    d = get_device(gpu)
    for m in (1, 2, 4, 8, 16, 32, 64):
        small = analyze_gemm(m, 4096, 4096, "fp16", d)
        big = analyze_gemm(2 * m, 4096, 4096, "fp16", d)
        if big.bound != "memory":
            continue
        assert big.flops == 2 * small.flops
        assert big.predicted_time_s < 2 * small.predicted_time_s, m


def test_a100_fc_layer_near_the_guides_250_tflops() -> None:
    # FC-layer guide: a 4096-in / 1024-out layer at large batch reaches about 250 of 312
    # TFLOP/s (fp16, A100). Tolerance +-10%: 225..275.
    for tokens in (16384, 32768):
        g = analyze_gemm(tokens, 1024, 4096, "fp16", A100_40)
        assert 225 <= g.predicted_tflops <= 275, (tokens, g.predicted_tflops)
        assert g.peak_tflops == pytest.approx(312)


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200"])
def test_hopper_8192_cubed_near_measured(gpu: str) -> None:
    # docs/references.md, section 6: bf16 8192^3 on H200 measured 770-800 TFLOP/s of 989;
    # "maximum achievable" H100 795. Tolerance: the measured range widened by ~4%: 740..830.
    g = analyze_gemm(8192, 8192, 8192, "bf16", get_device(gpu))
    assert 740 <= g.predicted_tflops <= 830, g.predicted_tflops
    assert g.bound == "math"


def test_fp8_misaligned_is_an_error_not_a_slowdown() -> None:
    h100 = get_device("h100-sxm")
    g = analyze_gemm(4096, 4096, 4100, "fp8", h100)  # 4100 % 16 = 4
    assert g.error is not None
    assert "16" in g.error and "k=4112" in g.error  # 4100 rounded up to a multiple of 16
    assert g.verdict.startswith("ERROR")
    # 16-aligned but not 128-aligned is a slowdown, not an error
    ok = analyze_gemm(4096, 4096, 4112, "fp8", h100)
    assert ok.error is None
    assert not ok.alignment["k"].aligned


def test_tile_and_wave_quantization_example_from_the_guide() -> None:
    # Matrix Multiplication Background guide: 1792x1792 output with 256x128 tiles -> 7*14 = 98
    # tiles on A100's 108 SMs: one wave, 98/108 = 90.7% full.
    import math

    tiles = math.ceil(1792 / 256) * math.ceil(1792 / 128)
    assert tiles == 98
    g = analyze_gemm(1792, 1792, 8192, "fp16", A100_40)
    assert g.waves == 1
    assert g.tile_efficiency == 1.0  # 1792 = 7*256 = 14*128
    if g.tile == (256, 128) and g.split_k == 1:
        assert g.wave_efficiency == pytest.approx(98 / 108)


@pytest.mark.parametrize(("m", "n", "k"), [(0, 1, 1), (1, -5, 1), (1, 1, 2.5), (True, 1, 1)])
def test_bad_dims(m, n, k) -> None:
    with pytest.raises(TilefitError, match="positive integer"):
        analyze_gemm(m, n, k, "fp16", A100_40)


def test_unknown_dtype() -> None:
    with pytest.raises(TilefitError, match="unknown dtype"):
        analyze_gemm(64, 64, 64, "fp64", A100_40)


@pytest.mark.parametrize(("m", "waves"), [(1792, 1), (8192, 19)])
def test_tile_latency_is_paid_once_per_wave(m: int, waves: int) -> None:
    # 1792x1792 in 256x128 tiles: 7*14 = 98 tiles on 108 SMs, one wave (the guide's example);
    # 8192x8192: 32*64 = 2048 tiles, ceil(2048/108) = 19 waves. A fixed 2 us per wave adds
    # waves x 2 us to the math time when the kernel pick stays the same.
    base = dataclasses.replace(A100_40, gemm_tile_latency_s=0.0)
    slow = dataclasses.replace(A100_40, gemm_tile_latency_s=2e-6)
    g0 = analyze_gemm(m, m, 8192, "fp16", base)
    g1 = analyze_gemm(m, m, 8192, "fp16", slow)
    assert (g0.tile, g0.split_k, g0.waves) == ((256, 128), 1, waves)
    assert (g1.tile, g1.split_k, g1.waves) == ((256, 128), 1, waves)
    assert g1.math_time_s - g0.math_time_s == pytest.approx(waves * 2e-6, rel=1e-9)


def test_negative_tile_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="gemm_tile_latency_s"):
        dataclasses.replace(A100_40, gemm_tile_latency_s=-1e-6)


def test_output_tiles_store_after_their_main_loops() -> None:
    # A100 40GB, fp16 8192^3 in 256x128 tiles: 32*64 = 2048 tiles, ceil(2048/108) = 19 waves.
    # Main loops: 19 x 2*256*128*8192 FLOPs at 312e12 * 0.916 / 108 per SM = 19 x 202.9 us =
    # 3.8547 ms. The tiles' stores: the whole 8192^2 fp16 output, 134.2 MB, at 1555 GB/s x 0.9
    # = 95.9 us, added (not overlapped), then one 4 us launch: 3.9547 ms.
    g = analyze_gemm(8192, 8192, 8192, "fp16", A100_40)
    assert (g.tile, g.split_k, g.tiles, g.waves) == ((256, 128), 1, 2048, 19)
    main_loop = 19 * 2 * 256 * 128 * 8192 / (312e12 * 0.916 / 108)
    stores = 8192 * 8192 * 2 / (1555e9 * 0.9)
    assert g.math_time_s == pytest.approx(main_loop, rel=1e-9)
    assert g.epilogue_time_s == pytest.approx(stores, rel=1e-9)
    assert g.predicted_time_s == pytest.approx(main_loop + stores + 4e-6, rel=1e-9)


def test_short_k_pays_its_stores_in_proportion() -> None:
    # The stores weigh ops_per_byte / K against the main loops: the same 8192 x 8192 output
    # with K = 768 instead of 8192 spends the same 95.9 us storing but a tenth of the main
    # loop, so its TFLOP/s drop well below the long-K GEMM's.
    long_k = analyze_gemm(8192, 8192, 8192, "fp16", A100_40)
    short_k = analyze_gemm(8192, 8192, 768, "fp16", A100_40)
    assert short_k.epilogue_time_s == pytest.approx(long_k.epilogue_time_s, rel=1e-9)
    assert short_k.epilogue_time_s / short_k.math_time_s > 0.2 > (
        long_k.epilogue_time_s / long_k.math_time_s)
    assert short_k.predicted_tflops < 0.85 * long_k.predicted_tflops


@pytest.mark.parametrize("record", ["mamf-a100-80gb-bf16", "mamf-a100-pcie-80gb-bf16",
                                    "mamf-h100-sxm-bf16", "mamf-b200-bf16"])
def test_catalog_efficiency_reproduces_the_published_best_matmul(record: str) -> None:
    # Bekman's "maximum achievable matmul FLOPs" (docs/references.md, sections 6 and 28), as
    # benchmarks/gpu_corpus/gemm.jsonl holds it: the catalog's gemm_efficiency was solved so
    # that the model predicts the published best TFLOP/s at the shape that reached it.
    import json
    from pathlib import Path

    corpus = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_corpus" / "gemm.jsonl"
    rec = next(r for r in map(json.loads, corpus.read_text().splitlines()) if r["id"] == record)
    g = analyze_gemm(rec["m"], rec["n"], rec["k"], rec["dtype"], get_device(rec["gpu"]))
    assert g.predicted_tflops == pytest.approx(rec["measured"]["tflops"], rel=0.005)


@pytest.mark.parametrize("record", ["chs4-a10-fp32-4096", "chs4-a10-fp32-5792"])
def test_a10_efficiency_reproduces_its_published_sweep(record: str) -> None:
    # The A10's efficiency was fitted on its fp32 sweep (the corpus's source 12; Ampere's
    # CUDA-core factor 1.0): at the fit sizes that reached the card's sustained rate the model
    # is within 2% of the published TFLOP/s (4096: 13.69, 5792: 14.50). The datasheet's peak at
    # the catalog's default efficiency would be 74% too fast.
    import json
    from pathlib import Path

    corpus = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_corpus" / "gemm.jsonl"
    rec = next(r for r in map(json.loads, corpus.read_text().splitlines()) if r["id"] == record)
    a10 = get_device("a10")
    g = analyze_gemm(rec["m"], rec["n"], rec["k"], rec["dtype"], a10)
    assert g.predicted_tflops == pytest.approx(rec["measured"]["tflops"], rel=0.02)
    default = analyze_gemm(rec["m"], rec["n"], rec["k"], rec["dtype"],
                           dataclasses.replace(a10, gemm_efficiency=0.870))
    assert default.predicted_tflops > 1.5 * rec["measured"]["tflops"]


def test_cuda_core_factor_scales_fp32_gemms_only() -> None:
    # A100 40GB with a CUDA-core factor of 0.8: an fp32 8192^3 GEMM (TF32 off) runs its main
    # loops at 19.5e12 x 0.916 x 0.8 / 108 = 132.3 GFLOP/s per SM: 19 waves of 2*256*128*8192
    # FLOPs per tile -> 77.10 ms; fp16 on the same device keeps 0.916 (its Tensor Cores are
    # not the CUDA cores).
    slow = dataclasses.replace(A100_40, simt_gemm_factor=0.8)
    g = analyze_gemm(8192, 8192, 8192, "fp32", slow)
    assert (g.tile, g.split_k, g.waves) == ((256, 128), 1, 19)
    assert g.math_time_s == pytest.approx(
        19 * 2 * 256 * 128 * 8192 / (19.5e12 * 0.916 * 0.8 / 108), rel=1e-9)
    assert analyze_gemm(8192, 8192, 8192, "fp16", slow).math_time_s == pytest.approx(
        analyze_gemm(8192, 8192, 8192, "fp16", A100_40).math_time_s, rel=1e-12)
    # the factor never lifts the efficiency past the peak
    fast = dataclasses.replace(A100_40, simt_gemm_factor=2.0)
    assert analyze_gemm(8192, 8192, 8192, "fp32", fast).math_time_s == pytest.approx(
        19 * 2 * 256 * 128 * 8192 / (19.5e12 / 108), rel=1e-9)
