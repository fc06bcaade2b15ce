"""Property tests of the GEMM model and the linear totals (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tilefit.dtypes import parse_dtype
from tilefit.gemm import analyze_gemm
from tilefit.hardware import list_devices
from tilefit.linear import analyze_linear

DEVICE_DTYPES = [(d, dt) for d in list_devices() for dt in d.peak_flops_per_s]
dims = st.integers(min_value=1, max_value=70_000)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(DEVICE_DTYPES), dims, dims, dims)
def test_gemm_invariants(device_dtype, m: int, n: int, k: int) -> None:
    device, dtype = device_dtype
    g = analyze_gemm(m, n, k, dtype, device)
    s = parse_dtype(dtype).bytes
    assert g.predicted_time_s > 0
    # delivered FLOP/s never above the dtype's dense peak
    assert g.flops / g.predicted_time_s <= device.peak(dtype)
    assert g.predicted_tflops <= g.peak_tflops
    for name, value in (("m", m), ("n", n), ("k", k)):
        al = g.alignment[name]
        assert al.multiple == device.multiple(dtype)
        assert al.suggested % al.multiple == 0
        assert value <= al.suggested < value + al.multiple
        assert al.aligned == (value % al.multiple == 0)
        assert 0 < al.factor <= 1
        assert al.factor == 1.0 or not al.aligned
    # bound from an independent computation of the intensity
    intensity = 2 * m * n * k / (s * (m * k + k * n + m * n))
    ratio = device.peak(dtype) / device.bandwidth_bytes_per_s
    assert abs(g.arithmetic_intensity - intensity) <= 1e-9 * intensity
    if intensity < ratio * (1 - 1e-12):
        assert g.bound == "memory"
    elif intensity > ratio * (1 + 1e-12):
        assert g.bound == "math"
    assert 0 < g.tile_efficiency <= 1 and 0 < g.wave_efficiency <= 1


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DEVICE_DTYPES), st.integers(1, 20_000), st.integers(1, 20_000),
       st.lists(st.integers(1, 4096), min_size=1, max_size=4), st.integers(1, 4096))
def test_linear_totals_are_sums(device_dtype, in_f: int, out_f: int, batches: list[int],
                                seq: int) -> None:
    device, dtype = device_dtype
    a = analyze_linear(in_f, out_f, batches, seq=seq, dtype=dtype, device=device)
    assert len(a.rows) == 3 * len(a.totals)
    for total in a.totals:
        rows = a.rows_for(total.batch)
        assert total.tokens == total.batch * seq
        assert total.flops == sum(r.gemm.flops for r in rows) == 6 * total.tokens * in_f * out_f
        assert abs(total.predicted_time_s - sum(r.gemm.predicted_time_s for r in rows)) <= (
            1e-12 * total.predicted_time_s)
        assert total.aligned == (total.tokens % device.multiple(dtype) == 0)
    recs = a.recommendations
    if recs.min_math_bound_batch is not None:
        b = recs.min_math_bound_batch
        assert analyze_linear(in_f, out_f, [b], seq=seq, dtype=dtype,
                              device=device).totals[0].bound == "math"
        if b > 1:
            assert analyze_linear(in_f, out_f, [b - 1], seq=seq, dtype=dtype,
                                  device=device).totals[0].bound == "memory"
        assert recs.min_math_bound_batch_aligned % recs.batch_multiple == 0
        assert recs.min_math_bound_batch_aligned * seq % device.multiple(dtype) == 0
