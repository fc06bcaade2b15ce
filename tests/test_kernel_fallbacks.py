"""transformers' optional kernels (mamba-ssm, causal-conv1d, flash-linear-attention) are traced
as transformers' reference PyTorch code, and the trace says so (tracing/kernels.py)."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from torch import nn
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from tilefit.compat.transformers import KernelCall, kernel_distribution, reference_kernels


def _modeling_module(package: str, func_name: str) -> types.ModuleType:
    """A modeling module as transformers writes one: a kernel wrapper and a layer calling it."""
    mod = types.ModuleType(f"tilefit_test_modeling_{package}")

    def reference(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    mod.kernel = use_kernel_func_from_hub_with_fallback(func_name, package)(reference)

    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return mod.kernel(x, scale=3.0, unused_by_reference=1)

    Layer.__module__ = mod.__name__
    mod.Layer = Layer
    sys.modules[mod.__name__] = mod
    return mod


def test_a_missing_package_runs_the_reference_and_is_noted() -> None:
    mod = _modeling_module("tilefit_no_such_kernels", "fused_thing")
    wrapper, ran = mod.kernel, set()
    with reference_kernels(mod.Layer(), ran.add):
        out = mod.Layer()(torch.ones(2))
    assert out.tolist() == [3.0, 3.0]  # the reference, the keyword it does not take dropped
    assert ran == {KernelCall("fused_thing", "tilefit_no_such_kernels", installed=False)}
    assert mod.kernel is wrapper  # put back


def test_an_installed_package_is_traced_as_the_reference() -> None:
    # 'math' imports and has 'sqrt': transformers' wrapper would call math.sqrt (a kernel
    # that cannot take a tensor, as mamba-ssm's cannot take a fake one)
    mod = _modeling_module("math", "sqrt")
    ran: set[KernelCall] = set()
    with reference_kernels(mod.Layer(), ran.add):
        out = mod.Layer()(torch.full((2,), 4.0))
    assert out.tolist() == [12.0, 12.0]
    assert ran == {KernelCall("sqrt", "math", installed=True)}


def test_pip_names() -> None:
    assert kernel_distribution("mamba_ssm") == "mamba-ssm"
    assert kernel_distribution("causal_conv1d") == "causal-conv1d"
    assert kernel_distribution("fla") == "flash-linear-attention"  # transformers' own mapping


_MAMBA = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64,
          "num_hidden_layers": 2, "state_size": 8, "vocab_size": 256, "expand": 2,
          "conv_kernel": 4, "time_step_rank": 4}


@pytest.mark.parametrize("gpu", ["a100-80gb", "cpu"])
def test_mamba_trace_says_which_kernels_were_reference_code(gpu: str, tmp_path) -> None:
    import json

    from tilefit import Recipe, estimate
    from tilefit.models import load_workload

    (tmp_path / "config.json").write_text(json.dumps(_MAMBA))
    work = load_workload(str(tmp_path / "config.json"), seq_len=16)
    est = estimate(work, recipe=Recipe(batch_size=2), gpu=gpu)
    notes = [w for w in est.warnings if "reference PyTorch code" in w]
    if gpu == "cpu":  # the reference code is what a CPU runs: nothing to say
        assert notes == []
        return
    assert len(notes) == 1
    for name in ("mamba_inner_fn", "selective_scan_fn", "causal_conv1d_fn", "mamba-ssm",
                 "causal-conv1d"):
        assert name in notes[0]


def _mamba_workload(tmp_path):  # type: ignore[no-untyped-def]
    import json

    from tilefit.models import load_workload

    (tmp_path / "config.json").write_text(json.dumps(_MAMBA))
    return load_workload(str(tmp_path / "config.json"), seq_len=8)


def test_the_trace_names_each_kernel_and_its_calling_module(tmp_path) -> None:
    from tilefit import Recipe
    from tilefit.hardware import get_device
    from tilefit.tracing.workload_traces import trace_workload

    tr = trace_workload(_mamba_workload(tmp_path), Recipe(batch_size=2), get_device("a100-80gb"))
    # transformers' MambaMixer.forward calls mamba_inner_fn (whose fallback returns None),
    # then causal_conv1d_fn and selective_scan_fn, in each of the 2 layers
    assert {(k.name, k.module) for k in tr.reference_kernels} == {
        (name, f"backbone.layers.{i}.mixer") for i in (0, 1)
        for name in ("mamba_inner_fn", "causal_conv1d_fn", "selective_scan_fn")}
    assert not any(k.installed for k in tr.reference_kernels)


def test_the_audit_says_what_the_reference_code_costs(tmp_path) -> None:
    from tilefit import Recipe, audit
    from tilefit.advise.rules_kernels import RULE

    result = audit(_mamba_workload(tmp_path), recipe=Recipe(batch_size=2), gpu="a100-80gb")
    found = [f for f in result.findings if f.rule == RULE]
    assert len(found) == 1 and not found[0].recommended
    f = found[0]
    assert f.modules == ("backbone.layers.*.mixer",)
    assert "pip install causal-conv1d mamba-ssm" in f.fix
    # its GPU time, second method: the module table's rows of the two mixers (each row is the
    # ops whose innermost module it is, as the rule counts them)
    est = result.estimate
    mixers = sum(m.time_s for m in est.modules if re.fullmatch(r"backbone\.layers\.\d\.mixer",
                                                                m.module))
    assert f"{mixers * 1e3:.2f} ms of GPU time" in f.reason
    assert f.step_time_after_s == f.step_time_before_s == est.step_time_s  # not re-estimated


def test_the_plan_says_it_too(tmp_path) -> None:
    from tilefit import plan

    # global batch 1: one micro-batch, each recipe traced once (the notes and the attention
    # of the recipes are what is checked, not the micro-batches)
    p = plan(_mamba_workload(tmp_path), global_batch=1, gpu="a100-80gb")
    assert p.best is not None
    said = [n for n in p.notes if "reference PyTorch code" in n]
    assert len(said) == 1 and "mamba_inner_fn" in said[0] and "mamba-ssm" in said[0]
    # MambaForCausalLM refuses SDPA: its recipes run its own attention-free code ("auto"),
    # not a skipped "sdpa" recipe each, nor an "eager" one that is the same step
    assert {r.attention for r in p.rows} == {"auto"}
    assert not any("does not support attention" in n for n in p.notes)


def test_lora_on_a_mamba_model_names_the_targets_peft_accepts(tmp_path) -> None:
    """peft refuses LoRA on a Mamba model's out_proj (mamba-ssm's kernels read its weight):
    the default "all-linear" fails there, and the error names the linear layers peft takes,
    which then trace."""
    from tilefit import Lora, Recipe, estimate
    from tilefit.errors import TilefitError

    work = _mamba_workload(tmp_path)
    with pytest.raises(TilefitError) as err:
        estimate(work, recipe=Recipe(batch_size=2, lora=Lora()), gpu="a100-80gb")
    # MambaMixer's linear layers: in_proj, x_proj, dt_proj, out_proj (peft refuses the last)
    assert "incompatible with Mamba-based models" in err.value.problem
    assert err.value.fix.startswith("pass Lora(targets=('in_proj', 'x_proj', 'dt_proj'")
    est = estimate(work, recipe=Recipe(batch_size=2, lora=Lora(targets=("in_proj", "x_proj",
                                                                         "dt_proj"))),
                   gpu="a100-80gb")
    # rank 16 on each of the 3 layers x 2 layers: r x (in + out) per adapted layer
    # in_proj 64 -> 256, x_proj 128 -> 4 + 2 x 8 = 20, dt_proj 4 -> 128
    assert est.trainable_param_count == 2 * 16 * ((64 + 256) + (128 + 20) + (4 + 128))


def test_peft_refusal_rule_is_read_from_peft(tmp_path) -> None:
    import peft

    from tilefit.compat.peft import refused_targets

    work = _mamba_workload(tmp_path)
    model = work.build()
    cfg = peft.LoraConfig(target_modules=["in_proj"])
    assert refused_targets(cfg, model, ["in_proj", "x_proj", "dt_proj", "out_proj",
                                        "conv1d"]) == ["out_proj", "conv1d"]


def test_an_inner_step_notes_its_own_calls() -> None:
    """A step traced while another one's wrappers are in place (a child forked inside it)
    still hears of its own calls; each context puts back what it found."""
    mod = _modeling_module("tilefit_no_such_kernels_2", "fused_other")
    original, outer, inner = mod.kernel, set(), set()
    with reference_kernels(mod.Layer(), outer.add):
        with reference_kernels(mod.Layer(), inner.add):
            mod.Layer()(torch.ones(1))
        assert len(inner) == 1 and not outer
    assert mod.kernel is original
