"""tilefit plan: the search space, the affine sweep model, ranking, the offload and sharding
models, configs, real plans of tiny models, and the command's bad-input handling."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tilefit.errors import TilefitError
from tilefit.estimator import offload as off
from tilefit.planner import PlanSearch
from tilefit.planner.affine import Line, SweepModel
from tilefit.planner.checks import check_fraction
from tilefit.planner.configs import deepspeed_offload, hf_training_arguments, single_gpu_configs
from tilefit.planner.multigpu import per_gpu_bytes, smallest_setup
from tilefit.planner.rank import choose, prune_unfriendly, rank
from tilefit.planner.rows import PlanRow
from tilefit.planner.run import budget_of
from tilefit.planner.sample import Sample
from tilefit.planner.space import check_global_batch, micro_batch_candidates, precisions
from tilefit.recipe import Recipe

GIB = 2**30


# ---- search space ------------------------------------------------------------------------
def test_micro_batches_divide_the_global_batch() -> None:
    # 32 = 2^5: every divisor is a power of two
    assert micro_batch_candidates(32) == ([1, 2, 4, 8, 16, 32], [])
    # 24: divisors 1 2 3 4 6 8 12 24; friendly = powers of two or multiples of 8
    assert micro_batch_candidates(24) == ([1, 2, 4, 8, 24], [3, 6, 12])


@pytest.mark.parametrize("bad", [0, -4, 1.5, True])
def test_global_batch_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(TilefitError, match="whole number"):
        check_global_batch(bad)  # type: ignore[arg-type]


def test_prime_global_batch_offers_the_nearest_splittable_ones() -> None:
    # 31 is prime; below it 30 (2x3x5), 29, 28 (=4x7) have no friendly divisor >= 8: 24 (8x3)
    # is the nearest below; 32 above.
    with pytest.raises(TilefitError) as err:
        check_global_batch(31)
    assert "prime" in err.value.problem and "24 or 32" in str(err.value)
    check_global_batch(2)
    check_global_batch(1)


def test_precisions_follow_the_part() -> None:
    from tilefit.hardware import get_device

    assert precisions(get_device("v100-sxm2-16gb")) == ["fp16-mixed", "fp32"]  # no bf16/tf32
    assert precisions(get_device("t4"))[0] == "fp16-mixed"
    assert precisions(get_device("a100-80gb")) == ["bf16-mixed", "tf32"]


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, 2])
def test_memory_fraction_outside_0_1(bad: float) -> None:
    with pytest.raises(TilefitError, match=r"\(0, 1\]"):
        check_fraction(bad)
    check_fraction(1.0)


def test_budget_is_fraction_of_memory_minus_overhead() -> None:
    from tilefit.hardware import get_device

    dev = get_device("rtx-4090")
    budget, over = budget_of(dev, 0.9)
    # 24 GiB x 0.9 = 23,192,823,398 B; overhead 512 MiB + 32 MiB? no: sm89 < sm90 -> 8 MiB
    # + 128 KiB workspace: 536,870,912 + 8,519,680 = 545,390,592 B
    assert over == 545_390_592
    assert budget == int(24 * GIB * 0.9) - 545_390_592


# ---- affine sweep model ------------------------------------------------------------------
def _sample(b: float, layers: float, f: float) -> Sample:
    return Sample(b, layers, f, f, f, f, f, f, f, f, f, f, f)


def test_line_through_two_points() -> None:
    line = Line.through(2, 10, 6, 30)  # slope (30 - 10) / 4 = 5, intercept 10 - 10 = 0
    assert (line.slope, line.intercept, line(8)) == (5, 0, 40)


def test_bilinear_sweep_is_exact_on_a_bilinear_figure() -> None:
    def f(b: float, layers: float) -> float:
        return 100 + 10 * b + 1000 * layers + 5 * b * layers

    model = SweepModel(tuple(_sample(b, k, f(b, k)) for k in (1, 2) for b in (1, 32)))
    # f(8, 32) = 100 + 80 + 32000 + 1280 = 33460
    assert model.predict("peak_bytes", 8, 32) == pytest.approx(33460)
    # without the layer count: the deepest traced (2): 100 + 80 + 2000 + 80 = 2260
    assert model.predict("micro_time_s", 8) == pytest.approx(2260)


def test_chord_bounds_a_convex_peak_from_above() -> None:
    # peak = max(9, 8 + 0.5 b): the optimizer-step peak at small b, activations at large b
    def peak(b: float) -> float:
        return max(9.0, 8 + 0.5 * b)

    model = SweepModel((_sample(1, 1, peak(1)), _sample(32, 1, peak(32))))
    for b in (1, 2, 4, 8, 16, 32):
        assert model.predict("peak_bytes", b) >= peak(b) - 1e-9


def test_the_reserved_excess_is_carried_to_full_depth_in_bytes() -> None:
    """Adapters on a frozen base traced at 1 and 2 layers: the allocator's bytes beyond the
    tensors' peak are those of the deepest traced depth, linear in the micro-batch (they come
    from the blocks' sizes); a share of the peak would grow with every extrapolated layer.
    Otherwise the share is kept (along the sweep, held inside the measured ones)."""
    from dataclasses import replace

    from tilefit.planner.search import deepest_excess, reserved_of

    def sample(b: int, layers: int, ratio: float) -> Sample:
        return replace(_sample(b, layers, 100.0 * b * layers), fragmentation_ratio=ratio)

    # excess at 2 layers: micro-batch 1: 0.25 x 200 = 50 B; micro-batch 5: 0.1 x 1000 = 100 B
    model = SweepModel((sample(1, 1, 0.5), sample(5, 1, 0.5), sample(1, 2, 0.25),
                        sample(5, 2, 0.1)))
    assert deepest_excess(model, 3) == pytest.approx(75)  # halfway: (50 + 100) / 2
    assert reserved_of(model, {}, 10_000, 3, in_bytes=True) == 10_075
    assert deepest_excess(model, 9) == pytest.approx(100)  # held inside what was measured
    # one depth: the share, clamped to the traced shares (0.1 to 0.25)
    flat = SweepModel((sample(1, 2, 0.25), sample(5, 2, 0.1)))
    assert reserved_of(flat, {"fragmentation_ratio": 0.9}, 1000, 3) == 1250
    assert reserved_of(flat, {"fragmentation_ratio": 0.2}, 1000, 3) == 1200


def test_peak_pieces_are_extrapolated_separately() -> None:
    """At 1-2 layers backward holds the peak; at 32 layers the optimizer step (16 B/param of
    model state) does. Extrapolating the max itself would miss it."""
    from tilefit.hardware import get_device
    from tilefit.planner.search import Depth, row_from
    from tilefit.recipe import Recipe

    def sample(b: int, layers: int) -> Sample:
        return Sample(micro_batch=b, layers=layers, peak_bytes=10 + 5 * layers,
                      peak_accumulation_1_bytes=10 + 5 * layers,
                      peak_optimizer_bytes=4 + 8 * layers, micro_time_s=1.0, fixed_time_s=0.0,
                      parameters_bytes=0, gradients_bytes=0, optimizer_state_bytes=0,
                      work_peak_bytes=0, micro_flops=1.0, param_count=1.0)

    model = SweepModel(tuple(sample(b, k) for k in (1, 2) for b in (1, 4)))
    row = row_from(Recipe(precision="bf16-mixed", optimizer="adamw", attention="sdpa"), model, 2, 4,
                   Depth("num_hidden_layers", 32, (1, 2)), get_device("a100-80gb"), 10**12,
                   None, "adamw")
    # backward piece: 10 + 5 x 32 = 170; optimizer piece: 4 + 8 x 32 = 260 (the max of the
    # traced peaks, 15 and 20, extrapolates to 15 + 5 x 31 = 170 and would miss it)
    assert row.predicted_peak_memory_bytes == 260


def test_micro_time_takes_the_longer_side_at_each_depth() -> None:
    """A shallow step host-bound, the deep one GPU-bound: the host adds 0.5 ms a layer over a
    3 ms floor, the GPU 1 ms a layer over 1 ms. Extrapolating their maximum (3.5 ms at one
    layer, 4 at two) would give 3.5 + 0.5 x 31 = 19 ms at 32 layers; each side extrapolated,
    the GPU's 1 + 32 = 33 ms is the longer."""
    def sample(layers: int) -> Sample:
        device, host = 1.0 + layers, 3.0 + 0.5 * layers
        return dataclasses.replace(_sample(1, layers, 0.0), micro_time_s=max(device, host),
                                   micro_device_s=device, micro_host_s=host)

    model = SweepModel((sample(1), sample(2)))
    assert model.predict("micro_time_s", 1, 1) == pytest.approx(3.5)
    assert model.predict("micro_time_s", 1, 32) == pytest.approx(33.0)
    # samples without the split (a caller's own) keep extrapolating micro_time_s itself
    plain = SweepModel((_sample(1, 1, 3.5), _sample(1, 2, 4.0)))
    assert plain.predict("micro_time_s", 1, 32) == pytest.approx(19.0)


def _with_micro(row: PlanRow, micro: int) -> PlanRow:
    """The row at another (unfriendly) micro-batch, its figures unchanged."""
    return dataclasses.replace(row, recipe=row.recipe.with_batch(micro), friendly=False)


# ---- ranking -----------------------------------------------------------------------------
def _row(micro: int, peak_gib: float, step_s: float, budget_gib: float = 20, **kw: object
         ) -> PlanRow:
    g = 32
    recipe = Recipe(batch_size=micro, accumulation_steps=g // micro,
                    precision=str(kw.pop("precision", "bf16-mixed")),
                    optimizer=str(kw.pop("optimizer", "adamw")),
                    grad_checkpointing=bool(kw.pop("ckpt", False)), attention="sdpa",
                    lora=bool(kw.pop("peft", False)))
    return PlanRow(recipe=recipe,
                   predicted_peak_memory_bytes=int(peak_gib * GIB), predicted_step_time_s=step_s,
                   samples_per_s=g / step_s, tokens_per_s=None, mfu=0.0,
                   budget_bytes=int(budget_gib * GIB), **kw)  # type: ignore[arg-type]


def test_best_is_the_fastest_that_fits() -> None:
    rows = [_row(32, 30, 0.8), _row(16, 18, 0.9), _row(8, 10, 1.0), _row(4, 6, 1.2)]
    best = choose(rows, "throughput", False)
    assert best is not None and best.micro_batch == 16  # 32 is faster but needs 30 > 20 GiB
    assert all(r.global_batch == 32 for r in rows)
    ranked = rank(rows, "throughput", False)
    assert [r.micro_batch for r in ranked] == [16, 8, 4, 32]


def test_memory_objective_takes_the_smallest() -> None:
    rows = [_row(16, 18, 0.9), _row(8, 10, 1.0), _row(4, 6, 1.2)]
    assert choose(rows, "memory", False).micro_batch == 4  # type: ignore[union-attr]
    # within 1% of the 20 GiB budget (0.2 GiB) the faster one wins the tie
    near = _row(4, 6.1, 1.0, ckpt=True)
    assert choose([*rows, near], "memory", False) is near


def test_optimizer_change_only_when_allowed_or_nothing_else_fits() -> None:
    keep = _row(8, 19, 2.0)
    change = _row(16, 12, 1.0, optimizer="adafactor", changes_optimizer=True)
    assert choose([keep, change], "throughput", False) is keep
    assert choose([keep, change], "throughput", True) is change
    too_big = _row(8, 25, 2.0)
    assert choose([too_big, change], "throughput", False) is change


def test_offload_only_when_no_gpu_plan_fits() -> None:
    gpu = _row(8, 19, 2.0)
    offloaded = _row(16, 12, 1.5, offload=True)
    assert choose([gpu, offloaded], "throughput", False) is gpu
    assert choose([_row(8, 25, 2.0), offloaded], "throughput", False) is offloaded
    assert choose([_row(8, 25, 2.0)], "throughput", False) is None


def test_unfriendly_micro_batch_kept_only_for_a_real_gain() -> None:
    friendly = _row(8, 10, 1.0)
    small_gain = _with_micro(_row(8, 10, 0.97), 12)
    big_gain = _with_micro(_row(8, 10, 0.8), 12)
    assert prune_unfriendly([friendly, small_gain]) == [friendly]  # 3% faster < 5%
    assert prune_unfriendly([friendly, big_gain]) == [friendly, big_gain]  # 25% faster


# ---- offload and sharding models ---------------------------------------------------------
def test_offload_model_hand_arithmetic() -> None:
    link = off.OffloadLink()
    # 7e9 params: PCIe 7e9 x 4 B / 25e9 B/s = 1.12 s; CPU Adam 7e9 x 30 B / 50e9 B/s = 4.2 s
    assert off.offload_step_time_s(0.5, 16, 7e9, link) == pytest.approx(8 + 1.12 + 4.2)
    # GPU: 14e9 B of bf16 weights + bucket 5e8 x 2 B + 3e9 B working set
    assert off.offload_peak_bytes(14e9, 3e9, 7e9) == pytest.approx(14e9 + 1e9 + 3e9)


def test_zero3_per_gpu_memory() -> None:
    # 7B AdamW mixed precision: 16 B/param = 112e9 B of state; / 8 GPUs = 14e9;
    # + 3e9 working set + 2 gathered layers of 14e9 / 32 = 0.875e9
    assert per_gpu_bytes(112e9, 3e9, 14e9, 32, 8) == pytest.approx(14e9 + 3e9 + 0.875e9)
    cands = [(1, 112e9, 14e9, 2e9, 0.1), (2, 112e9, 14e9, 4e9, 0.2)]
    setup = smallest_setup(32, cands, 32, 21e9)
    # N=4: 28e9 > 21e9; N=8 (32 % 8 == 0): micro 2 -> 14 + 4 + 0.875 = 18.875e9 fits
    assert setup is not None and (setup.gpus, setup.micro_batch, setup.accumulation_steps) == \
        (8, 2, 2)


def test_configs_follow_the_row() -> None:
    row = _row(8, 10, 1.0, ckpt=True)
    hf = hf_training_arguments(row)
    assert (hf["per_device_train_batch_size"], hf["gradient_accumulation_steps"]) == (8, 4)
    assert hf["bf16"] and hf["gradient_checkpointing"] and "deepspeed" not in hf
    assert "deepspeed" not in single_gpu_configs(row, "causal-lm")
    offloaded = _row(2, 10, 1.0, offload=True, precision="bf16-true")
    ds = deepspeed_offload(offloaded)
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 16
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "deepspeed" in single_gpu_configs(offloaded, "causal-lm")


# ---- real plans of tiny models -----------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_trace_per_step():  # type: ignore[no-untyped-def]
    """The plans below search many of the same steps (model, recipe, GPU); a trace depends on
    nothing else, so each is traced once for the file (tilefit.tracing.workload_traces)."""
    from tilefit.tracing.workload_traces import shared_traces

    with shared_traces():
        yield


@pytest.fixture(scope="module")
def tiny_gpt2_config(tmp_path_factory):  # type: ignore[no-untyped-def]
    """GPT-2 with one layer as a config.json: what the plans below and the CLI read."""
    from tilefit.models import catalog

    config = dict(catalog.catalog_entry("gpt2"))
    config["n_layer"] = 1
    path = tmp_path_factory.mktemp("gpt2-1-layer") / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny_gpt2(tiny_gpt2_config):  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.models import load_workload

    return load_workload(str(tiny_gpt2_config), seq_len=32)


@pytest.fixture(scope="module")
def a100_plan(tiny_gpt2):  # type: ignore[no-untyped-def]
    from tilefit.planner import plan

    return plan(tiny_gpt2, gpu="a100-80gb", global_batch=16)


def test_real_plan_keeps_the_global_batch_and_picks_the_fastest_fit(a100_plan) -> None:
    p = a100_plan
    assert p.rows and all(r.micro_batch * r.accumulation_steps == 16 for r in p.rows)
    assert p.best is not None and p.best.fits
    eligible = [r for r in p.rows if r.fits and not r.offload and not r.changes_optimizer]
    fastest = max(eligible, key=lambda r: r.samples_per_s)
    assert (p.best.micro_batch, p.best.precision, p.best.grad_checkpointing) == \
        (fastest.micro_batch, fastest.precision, fastest.grad_checkpointing)
    # the confirm trace agrees with the affine sweep (traced at 1 and 16) within 10%
    c = p.confirmation
    assert c is not None and abs(c.peak_error) < 0.10 and abs(c.time_error) < 0.10
    assert p.multi_gpu is None
    d = p.to_dict()
    assert set(d["best"]) >= {"micro_batch", "accumulation_steps", "precision", "optimizer",
                              "grad_checkpointing", "attention", "peft", "offload",
                              "predicted_peak_memory_bytes", "predicted_step_time_s",
                              "samples_per_s", "fits"}
    assert d["configs"]["hf_training_arguments"]["per_device_train_batch_size"] == \
        p.best.micro_batch
    json.dumps(d)


def test_plan_judges_the_chosen_row_by_the_allocators_reserved_memory(a100_plan,
                                                                        tiny_gpt2) -> None:
    """The chosen row's memory is the caching allocator's reserved peak of its full trace:
    what estimating the row's own recipe directly replays (a second path), to the byte up
    to rounding; the budget is the device's memory less context and workspace (no fixed
    fragmentation margin: the replay is the margin)."""
    from tilefit.estimator.workload_estimate import estimate_workload

    best = a100_plan.best
    direct = estimate_workload(tiny_gpt2, best.recipe, "a100-80gb")
    assert direct.reserved is not None
    assert best.predicted_peak_memory_bytes == direct.peak_memory_bytes
    assert best.predicted_reserved_bytes == pytest.approx(direct.peak_reserved_bytes, abs=2)
    # the confirmation says how far the sweep's reserved peak was from the replay's
    check = a100_plan.confirmation
    assert check.traced_reserved_bytes == best.predicted_reserved_bytes
    assert check.reserved_error == pytest.approx(
        check.affine_reserved_bytes / check.traced_reserved_bytes - 1)
    assert best.predicted_reserved_bytes >= best.predicted_peak_memory_bytes
    assert best.memory_bytes == best.predicted_reserved_bytes
    assert a100_plan.budget_bytes == budget_of(a100_plan.device, 1.0)[0]
    assert a100_plan.to_dict()["best"]["predicted_reserved_bytes"] == \
        best.predicted_reserved_bytes


def test_a_row_fits_by_its_reserved_memory_where_modelled() -> None:
    gib = 2**30
    row = PlanRow(recipe=Recipe(batch_size=8), predicted_peak_memory_bytes=10 * gib,
                  predicted_step_time_s=1.0, samples_per_s=8.0, tokens_per_s=None, mfu=0.5,
                  budget_bytes=int(10.5 * gib), predicted_reserved_bytes=11 * gib)
    assert not row.fits and row.headroom_bytes == int(10.5 * gib) - 11 * gib
    offload = dataclasses.replace(row, predicted_reserved_bytes=None)
    assert offload.fits and offload.headroom_bytes == gib // 2


def test_tiny_gpu_falls_back_to_offload_then_sharding(tiny_gpt2, a100_plan) -> None:
    from tilefit.hardware import get_device
    from tilefit.planner import plan

    a100 = get_device("a100-80gb")
    base_min = min(r.memory_bytes for r in a100_plan.rows)
    # a made-up GPU whose budget (memory - overhead) is 60% of the smallest GPU plan
    over = budget_of(a100, 1.0)[1]
    tiny = dataclasses.replace(a100, memory_bytes=int(0.6 * base_min + over))
    # no recipe: Recipe.for_model, the HF Trainer's loop (fused AdamW, clipping), as the CLI plans
    p = plan(tiny_gpt2, gpu=tiny, global_batch=16)
    keeps = [r for r in p.rows if not r.offload and not r.changes_optimizer]
    assert keeps and not any(r.fits for r in keeps)  # never claims AdamW on the GPU fits
    assert p.best is not None and p.best.fits and p.best.offload
    assert p.configs["deepspeed"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    m = p.multi_gpu
    assert m is not None and m.gpus is not None and m.gpus >= 2 and m.best is not None
    assert m.best.memory_bytes <= p.budget_bytes
    # the fallback is traced: its confirmed figures are those of estimating the chosen setup
    # directly (a second call, the same engine under the fake process group)
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.recipe import Parallelism
    from tilefit.vocab import STRATEGIES

    best = m.best
    assert best.strategy in STRATEGIES and m.formula_gpus is not None
    assert m.gpus >= m.formula_gpus and best.world_size == m.gpus
    assert best.micro_batch * best.accumulation_steps * m.gpus == 16
    # the row's own recipe (the Trainer's loop the plan kept: clipping, the loss read) on
    # the row's GPUs and engine
    direct = estimate_workload(tiny_gpt2, dataclasses.replace(
        best.recipe, parallel=Parallelism(m.gpus, best.strategy)), tiny)
    assert best.predicted_peak_memory_bytes == direct.peak_memory_bytes
    assert best.predicted_step_time_s == pytest.approx(direct.step_time_s)
    assert "torchrun_script" in m.configs
    # --json: the same figures under the keys the dict always had
    d = p.to_dict()["multi_gpu"]
    assert (d["gpus"], d["engine"], d["formula_gpus"]) == (m.gpus, best.strategy,
                                                          m.formula_gpus)
    assert d["predicted_per_gpu_memory_bytes"] == direct.peak_memory_bytes
    assert d["micro_batch"] * d["accumulation_steps"] * d["gpus"] == 16
    assert d["recipe"] == {"precision": best.precision, "optimizer": "adamw-fused",
                           "grad_checkpointing": best.grad_checkpointing,
                           "attention": best.attention}
    assert d["confirmation"]["traced_peak_bytes"] == direct.peak_memory_bytes
    assert d["model"].startswith(("traced: rank 0 of", "modelled: DeepSpeed"))
    assert len(d["plans"]) == len(m.plans) <= 8 and "torchrun_script" in d["configs"]


def test_layer_lever_matches_the_full_trace() -> None:
    """A 6-layer model traced at 1 and 2 layers (micro-batches 1 and 8) and extrapolated to
    6 layers at micro-batch 4 agrees with the full 6-layer trace at micro-batch 4."""
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.planner.search import Depth, depth_of, sweep, trace_sample
    from tilefit.recipe import Recipe

    work = load_workload("llama-3.2-1b", seq_len=64).with_config(
        num_hidden_layers=6, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=4096)
    depth = depth_of(work)
    assert depth.lever and depth.traced == (1, 2) and depth.full == 6
    dev = get_device("a100-80gb")
    spec = Recipe(precision="bf16-mixed", optimizer="adamw", attention="sdpa")
    model = sweep(work, spec, [1, 8], depth, dev)
    full = trace_sample(work, spec, 4, 6, Depth(None, 6, (6,)), dev, 2)
    for metric in ("peak_bytes", "peak_optimizer_bytes", "micro_time_s", "param_count",
                   "micro_flops"):
        predicted = model.predict(metric, 4, 6)
        assert predicted == pytest.approx(full.metrics()[metric], rel=0.10), metric
    # parameters and FLOPs are exactly affine in depth (identical blocks)
    assert model.predict("param_count", 4, 6) == pytest.approx(full.param_count, rel=1e-9)


def test_lora_freezes_the_base_weights(tiny_gpt2) -> None:
    from tilefit.planner import plan

    p = plan(tiny_gpt2, gpu="a100-80gb", global_batch=8,
             search=PlanSearch(confirm=False, allow_lora=True))
    lora = {r.micro_batch: r for r in p.rows if r.peft and not r.grad_checkpointing}
    full = {r.micro_batch: r for r in p.rows if not r.peft and not r.grad_checkpointing
            and r.precision == "bf16-mixed" and r.attention == "sdpa"}
    assert set(lora) == set(full) == {1, 2, 4, 8}
    # 1-layer GPT-2: ~46.6 M parameters (wte 50257 x 768 = 38.6 M, wpe 0.8 M, one block
    # 7.1 M). Frozen, they have no fp32 gradient (4 B) and no AdamW moments (8 B): the LoRA
    # plan needs at least 8 B/param less at every micro-batch (12 B minus slack for the
    # adapters and a different peak point).
    for b in lora:
        saved = full[b].predicted_peak_memory_bytes - lora[b].predicted_peak_memory_bytes
        assert saved > 8 * 46e6, (b, saved)
    assert all("LoRA" in r.changes[0] for r in lora.values())


# ---- the command -------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "needle"), [
    (["--memory-fraction", "0"], "(0, 1]"),
    (["--memory-fraction", "1.5"], "(0, 1]"),
    (["--global-batch", "31"], "24 or 32"),
])
def test_cli_bad_input_exits_2(args: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    base = ["plan", "gpt2", "--gpu", "rtx-4090"]
    if "--global-batch" not in args:
        base += ["--global-batch", "32"]
    r = CliRunner().invoke(app, [*base, *args])
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.output.split())
    assert r.exception is None or isinstance(r.exception, SystemExit)  # no traceback


def test_cli_json(tiny_gpt2_config, a100_plan) -> None:  # type: ignore[no-untyped-def]
    # the step a100_plan planned, from the command line: its traces are the file's
    # (one_trace_per_step), and the command chooses what the function chose
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    r = CliRunner().invoke(app, ["plan", str(tiny_gpt2_config), "--gpu", "a100-80gb",
                                 "--global-batch", "16", "--seq", "32", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["gpu"] == "a100-80gb" and d["global_batch"] == 16
    assert all(p["micro_batch"] * p["accumulation_steps"] == 16 for p in d["plans"])
    assert d["best"]["fits"] and "hf_training_arguments" in d["configs"]
    assert "lightning" in d["configs"]
    assert d["best"] == a100_plan.to_dict()["best"]


def test_cli_text_prints_each_block_whole_and_writes_one_gpu_files(  # type: ignore[no-untyped-def]
        tiny_gpt2_config, a100_plan, tmp_path) -> None:
    # the same plan as text, to CliRunner's stream (no terminal, 80 columns, as a pipe):
    # every config block printed as it is (never wrapped) and parseable; --write-configs
    # writes a one-GPU plan's files (the same step: traces shared by the file)
    from tests.test_copyable_output import parses
    from typer.testing import CliRunner

    from tilefit.cli.app import app
    from tilefit.report.plan import config_sections

    out = tmp_path / "cfg"
    r = CliRunner().invoke(app, ["plan", str(tiny_gpt2_config), "--gpu", "a100-80gb",
                                 "--global-batch", "16", "--seq", "32",
                                 "--write-configs", str(out)])
    assert r.exit_code == 0, r.output
    for name, _, text in config_sections(a100_plan.configs):
        assert text in r.stdout, name
        parses(name, text)
    assert sorted(p.name for p in out.iterdir()) == [
        "train_hf.py", "train_lightning.py", "train_pytorch.py", "training_args.json"]
    for path in out.iterdir():
        parses(path.name, path.read_text())
        assert path.read_text() == a100_plan.configs["files"][path.name]
        assert f"wrote {path}" in " ".join(r.stdout.split())


def test_plan_searches_the_same_math_knobs(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    # foreach AdamW: its fused kernel is the same update (no algorithm change); a causal LM
    # also gets the fused linear cross-entropy loss; both are labelled in the rows' changes
    from tilefit.planner import plan
    from tilefit.planner.configs import hf_training_arguments

    # global batch 1: each recipe traced at its one micro-batch (the knobs do not depend on it)
    p = plan(tiny_gpt2, gpu="a100-80gb", global_batch=1, recipe=Recipe(optimizer="adamw"),
             search=PlanSearch(confirm=False))
    fused_opt = [r for r in p.rows if r.optimizer == "adamw-fused"]
    assert fused_opt and all(r.fuses_optimizer and not r.changes_optimizer for r in fused_opt)
    assert any("same update in one kernel" in c for c in fused_opt[0].changes)
    fce = [r for r in p.rows if r.recipe.fused_ce]
    assert fce and any("fused linear cross-entropy" in c for c in fce[0].changes)
    args = hf_training_arguments(fce[0])
    assert args["use_liger_kernel"] is True
    assert args["liger_kernel_config"]["fused_linear_cross_entropy"] is True
    assert args["liger_kernel_config"]["rms_norm"] is False


def test_a_compiled_recipe_is_planned_and_keeps_the_math(a100_plan) -> None:  # type: ignore[no-untyped-def]
    p = a100_plan
    compiled = [r for r in p.rows if r.recipe.compile]
    assert compiled and not any(r.grad_checkpointing for r in compiled)
    assert all(not r.changes_optimizer for r in compiled)
    assert any("torch.compile" in c for c in compiled[0].changes)


def test_the_users_compile_flag_plans_each_recipe_once(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    # --compile turns the base recipe into the same-math compile recipe: one sweep, one row
    # per micro-batch, and the checkpointed recipes are compiled too (predicted now)
    from tilefit.planner import plan

    p = plan(tiny_gpt2, gpu="a100-80gb", global_batch=16, recipe=Recipe(compile=True),
             search=PlanSearch(confirm=False))
    keys = [(r.recipe, r.offload, r.strategy) for r in p.rows]
    assert len(keys) == len(set(keys))
    assert all(r.recipe.compile for r in p.rows)
    assert any(r.grad_checkpointing for r in p.rows)


def test_a_compiled_row_compiles_once_in_each_config() -> None:
    # the estimate this row came from ran the step as torch.compile runs it: every pasted
    # config must compile too, exactly once (HF: the Trainer's torch_compile; a plain loop and
    # Lightning: torch.compile after any float8 conversion)
    from dataclasses import replace

    from tilefit.planner.configs import hf_python, lightning, torch_loop

    row = _row(8, 10, 1.0)
    assert "torch_compile" not in hf_training_arguments(row)
    assert "torch.compile" not in torch_loop(row) and "before_fit" not in lightning(row)["model"]
    compiled = replace(row, recipe=replace(row.recipe, compile=True))
    assert hf_training_arguments(compiled)["torch_compile"] is True
    assert torch_loop(compiled).count("model = torch.compile(model)") == 1
    assert "torch.compile(" not in hf_python(compiled)  # the Trainer compiles, not the paste
    assert lightning(compiled)["model"]["before_fit"] == ["model = torch.compile(model)"]
    fp8 = replace(row, recipe=replace(row.recipe, precision="fp8-mixed", compile=True))
    loop = torch_loop(fp8)
    assert loop.index("convert_to_float8_training(") < loop.index("torch.compile(model)")
    assert hf_python(fp8).count("convert_to_float8_training(") == 1


# ---- the model-state cut (planner.search.sweep, planner.state.PlanState.add) --------------
def _state_by_hand(workload) -> int:  # type: ignore[no-untyped-def]
    """fp32 weights, fp32 gradients and AdamW's two fp32 moments, each tensor rounded up to
    the caching allocator's 512 bytes, plus the fused AdamW's one-element fp32 step tensor
    per parameter (one 512-byte block each)."""
    import torch

    with torch.device("meta"):
        params = list(workload.build(attention="auto").parameters())
    return sum(4 * (-(-p.numel() * 4 // 512) * 512) + 512 for p in params)


def test_the_state_bound_is_the_models_state_by_hand(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    from tilefit.hardware import get_device
    from tilefit.planner.search import Depth, state_over, sweep

    spec = Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="sdpa")
    model = sweep(tiny_gpt2, spec, [1, 8], Depth(None, 1, (1,)), get_device("a100-80gb"))
    hand = _state_by_hand(tiny_gpt2)
    assert state_over(model, Depth(None, 1, (1,)), hand - 1) == hand
    assert state_over(model, Depth(None, 1, (1,)), hand) is None  # not over: equal


def test_a_plan_stops_where_the_state_is_over_and_loses_no_fitting_row(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    from tilefit.hardware import get_device
    from tilefit.planner import plan
    from tilefit.planner.search import Depth, row_from, sweep

    a100 = get_device("a100-80gb")
    state = _state_by_hand(tiny_gpt2)
    over = budget_of(a100, 1.0)[1]
    tiny = dataclasses.replace(a100, memory_bytes=int(0.8 * state) + over)
    budget = budget_of(tiny, 1.0)[0]
    p = plan(tiny_gpt2, gpu=tiny, global_batch=8, search=PlanSearch(memory_fraction=1.0))
    assert p.best is not None and p.best.fits and p.best.offload
    # the user's AdamW in fp32 weights: one recipe traced, at its smallest micro-batch only
    kept = [r for r in p.rows if not r.offload and r.optimizer == "adamw-fused"]
    assert {r.micro_batch for r in kept} == {1} and len(kept) == 1
    note = next(n for n in p.notes if n.startswith("model state alone over"))
    assert f"fp32 weights, adamw-fused: {state / 2**30:.1f} GiB" in note
    untraced = [Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="sdpa",
                       grad_checkpointing=True),
                Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="eager"),
                Recipe(precision="tf32", optimizer="adamw-fused", attention="sdpa")]
    # ... and the fused loss (with and without checkpointing) and torch.compile: the same state
    assert f"{len(untraced) + 3} more that keep the same state were not traced" in note
    # a second method: the recipes left out, swept in full, fit at no micro-batch
    for spec in untraced:
        model = sweep(tiny_gpt2, spec, [1, 8], Depth(None, 1, (1,)), tiny)
        for b in (1, 2, 4, 8):
            row = row_from(spec, model, b, 8, Depth(None, 1, (1,)), tiny, budget, 32,
                           "adamw-fused")
            assert not row.fits and row.memory_bytes > state
