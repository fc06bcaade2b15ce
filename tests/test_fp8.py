"""precision fp8-mixed: torchao's own float8 training traced on fake tensors (the GEMMs of
eligible nn.Linear layers in fp8, their scaling and casting kernels, what is saved for
backward), the device check, the alignment rule, the audit finding and the plan's knob.

Expected values are hand arithmetic over torchao's documented recipe
(docs/references.md, section 21): per converted layer, three GEMMs (output, grad_input,
grad_weight); casts of the input and weight (e4m3) in the forward, of grad_output (e5m2, once
per backward GEMM), the weight and the input (e4m3) in the backward.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tilefit.errors import TilefitError  # noqa: E402
from tilefit.hardware.catalog import CATALOG  # noqa: E402
from tilefit.recipe import Recipe  # noqa: E402
from tilefit.tracing import trace  # noqa: E402
from tilefit.vocab import parse_precision  # noqa: E402

B, D_IN, D_HID, D_OUT, CLASSES = 16, 64, 128, 32, 10  # the last layer: 10 % 16 != 0


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT),
                         nn.ReLU(), nn.Linear(D_OUT, CLASSES))


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:  # type: ignore[type-arg]
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batch() -> tuple:  # type: ignore[type-arg]
    return torch.randn(B, D_IN), torch.randint(0, CLASSES, (B,))


def _is_cast(op) -> bool:  # type: ignore[no-untyped-def]
    """A cast to fp8 (not a view of an fp8 tensor)."""
    return op.op == "aten._to_copy.default" and op.kind == "memory" \
        and op.dtype.startswith("float8")


@pytest.fixture(scope="module")
def mlp_trace():  # type: ignore[no-untyped-def]
    pytest.importorskip("torchao")
    return trace(_mlp(), _batch(), loss_fn=_loss, recipe=Recipe(precision="fp8"), gpu="h100")


def test_the_spellings_of_fp8_name_one_precision() -> None:
    names = {parse_precision(s).name for s in ("fp8", "float8", "FP8_mixed", "fp8-mixed")}
    assert names == {"fp8-mixed"}
    spec = parse_precision("fp8")
    assert spec.compute_dtype == "fp8" and spec.autocast_dtype == "bf16"
    assert spec.param_dtype == "fp32" and not spec.grad_scaler  # fp32 master weights


def test_fp8_gemms_are_the_three_gemms_of_each_aligned_linear(mlp_trace) -> None:  # type: ignore[no-untyped-def]
    fp8 = sorted((g.m, g.n, g.k) for o in mlp_trace.ops_of_step(0) for g in o.gemms
                 if g.dtype == "fp8")
    # out = x W^T: (B, in) x (in, out); grad_input = g W: (B, out) x (out, in);
    # grad_weight = g^T x: (out, B) x (B, in) -- for Linear(64, 128) and Linear(128, 32);
    # torchao computes grad_input for the first layer too (its Function always does)
    expected = sorted([(B, D_HID, D_IN), (B, D_IN, D_HID), (D_HID, D_IN, B),
                       (B, D_OUT, D_HID), (B, D_HID, D_OUT), (D_OUT, D_HID, B)])
    assert fp8 == expected
    fp8_flops = sum(o.flops for o in mlp_trace.ops_of_step(0)
                    if any(g.dtype == "fp8" for g in o.gemms))
    assert fp8_flops == sum(2 * m * n * k for m, n, k in expected)


def test_a_linear_not_a_multiple_of_16_stays_bf16(mlp_trace) -> None:  # type: ignore[no-untyped-def]
    last = [g for o in mlp_trace.ops_of_step(0) for g in o.gemms if CLASSES in (g.m, g.n)]
    assert last and all(g.dtype == "bf16" for g in last)  # autocast's bf16, as bf16-mixed
    assert any("stay bf16" in w and "4" in w for w in mlp_trace.warnings)


def test_fp8_gemm_bytes_are_one_byte_operands_and_a_bf16_output(mlp_trace) -> None:  # type: ignore[no-untyped-def]
    fwd = next(o for o in mlp_trace.ops_of_step(0) if o.phase == "forward"
               and o.gemms and o.gemms[0] == o.gemms[0].__class__(1, B, D_HID, D_IN, "fp8"))
    assert fwd.bytes == B * D_IN * 1 + D_IN * D_HID * 1 + B * D_HID * 2


def test_scaling_casts_by_format_and_their_bytes(mlp_trace) -> None:  # type: ignore[no-untyped-def]
    casts = [o for o in mlp_trace.ops_of_step(0) if _is_cast(o)]
    fwd = [o for o in casts if o.phase == "forward"]
    bwd = [o for o in casts if o.phase == "backward"]
    # forward: input + weight per layer (e4m3); backward: grad_output twice (e5m2), the
    # weight and the input again (e4m3)
    assert len(fwd) == 2 * 2 and all(o.dtype == "float8_e4m3fn" for o in fwd)
    assert sorted(o.dtype for o in bwd) == ["float8_e4m3fn"] * 4 + ["float8_e5m2"] * 4
    # each cast reads the scaled fp32 tensor (4 bytes) and writes fp8 (1 byte)
    for o in casts:
        n = 1
        for d in o.output_shapes[0]:
            n *= d
        assert o.bytes == n * (4 + 1)
    # the amax of each cast: an abs and a max over the same tensor
    maxes = [o for o in mlp_trace.ops_of_step(0) if o.op == "aten.max.default"
             and o.phase in ("forward", "backward")]
    assert len(maxes) == len(casts)


def test_no_fp8_copy_is_saved_for_backward(mlp_trace) -> None:  # type: ignore[no-untyped-def]
    # torchao saves the high-precision input and weight; the forward's fp8 casts die before
    # the backward starts
    ops = mlp_trace.ops
    first_bwd = next(i for i, o in enumerate(ops) if o.phase == "backward")
    cast_at = {i for i, o in enumerate(ops[:first_bwd])
               if o.phase == "forward" and _is_cast(o)}
    born = [s for s in mlp_trace.storages if s.alloc_at in cast_at]
    assert len(born) == len(cast_at) == 4
    assert all(s.free_at is not None and s.free_at < first_bwd for s in born)


def test_compiled_fp8_runs_scaled_mm_with_fused_casts() -> None:
    pytest.importorskip("torchao")
    tr = trace(_mlp(), _batch(), loss_fn=_loss, recipe=Recipe(precision="fp8-mixed", compile=True),
               gpu="h100")
    scaled = [o for o in tr.ops_of_step(0) if o.op == "aten._scaled_mm.default"]
    # six as in eager less the first layer's grad_input, which nothing uses (the batch needs
    # no gradient): the compiled backward graph drops it, eager torchao computes it
    assert len(scaled) == 5 and all(o.gemms[0].dtype == "fp8" for o in scaled)
    assert (B, D_IN, D_HID) not in {(o.gemms[0].m, o.gemms[0].n, o.gemms[0].k)
                                    for o in scaled}
    casts = [o for o in tr.ops_of_step(0) if o.dtype.startswith("float8")
             and o.kind == "memory" and o.op.startswith("prims.convert_element_type")]
    assert casts and all(o.fused for o in casts)  # Inductor fuses amax, scale and cast


@pytest.mark.parametrize("gpu", ["a100-80gb", "v100", "t4"])
def test_a_gpu_without_fp8_names_the_ones_that_have_it(gpu: str) -> None:
    with pytest.raises(TilefitError) as err:
        trace(_mlp(), _batch(), loss_fn=_loss, recipe=Recipe(precision="fp8"), gpu=gpu)
    text = str(err.value)
    # fp8 Tensor Cores: Ada (sm89) and later -- a second criterion than the peak table
    have = [d.name for d in CATALOG if d.compute_capability and d.compute_capability >= (8, 9)]
    assert have and all(name in text for name in have)
    assert gpu not in text.split("in the catalog:")[1].split(")")[0]
    assert "Recipe(precision='bf16-mixed')" in text or "Recipe(precision='fp16-mixed')" in text


def test_fp8_on_the_cpu_is_an_error() -> None:
    with pytest.raises(TilefitError, match="h100"):
        trace(_mlp(), _batch(), loss_fn=_loss, recipe=Recipe(precision="fp8"), gpu="cpu")


def test_without_torchao_the_error_gives_the_install_command(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import tilefit.compat.torchao as f8

    def missing(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(f8.importlib, "import_module", missing)
    with pytest.raises(TilefitError, match=r"pip install 'tilefit\[fp8\]'"):
        f8.torchao_float8()


# ---- audit and plan ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_one_layer():  # type: ignore[no-untyped-def]
    from tilefit.models import load_workload

    # Llama-3.2-1B's linears (2048 x 8192 MLP, a 128256-row lm_head), one layer
    return load_workload("llama-3.2-1b", seq_len=128).with_config(num_hidden_layers=1)


def _whatif(work, gpu: str):  # type: ignore[no-untyped-def]
    """The audit's what-if for a bf16-mixed step of ``work`` on ``gpu`` (the rule alone:
    the other rules' re-traces are not needed here)."""
    from tilefit.advise.whatif import WhatIf
    from tilefit.estimator import estimate_trace
    from tilefit.hardware import get_device
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    dev = get_device(gpu)
    recipe = Recipe(batch_size=8, precision="bf16-mixed", optimizer="adamw-fused")
    tr = trace_workload(work, recipe, dev)
    return WhatIf(work, recipe, dev, tr, estimate_trace(tr, dev),
                  lambda w, r: trace_workload(w, r, dev))


def test_audit_finds_fp8_on_h100_with_the_retraced_gain(llama_one_layer) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torchao")
    from dataclasses import replace

    from tilefit.advise.audit import RULES
    from tilefit.advise.rules_fp8 import fp8_findings
    from tilefit.estimator.workload_estimate import estimate_workload

    assert fp8_findings in RULES
    whatif = _whatif(llama_one_layer, "h100")
    (f,) = fp8_findings(whatif)
    assert f.rule == "fp8" and f.recommended and f.method == "retrace"
    assert "convert_to_float8_training" in f.fix and "torch.compile" in f.fix
    assert "mixed_precision='fp8'" in f.fix and "AORecipeKwargs" in f.fix
    # a second method: estimate the fixed step directly
    direct = estimate_workload(llama_one_layer, replace(whatif.recipe, precision="fp8-mixed",
                                                        compile=True), "h100")
    assert f.step_time_after_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert f.step_time_before_s == whatif.estimate.step_time_s
    assert f.step_time_after_s < f.step_time_before_s


def test_no_fp8_finding_where_the_gpu_has_no_fp8(llama_one_layer) -> None:  # type: ignore[no-untyped-def]
    from tilefit.advise.rules_fp8 import fp8_findings
    from tilefit.advise.whatif import WhatIf
    from tilefit.hardware import get_device
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    recipe = Recipe(batch_size=1, precision="bf16-mixed")
    calls: list[object] = []

    def retrace(work, r):  # type: ignore[no-untyped-def]
        calls.append(r)
        return trace_workload(work, r, "a100-80gb")

    dev = get_device("a100-80gb")
    whatif = WhatIf(llama_one_layer, recipe, dev, None, None, retrace)  # type: ignore[arg-type]
    assert fp8_findings(whatif) == [] and calls == []  # not even a re-trace


def test_plan_searches_fp8_where_the_gpu_has_it() -> None:
    from tilefit.hardware import get_device
    from tilefit.planner.search import changes_of
    from tilefit.planner.space import fp8_recipes

    assert fp8_recipes(get_device("a100-80gb"), "adamw", hf_model=True) == []
    (r,) = fp8_recipes(get_device("h100"), "adamw", hf_model=True)
    assert r.precision == "fp8-mixed" and r.compile and r.optimizer == "adamw-fused"
    assert any("fp8" in c and "torchao" in c for c in changes_of(r, "adamw", False))


def test_an_fp8_plan_row_pastes_the_torchao_conversion() -> None:
    from tilefit.planner.configs import float8_lines
    from tilefit.recipe import Recipe

    class Row:  # the fields float8_lines reads
        recipe = Recipe(precision="fp8-mixed", compile=True)

    lines = float8_lines(Row())  # type: ignore[arg-type]
    assert "convert_to_float8_training" in lines[1] and "% 16 == 0" in lines[1]
    Row.recipe = Recipe(precision="bf16-mixed")
    assert float8_lines(Row()) == []  # type: ignore[arg-type]


def test_gpt2s_conv1d_layers_stay_bf16_and_the_trace_says_why() -> None:
    pytest.importorskip("torchao")
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    work = load_workload("gpt2", seq_len=32).with_config(num_hidden_layers=1)
    tr = trace_workload(work, Recipe(batch_size=2, precision="fp8-mixed"), "h100")
    gemms = [g for o in tr.ops_of_step(0) for g in o.gemms]
    assert gemms and all(g.dtype == "bf16" for g in gemms)  # Conv1D; lm_head: 50257 % 16
    assert any("no layer runs in fp8" in w and "Conv1D" in w for w in tr.warnings)
