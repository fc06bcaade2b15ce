"""A linear layer's three training GEMMs, totals and batch recommendations."""

from __future__ import annotations

import pytest

from tilefit.errors import TilefitError
from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device
from tilefit.linear import PHASES, analyze_linear, plot_batches

A100_40 = get_device("a100-40gb")


def test_phase_shapes_follow_the_guide() -> None:
    # FC-layer guide, Table 1: forward T x out (K=in), dgrad T x in (K=out), wgrad out x in (K=T)
    a = analyze_linear(1024, 4096, [3], seq=5, dtype="fp16", device=A100_40)
    shapes = {r.phase: (r.gemm.m, r.gemm.n, r.gemm.k) for r in a.rows}
    assert shapes == {
        "forward": (15, 4096, 1024),  # T = 3*5 = 15
        "activation_grad": (15, 1024, 4096),
        "weight_grad": (4096, 1024, 15),
    }
    assert [r.phase for r in a.rows] == list(PHASES)
    assert all(r.tokens == 15 and r.batch == 3 for r in a.rows)


def test_rows_are_analyze_gemm_results() -> None:
    a = analyze_linear(4096, 1024, [256], dtype="bf16", device=get_device("h100"))
    fwd = a.rows[0].gemm
    assert fwd == analyze_gemm(256, 1024, 4096, "bf16", get_device("h100-sxm"))


def test_totals_are_sums_of_the_phases() -> None:
    a = analyze_linear(4096, 4096, [8, 128, 512], dtype="fp16", device=A100_40)
    for total in a.totals:
        rows = a.rows_for(total.batch)
        assert len(rows) == 3
        assert total.flops == 3 * 2 * total.tokens * 4096 * 4096  # 3 GEMMs of 2*T*in*out
        assert total.predicted_time_s == pytest.approx(sum(r.gemm.predicted_time_s for r in rows))
        assert total.predicted_tflops == pytest.approx(
            total.flops / total.predicted_time_s / 1e12)


def test_fc_4096_recommendations_on_a100() -> None:
    a = analyze_linear(4096, 4096, [8, 64, 128, 256, 512], dtype="fp16", device=A100_40)
    bounds = {t.batch: t.bound for t in a.totals}
    assert bounds == {8: "memory", 64: "memory", 128: "memory", 256: "math", 512: "math"}
    recs = a.recommendations
    # The three GEMMs share intensity 1 / (1/T + 1/2048) (fp16, in = out = 4096); math-bound
    # when >= 312e12/1555e9 = 200.643: 1/T <= 1/200.643 - 1/2048 = 0.0044957 -> T >= 222.4
    assert recs.min_math_bound_batch == 223
    assert recs.min_math_bound_batch_aligned == 256  # 223 rounded up to a multiple of 64
    assert recs.min_math_bound_batch_pow2 == 256
    assert recs.token_multiple == 64 and recs.batch_multiple == 64  # 128 B / 2 B, seq 1
    assert recs.aligned_batches == (64, 128, 256, 512)
    assert recs.misaligned_batches == (8,)
    # limit of the intensity as T grows: 2 / (2 * (1/4096 + 1/4096)) = 2048
    assert recs.max_intensity == pytest.approx(2048)
    assert recs.search_max_batch == 2**20
    assert any("223" in n for n in recs.notes)


def test_min_batch_with_sequence_length() -> None:
    # seq 100: T must be >= 223 -> batch 3 (300 tokens) is the first; T = 100 b is a multiple
    # of 64 when b is a multiple of 64 / gcd(64, 100) = 16
    a = analyze_linear(4096, 4096, [1, 16], seq=100, dtype="fp16", device=A100_40)
    recs = a.recommendations
    assert recs.min_math_bound_batch == 3
    assert recs.batch_multiple == 16
    assert recs.min_math_bound_batch_aligned == 16
    assert recs.aligned_batches == (16,)
    assert recs.search_max_batch == 2**20 // 100


def test_narrow_layer_is_never_math_bound() -> None:
    # 64 -> 64 fp16: intensity < 2 / (2 * (1/64 + 1/64)) = 32 < 200.6 for every batch
    a = analyze_linear(64, 64, [1024], dtype="fp16", device=A100_40)
    recs = a.recommendations
    assert recs.min_math_bound_batch is None
    assert recs.min_math_bound_batch_aligned is None
    assert recs.max_intensity == pytest.approx(32)
    assert "larger batch does not" in recs.notes[0]


def test_search_agrees_with_brute_force_on_a_small_range() -> None:
    # second method: scan every batch and take the first with all three math-bound
    dev = get_device("t4")
    a = analyze_linear(1000, 3000, [1], dtype="fp16", device=dev)
    first = next(b for b in range(1, 2000)
                 if all(analyze_gemm(m, n, k, "fp16", dev).bound == "math"
                        for m, n, k in ((b, 3000, 1000), (b, 1000, 3000), (3000, 1000, b))))
    assert a.recommendations.min_math_bound_batch == first


def test_to_dict_keys() -> None:
    d = analyze_linear(4096, 1024, [64, 64, 128], dtype="fp16", device=A100_40).to_dict()
    for key in ("gpu", "dtype", "in_features", "out_features", "rows", "totals",
                "recommendations"):
        assert key in d
    assert d["batches"] == [64, 128]  # duplicates dropped
    assert len(d["rows"]) == 6
    gemm_keys = {"m", "n", "k", "flops", "bytes", "arithmetic_intensity", "ops_per_byte", "bound",
                 "alignment", "tile_efficiency", "wave_efficiency", "predicted_time_s",
                 "predicted_tflops"}
    for row in d["rows"]:
        assert {"batch", "tokens", "phase"} | gemm_keys <= set(row)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"in_features": 0}, "in_features must be a positive integer"),
        ({"out_features": -3}, "out_features must be a positive integer"),
        ({"batches": [8, 0]}, "batch must be a positive integer"),
        ({"batches": []}, "no batch size"),
        ({"seq": 1.5}, "seq must be a positive integer"),
        ({"dtype": "fp12"}, "unknown dtype"),
        ({"dtype": "fp8"}, "no fp8 math"),
    ],
)
def test_bad_input(kwargs: dict, message: str) -> None:
    args = {"in_features": 4096, "out_features": 4096, "batches": [8], "seq": 1, "dtype": "fp16"}
    args.update(kwargs)
    with pytest.raises(TilefitError, match=message):
        analyze_linear(args.pop("in_features"), args.pop("out_features"), args.pop("batches"),
                       device=A100_40, **args)


def test_plot_batches_cover_the_given_and_the_threshold() -> None:
    a = analyze_linear(4096, 4096, [8, 100], dtype="fp16", device=A100_40)
    pts = plot_batches(a)
    assert {8, 100, 223, 256, 1, 2, 4} <= set(pts)
    assert list(pts) == sorted(set(pts))
    assert max(pts) <= 2 * 256
