"""The fused-activation rule and the audit's combined prediction, each checked against a
second method: independent estimates of the model built with the fix applied, and
transformers' own activations run on this CPU.

A tiny GPT-2 (2 layers, hidden 64) keeps every trace about a second."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from tilefit import Recipe, estimate  # noqa: E402
from tilefit.advise.audit import order  # noqa: E402
from tilefit.advise.combined import combine  # noqa: E402
from tilefit.advise.findings import Change  # noqa: E402
from tilefit.advise.rules_activation import FUSED_SAME_MATH, activation_findings  # noqa: E402
from tilefit.advise.rules_batch import wave_findings  # noqa: E402
from tilefit.advise.rules_optimizer import fused_optimizer_findings  # noqa: E402
from tilefit.advise.whatif import WhatIf  # noqa: E402
from tilefit.estimator import estimate_trace  # noqa: E402
from tilefit.hardware import Device, get_device  # noqa: E402
from tilefit.models import Workload, load_workload  # noqa: E402
from tilefit.recipe import Compile  # noqa: E402
from tilefit.tracing.workload_traces import trace_workload  # noqa: E402

GPU = "a100-80gb"
FUSED = "gelu_pytorch_tanh"


def _tiny(activation: str = "gelu_new") -> Workload:
    return load_workload("gpt2", seq_len=128).with_config(
        num_hidden_layers=2, n_embd=64, n_head=2, activation_function=activation)


RECIPE = Recipe(batch_size=8)


def _whatif(work: Workload, device: Device | None = None) -> WhatIf:
    device = device or get_device(GPU)
    recipe = RECIPE.on(device)
    tr = trace_workload(work, recipe, device)
    return WhatIf(workload=work, recipe=recipe, device=device, trace=tr,
                  estimate=estimate_trace(tr, device),
                  retrace_fn=lambda wk, rc: trace_workload(wk, rc, device))


@pytest.fixture(scope="module")
def gelu_new() -> WhatIf:
    return _whatif(_tiny())


def test_swapped_activations_are_the_same_function_up_to_rounding() -> None:
    """The claim the fix makes, on transformers' own activations: fp32 outputs equal up to
    rounding on random inputs over GELU's whole working range. Each form computes
    x / 2 * (1 + tanh(...)) or (1 + erf(...)): a rounding of the bracket costs up to one
    epsilon, times |x| / 2, and a few roundings are allowed."""
    from transformers.activations import ACT2FN

    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 4
    atol = 4 * torch.finfo(torch.float32).eps * float(x.abs().max()) / 2
    for slow, fused in FUSED_SAME_MATH.items():
        torch.testing.assert_close(ACT2FN[slow](x), ACT2FN[fused](x), rtol=1.3e-6, atol=atol)
    # and a swap it must not propose: quick_gelu is another function
    assert "quick_gelu" not in FUSED_SAME_MATH
    assert (ACT2FN["quick_gelu"](x) - ACT2FN[FUSED](x)).abs().max() > 1e-2


def test_gelu_new_gets_the_fused_activation_finding(gelu_new: WhatIf) -> None:
    (f,) = activation_findings(gelu_new)
    assert (f.dimension, f.current, f.suggested) == ("activation_function", "gelu_new", FUSED)
    assert f'config.activation_function = "{FUSED}"' in f.fix
    assert "transformer.h.0.mlp.act" in f.modules and f.recommended
    # a second method: the step estimated twice through the public API, the model built
    # with each activation
    before = estimate(_tiny(), recipe=RECIPE, gpu=GPU)
    after = estimate(_tiny(FUSED), recipe=RECIPE, gpu=GPU)
    assert f.predicted_speedup == pytest.approx(before.step_time_s / after.step_time_s,
                                                rel=1e-9)
    assert f.predicted_speedup > 1.005  # fewer kernels, fewer passes over the activation


def test_no_finding_where_the_activation_is_fused_or_compiled(gelu_new: WhatIf) -> None:
    assert activation_findings(_whatif(_tiny(FUSED))) == []
    # compiled: Inductor fuses the chain already
    assert activation_findings(replace(gelu_new, recipe=replace(
        gelu_new.recipe, compile=Compile()))) == []


def test_changes_conflict_on_a_field_set_two_ways() -> None:
    batch12 = Change(recipe=(("batch_size", 12),))
    assert batch12.merged(Change(recipe=(("batch_size", 16),))) is None
    assert Change(recipe=(("compile", Compile()),)).merged(
        Change(recipe=(("compile", Compile("reduce-overhead")),))) is None
    assert Change(seq_len=128).merged(Change(seq_len=192)) is None
    both = batch12.merged(Change(config=(("activation_function", FUSED),)))
    assert both == Change(recipe=(("batch_size", 12),),
                          config=(("activation_function", FUSED),))
    assert batch12.merged(batch12) == batch12  # the same value twice agrees


def test_combined_prediction_is_one_estimate_of_all_fixes(gelu_new: WhatIf) -> None:
    findings = order([f for rule in (activation_findings, wave_findings,
                                     fused_optimizer_findings) for f in rule(gelu_new)])
    combined = combine(gelu_new, findings)
    assert combined is not None
    rules = {f.rule: f for f in findings}
    assert set(rules) == {"fused-activation", "wave-quantization", "fused-optimizer"}
    batch = rules["wave-quantization"].suggested
    assert len(combined.fixes) == 3 and combined.left_out == ()
    # a second method: the model and recipe with every fix written out by hand
    direct = estimate(_tiny(FUSED), recipe=replace(RECIPE, batch_size=batch,
                                                   optimizer="adamw-fused"), gpu=GPU)
    assert combined.step_time_after_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert combined.peak_memory_after_bytes == direct.peak_memory_bytes
    assert (combined.samples_before, combined.samples_after) == (8, batch)
    # independent fixes: together at least as fast (per sample) as the best alone
    assert combined.predicted_speedup >= max(f.predicted_speedup for f in findings)
    assert combined.to_dict()["predicted_speedup"] == combined.predicted_speedup


def test_a_conflicting_fix_gives_way_to_the_larger_gain(gelu_new: WhatIf) -> None:
    findings = order([f for rule in (activation_findings, wave_findings)
                      for f in rule(gelu_new)])
    wave = next(f for f in findings if f.rule == "wave-quantization")
    # a second batch size with a smaller gain: left out, the larger one kept
    smaller = replace(wave, suggested=16, change=Change(recipe=(("batch_size", 16),)),
                      samples_after=16, step_time_after_s=wave.step_time_before_s * 2 / 1.2)
    assert 1.005 < smaller.predicted_speedup < wave.predicted_speedup
    combined = combine(gelu_new, order([*findings, smaller]))
    assert combined is not None
    assert combined.left_out == ("batch size 8 -> 16",)
    assert combined.change.recipe == (("batch_size", wave.suggested),)


def test_under_torch_compile_the_fused_activation_is_subsumed(gelu_new: WhatIf) -> None:
    from tilefit.advise.rules_compile import compile_findings

    findings = order([f for rule in (activation_findings, compile_findings,
                                     fused_optimizer_findings) for f in rule(gelu_new)])
    assert {f.rule for f in findings if f.recommended} == {
        "fused-activation", "compile", "fused-optimizer"}
    combined = combine(gelu_new, findings)
    assert combined is not None
    assert combined.subsumed == (f"activation_function gelu_new -> {FUSED}",)
    assert combined.change == Change(recipe=(("compile", Compile()),
                                             ("optimizer", "adamw-fused")))
    assert combined.to_dict()["subsumed"] == list(combined.subsumed)
    # the claim, by two independent estimates: compiled, both activations cost the same
    compiled = replace(RECIPE, compile=Compile())
    slow = estimate(_tiny(), recipe=compiled, gpu=GPU)
    fused = estimate(_tiny(FUSED), recipe=compiled, gpu=GPU)
    assert slow.step_time_s == pytest.approx(fused.step_time_s, rel=1e-9)
    assert slow.peak_memory_bytes == fused.peak_memory_bytes
    # and the combined step is the compiled step with the fused optimizer, written out
    direct = estimate(_tiny(), recipe=replace(compiled, optimizer="adamw-fused"), gpu=GPU)
    assert combined.step_time_after_s == pytest.approx(direct.step_time_s, rel=1e-9)


def test_a_compiled_step_that_still_does_not_fit_is_not_recommended(gelu_new: WhatIf) -> None:
    """torch.compile is recommended where it is faster and its step fits; on a GPU too small
    for the compiled step too, it is information, as every other fix that does not fit
    alone (the way forward says what does)."""
    from tilefit.advise.rules_compile import compile_findings
    from tilefit.estimator import overhead_bytes

    roomy = compile_findings(gelu_new)[0]
    assert roomy.recommended and roomy.predicted_speedup > 1
    a100 = gelu_new.device
    small = replace(a100, memory_bytes=overhead_bytes(a100) + roomy.peak_memory_after_bytes // 2)
    tight = compile_findings(_whatif(_tiny(), small))[0]
    # the same compiled step (the device's size changes no trace), over the smaller GPU
    assert tight.peak_memory_after_bytes == roomy.peak_memory_after_bytes
    assert tight.peak_memory_after_bytes + overhead_bytes(small) > small.memory_bytes
    assert not tight.recommended and tight.severity == "info"


def test_a_predicted_slowdown_reads_as_one() -> None:
    """1 / 0.5 = 2: a what-if at half the speed is "2.00x slower", never "0.50x faster"."""
    from tilefit.advise.findings import pace

    assert (pace(1.29), pace(1.0), pace(0.5), pace(0.8)) == (
        "1.29x faster", "1.00x faster", "2.00x slower", "1.25x slower")
