"""Each compat probe of a library's internals that finds nothing says so in the trace's notes
(tilefit.compat.probes): the library is changed here as a new release could change it, and
the note is asserted; so is the note for a version outside the tested set, and the tested
set is the repository's constraints file."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from tilefit import Recipe, estimate
from tilefit.compat import probes

ROOT = Path(__file__).resolve().parents[1]

_GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1,
         "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64}
_MAMBA = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 32,
          "num_hidden_layers": 1, "state_size": 8, "vocab_size": 128, "expand": 2,
          "conv_kernel": 4, "time_step_rank": 4}


def _workload(tmp_path: Path, config: dict[str, object]):  # type: ignore[no-untyped-def]
    from tilefit.models import load_workload

    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_workload(str(tmp_path / "config.json"), seq_len=8)


def _blind(warnings: tuple[str, ...], library: str) -> list[str]:
    version = probes.installed(library)
    return [w for w in warnings if w.startswith(f"{library} {version}: tilefit could not check")]


def test_the_tested_set_is_the_constraints_file() -> None:
    pinned = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)",
                             (ROOT / "constraints.txt").read_text(), re.M))
    assert {lib: pinned.get(lib) for lib in probes.TESTED} == probes.TESTED


def test_nothing_is_noted_on_the_tested_set(tmp_path: Path) -> None:
    est = estimate(_workload(tmp_path, _GPT2), recipe=Recipe(batch_size=1), gpu="a100-80gb")
    assert not [w for w in est.warnings if "tilefit could not check" in w
                or "not a version tilefit was tested with" in w]


def test_a_version_outside_the_tested_set_is_noted(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(probes.TESTED, "transformers", "4.0.0")
    monkeypatch.setitem(probes.LOWEST, "transformers", "3.0.0")
    est = estimate(_workload(tmp_path, _GPT2), recipe=Recipe(batch_size=1), gpu="a100-80gb")
    have = probes.installed("transformers")
    assert [w for w in est.warnings if "not a version" in w] == [
        f"transformers {have} is not a version tilefit was tested with (4.0.0 and 3.0.0): what "
        "tilefit reads of its internals is unchecked there (pip install "
        "transformers==4.0.0 for the tested one)"]


def test_kernel_wrappers_not_recognised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.mamba import modeling_mamba

    # the kernels package's mark on transformers' wrappers
    wrappers = [n for n, v in vars(modeling_mamba).items() if hasattr(v, "kernel_layer_name")]
    assert {"mamba_inner_fn", "causal_conv1d_fn"} <= set(wrappers)
    for name in wrappers:
        wrapper = getattr(modeling_mamba, name)
        # a wrapper of another shape, as a new transformers could write it
        monkeypatch.setattr(modeling_mamba, name,
                            lambda *a, _w=wrapper, **k: _w(*a, **k))
    est = estimate(_workload(tmp_path, _MAMBA), recipe=Recipe(batch_size=1), gpu="a100-80gb")
    assert not [w for w in est.warnings if "reference PyTorch code was traced" in w]
    (note,) = _blind(est.warnings, "transformers")
    assert "the optional kernels of transformers.models.mamba.modeling_mamba" in note
    assert f"tested with {probes.tested_text('transformers')}" in note


def _rename_mask_rule_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' mask rule with its parameters renamed, as a new release could."""
    from transformers import masking_utils

    rule = masking_utils._ignore_causal_mask_sdpa

    def renamed(padding_mask, query_length, kv_length, *rest, **kw):  # type: ignore[no-untyped-def]
        return rule(padding_mask, query_length, kv_length, *rest, **kw)

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", renamed)


def test_mask_rule_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _rename_mask_rule_parameters(monkeypatch)
    est = estimate(_workload(tmp_path, _GPT2), recipe=Recipe(batch_size=1), gpu="a100-80gb")
    (note,) = _blind(est.warnings, "transformers")
    assert "causal-mask rule (masking_utils._ignore_causal_mask_sdpa, not found" in note


def test_mask_rule_missing_says_nothing_for_a_plain_module(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    _rename_mask_rule_parameters(monkeypatch)
    est = estimate(nn.Linear(8, 8), torch.randn(4, 8), gpu="a100-80gb",
                   loss_fn=lambda m, x: m(x).sum())
    assert not [w for w in est.warnings if "could not check" in w]


def test_checkpointed_layers_not_found_under_compile(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.compat import transformers as compat_tf

    model = nn.Sequential(nn.Linear(4, 4))
    with probes.collecting() as notes:
        compat_tf.use_checkpoint_function(model, lambda *a: None)
    (note,) = notes
    assert "which layers gradient_checkpointing_enable armed" in note


def test_grouped_gemm_rule_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.integrations import moe as hf_moe

    from tilefit.compat.moe import experts_dispatch_for

    monkeypatch.delattr(hf_moe, "_can_use_grouped_mm")
    with probes.collecting() as notes, experts_dispatch_for((7, 0)):  # a V100
        pass
    (note,) = notes
    assert "integrations.moe._can_use_grouped_mm" in note
    with probes.collecting() as notes, experts_dispatch_for((8, 0)):  # not asked on an A100
        pass
    assert notes == []


def test_experts_modules_not_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.compat.moe import experts_modules

    mod = types.ModuleType("transformers_like_modeling_moe")
    mod.use_experts_implementation = lambda cls: cls  # the decorator a modeling module imports

    class Experts(nn.Module):  # made by a decorator that no longer sets is_concatenated
        num_experts = 4

    Experts.__module__ = mod.__name__
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with probes.collecting() as notes:
        assert experts_modules(nn.Sequential(Experts())) == []
    (note,) = notes
    assert note.startswith(f"transformers {probes.installed('transformers')}: ")
    assert "the experts modules of this mixture of experts" in note


def test_bitsandbytes_kernel_rule_missing(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from tilefit.compat import bnb_dispatch

    source = tmp_path / "ops.py"
    source.write_text("# a bitsandbytes whose CUDA ops no longer hold the rule\n")
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object):  # type: ignore[no-untyped-def]
        if name == "bitsandbytes.backends.cuda.ops":
            return importlib.util.spec_from_file_location(name, source)
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    bnb_dispatch._cuda_rule.cache_clear()
    try:
        with probes.collecting() as notes:
            # a 64-row GEMM on an A100 (108 SMs, 8.0): the cap alone decides
            assert not bnb_dispatch.gemm_4bit_dequantizes(64, 256, 256, torch.bfloat16, 64,
                                                          (108, 8, 0))
    finally:
        bnb_dispatch._cuda_rule.cache_clear()
    (note,) = [n for n in notes if "could not check" in n]
    assert "its choice of 4-bit GEMM kernel on CUDA" in note


def test_peft_target_rule_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import LoraConfig
    from peft.tuners import tuners_utils

    from tilefit.compat.peft import refused_targets

    monkeypatch.delattr(tuners_utils, "_check_lora_target_modules_mamba")
    with probes.collecting() as notes:
        assert refused_targets(LoraConfig(), nn.Linear(2, 2), ["out_proj"]) is None
    (note,) = notes
    assert "its rule refusing LoRA targets on Mamba-based models" in note


def test_module_paths_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed._tools.mod_tracker import ModTracker

    monkeypatch.delattr(ModTracker, "get_known_fqn")
    model = nn.Sequential(nn.Linear(8, 8))
    est = estimate(model, torch.randn(4, 8), gpu="a100-80gb", loss_fn=lambda m, x: m(x).sum())
    (note,) = _blind(est.warnings, "torch")
    assert "module paths (ModTracker.get_known_fqn)" in note


def test_autocast_flag_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.compat.amp import watching_autocast

    cls = torch.amp.autocast_mode.autocast
    enter = cls.__enter__

    def enter_without_flag(ctx):  # type: ignore[no-untyped-def]
        out = enter(ctx)
        ctx.__dict__["_flag_kept"] = ctx.__dict__.pop("_enabled")
        return out

    monkeypatch.setattr(cls, "__enter__", enter_without_flag)
    seen: list[bool] = []
    with probes.collecting() as notes, watching_autocast(lambda c, on: seen.append(on),
                                                         lambda c: None):
        ctx = torch.autocast("cpu", enabled=False)
        ctx.__enter__()
        ctx._enabled = ctx.__dict__.pop("_flag_kept")
        ctx.__exit__(None, None, None)
    assert seen == [True]  # taken as enabled, and said
    (note,) = notes
    assert "whether a torch.autocast context the step enters is enabled" in note


def test_the_note_is_in_the_cli_text_and_json(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import invoke_cli

    _rename_mask_rule_parameters(monkeypatch)
    monkeypatch.setenv("TILEFIT_JOBS", "0")
    (tmp_path / "config.json").write_text(json.dumps(_GPT2))
    args = ("estimate", str(tmp_path / "config.json"), "--seq", "8", "--batch", "1")
    text = invoke_cli(*args)
    assert text.returncode == 0, text.stderr
    assert "masking_utils._ignore_causal_mask_sdpa" in " ".join(text.stdout.split())
    out = invoke_cli(*args, "--json", "--no-ops")
    doc = json.loads(out.stdout)
    assert any("masking_utils._ignore_causal_mask_sdpa" in w for w in doc["warnings"])
