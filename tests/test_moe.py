"""Mixture-of-experts models traced under a routing assumption (tilefit.tracing.moe).

Tiny Mixtral- and OLMoE-like configs (2 layers, hidden 64, 4 or 8 experts, top-2) are written
in each test; the audits and the plan take one layer (each layer's experts alike: the same
findings, the same order of the implementations' steps as on two, in half the traced ops).
The traced CPU peak is checked against PyTorch's MemTracker on a real CPU run whose routers
are forced to the same routing: a forward hook on each router replaces its top-k indices
(balanced: token t's k slots go to experts (t k + j) mod E, so each expert gets exactly
tokens x k / E; skewed:0.5 with top-2: every token's first slot expert 0, its second expert
1 + t mod (E - 1))."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import invoke_cli

import tilefit
from tilefit.compat.fake import new_fake_mode
from tilefit.errors import TilefitError
from tilefit.estimator import estimate_trace
from tilefit.models import load_workload
from tilefit.recipe import Recipe
from tilefit.tracing.records import GemmShape
from tilefit.tracing.shapes import gemm_shapes
from tilefit.tracing.workload_traces import shared_traces
from tilefit.vocab import ExpertRouting, parse_routing

SRC = Path(__file__).resolve().parents[1] / "src"
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 256, "max_position_embeddings": 128, "output_router_logits": True,
           "router_aux_loss_coef": 0.02}
OLMOE = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
         "vocab_size": 256, "max_position_embeddings": 128, "output_router_logits": True,
         "eos_token_id": 2, "pad_token_id": 1}
SEQ, BATCH = 32, 2  # 64 tokens, 128 routed token-slots


def _config(tmp_path: Path, config: dict[str, Any], **changes: Any) -> str:
    path = tmp_path / f"{config['model_type']}.json"
    path.write_text(json.dumps({**config, **changes}))
    return str(path)


def test_routing_counts_by_hand() -> None:
    balanced = ExpertRouting()
    assert balanced.counts(128, 4) == (32, 32, 32, 32)
    assert balanced.counts(10, 4) == (3, 3, 2, 2)
    half = parse_routing("skewed:0.5")
    assert half.counts(128, 4, cap=64) == (64, 22, 21, 21)  # 0.5 x 128, the rest 64 over 3
    assert parse_routing("skewed:0.9").counts(128, 4, cap=64)[0] == 64  # a token once each
    assert parse_routing("skewed:0.1").counts(128, 4) == (32, 32, 32, 32)  # at least even
    assert parse_routing("Skewed:0.50").name == "skewed:0.5"
    assert Recipe(routing="skewed:0.50").routing == "skewed:0.5"
    for bad in ("skewed", "skewed:0", "skewed:1.5", "uniform", "skewed:x"):
        with pytest.raises(TilefitError, match="skewed:F"):
            Recipe(routing=bad)


def test_grouped_gemm_rows_per_expert_from_the_routing() -> None:
    mm = torch.ops.aten._grouped_mm.default
    bf16 = torch.bfloat16
    with new_fake_mode():
        x = torch.empty(128, 64, dtype=bf16)  # 64 tokens x top-2, hidden 64
        w = torch.empty(4, 64, 256, dtype=bf16)  # 4 experts' gate_up, 2 x 128
        offs = torch.empty(4, dtype=torch.int32)
        grad = torch.empty(128, 256, dtype=bf16)
        half = functools.partial(parse_routing("skewed:0.5").counts, cap=64)
        assert gemm_shapes(mm, (x, w, offs), {}, None, "gemm") == (
            GemmShape(4, 32, 256, 64, "bf16"),)
        assert gemm_shapes(mm, (x, w, offs), {}, None, "gemm", half) == (
            GemmShape(1, 64, 256, 64, "bf16"), GemmShape(1, 22, 256, 64, "bf16"),
            GemmShape(2, 21, 256, 64, "bf16"))
        # the weights' gradient: x^T (64, 128) times grad (128, 256), each expert its tokens
        assert gemm_shapes(mm, (x.t(), grad, offs), {}, None, "gemm") == (
            GemmShape(4, 64, 256, 32, "bf16"),)
        # fp32: ATen's fallback, one mm per group, each its own kernel
        assert gemm_shapes(mm, (x.float(), w.float(), offs), {}, None, "gemm", half) == (
            GemmShape(1, 64, 256, 64, "fp32"), GemmShape(1, 22, 256, 64, "fp32"),
            GemmShape(1, 21, 256, 64, "fp32"), GemmShape(1, 21, 256, 64, "fp32"))


def _force(routing: str) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        logits, scores, index = out
        tokens, k = index.shape
        experts = logits.shape[-1]
        t = torch.arange(tokens)[:, None]
        if routing == "balanced":
            forced = (t * k + torch.arange(k)[None, :]) % experts
        else:  # skewed:0.5 with top-2
            forced = torch.cat([torch.zeros_like(t), 1 + t % (experts - 1)], dim=1)
        return logits, scores, forced
    return hook


CASES = {  # name -> (config, experts implementation, routing)
    "mixtral-grouped": (MIXTRAL, None, "balanced"),  # transformers' default: grouped_mm
    "olmoe-eager": (OLMOE, "eager", "balanced"),
    "mixtral-eager-skewed": (MIXTRAL, "eager", "skewed:0.5"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_peak_matches_a_real_cpu_run_with_the_router_forced(tmp_path: Path,
                                                                name: str) -> None:
    from tilefit.bench.step import real_step_peak_bytes

    config, impl, routing = CASES[name]
    work = load_workload(_config(tmp_path, config, **(
        {"experts_implementation": impl} if impl else {})), seq_len=SEQ)
    batch = work.make_batch(BATCH)

    def make_opt(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)

    torch.manual_seed(0)
    model = work.build()  # real tensors
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(gates) == 2
    for gate in gates:
        gate.register_forward_hook(_force(routing))
    opt = make_opt(model.parameters())

    real = real_step_peak_bytes(model, opt, batch, work.loss_fn)
    traced = tilefit.trace(functools.partial(work.build), batch, loss_fn=work.loss_fn,
                           recipe=Recipe(batch_size=BATCH, optimizer=make_opt,
                                         routing=routing), gpu="cpu")
    peak = traced.peak(rounded=False)[0]
    assert abs(peak - real) <= 0.02 * real, (peak, real)
    assert any(f"routing {routing}" in w for w in traced.warnings), traced.warnings
    # the router's auxiliary loss (output_router_logits) is in the step: its histc
    assert any(op.op.startswith("aten.histc") for op in traced.ops)
    if impl is None:
        _check_grouped_flops(traced, config)


def _check_grouped_flops(traced: Any, config: dict[str, Any]) -> None:
    """The grouped GEMMs' FLOPs: per layer gate_up (routed x H x 2I) and down (routed x I x
    H), 2 per multiply-add, in the forward; the backward twice that."""
    routed, h, i = BATCH * SEQ * 2, config["hidden_size"], config["intermediate_size"]
    layer = 2 * routed * h * 2 * i + 2 * routed * i * h
    grouped = [op for op in traced.ops if op.op == "aten._grouped_mm.default" and op.step == 0]
    forward = sum(op.flops for op in grouped if op.phase == "forward")
    backward = sum(op.flops for op in grouped if op.phase == "backward")
    assert forward == 2 * layer and backward == 4 * layer, (forward, backward)
    assert all(op.kind == "gemm" for op in grouped)


def test_mixtral_catalog_entry_is_the_published_model() -> None:
    from tilefit.models.catalog import catalog_entry
    from tilefit.models.params import count_parameters

    entry = catalog_entry("mistralai/Mixtral-8x7B-v0.1")
    assert (entry["num_local_experts"], entry["num_experts_per_tok"]) == (8, 2)
    # Mistral AI's figure for Mixtral 8x7B: 46.7B parameters (46,702,792,704 exactly: embed
    # and head 2 x 32000 x 4096, 32 layers of attention 2 x 4096^2 + 2 x 4096 x 1024, eight
    # experts of 3 x 4096 x 14336, the router 8 x 4096 and two norms, the final norm)
    assert count_parameters(load_workload("mixtral-8x7b")) == 46_702_792_704


def test_olmoe_catalog_entry_is_the_published_model() -> None:
    from tilefit.models.catalog import catalog_entry
    from tilefit.models.params import count_parameters

    entry = catalog_entry("allenai/OLMoE-1B-7B-0924")
    assert (entry["num_experts"], entry["num_experts_per_tok"]) == (64, 8)
    # by hand: embed and head 2 x 50304 x 2048; 16 layers of attention 4 x 2048^2, QK norms
    # 2 x 2048 and two layer norms 2 x 2048, the router 64 x 2048, 64 experts of
    # 3 x 2048 x 1024; the final norm 2048. AI2's "6.9B total parameters" (OLMoE paper).
    layer = 4 * 2048**2 + 4 * 2048 + 64 * 2048 + 64 * 3 * 2048 * 1024
    assert count_parameters(load_workload("olmoe-1b-7b")) == \
        2 * 50304 * 2048 + 16 * layer + 2048 == 6_919_161_856


def test_cli_estimate_of_a_mixtral_config_prints_no_third_party_lines(tmp_path: Path) -> None:
    path = _config(tmp_path, MIXTRAL)
    # the refusal in this process (test_plan_keeps_the_routing_in_every_recipe_it_traces
    # has plan's in a fresh one)
    bad = invoke_cli("estimate", path, "--gpu", "cpu", "--routing", "even")
    assert bad.returncode == 2 and "skewed:F" in bad.stderr + bad.stdout
    # the estimate in this process too: what a fresh process's imports print is checked on a
    # Mixtral estimate in one by tests/test_third_party_noise.py (its qlora-moe case: every
    # line on stderr tilefit's own); here, what the trace of the routed experts prints
    out = invoke_cli("estimate", path, "--gpu", "cpu", "--batch", "2", "--seq", "32",
                     "--routing", "skewed:0.5", "--json", "--no-ops")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["recipe"]["routing"] == "skewed:0.5"
    # tilefit's own notes only: no torch log line (glog style "W1201 19:03:29..."), no
    # torchao import failure, no fake-tensor traceback, no transformers notice
    third_party = re.compile(r"^[WEI]\d{4} |Failed to load|Enum subclass|Traceback|"
                             r"fake_tensor|\[transformers\]", re.MULTILINE)
    assert not third_party.search(out.stderr), out.stderr
    assert out.stderr.startswith("note:"), out.stderr


def test_plan_keeps_the_routing_in_every_recipe_it_traces(tmp_path: Path) -> None:
    """plan --routing: each swept recipe carries the user's routing (PlanState.with_user),
    and a routing outside its forms is refused before anything is traced."""
    from tilefit.estimator.offload import OffloadLink
    from tilefit.hardware import get_device
    from tilefit.planner.search import depth_of
    from tilefit.planner.state import PlanState

    work = load_workload(_config(tmp_path, MIXTRAL), seq_len=SEQ)
    user = Recipe(routing="skewed:0.5")
    state = PlanState(work, get_device("a100-80gb"), 4, 2**30, "adamw", depth_of(work),
                      OffloadLink(), user=user)
    assert state.with_user(Recipe(precision="bf16-mixed")).routing == "skewed:0.5"
    bad = subprocess.run([sys.executable, "-m", "tilefit", "plan", _config(tmp_path, MIXTRAL),
                          "--global-batch", "4", "--routing", "even"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    assert bad.returncode == 2 and "skewed:F" in bad.stderr + bad.stdout


def test_tunes_first_probe_is_predicted_under_the_users_routing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tune's trials run the real router; its first probe, predicted from traces, takes
    --routing as estimate does: every trace of the prediction is under it."""
    import tilefit.tracing as tracing
    from tilefit.tuning.predict import predict_max_batch

    work = load_workload(_config(tmp_path, MIXTRAL), seq_len=SEQ)
    model = work.build("sdpa")
    seen: list[str] = []
    real = tracing.trace

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["recipe"].routing)
        return real(*args, **kwargs)

    monkeypatch.setattr(tracing, "trace", spy)
    got = predict_max_batch(model, lambda b: work.make_batch(b, device="cpu"),
                            loss_fn=work.loss_for(False), optimizer=torch.optim.AdamW,
                            recipe=Recipe(precision="fp32"), device=torch.device("cpu"),
                            budget_bytes=2**30, cap=64, routing="skewed:0.5")
    assert got.max_batch is not None and seen and set(seen) == {"skewed:0.5"}


def test_tune_refuses_a_malformed_routing_before_building_the_model() -> None:
    bad = invoke_cli("tune", "gpt2", "--gpu", "cpu", "--routing", "skewed:2")
    assert bad.returncode == 2 and "skewed:F" in bad.stderr + bad.stdout
    assert "building" not in bad.stderr


def test_the_audit_proposes_the_faster_experts_implementation_re_traced(tmp_path: Path) -> None:
    """A model whose experts run eager (a loop, a GEMM pair per expert): the audit re-traces
    the step with transformers' other two implementations and proposes the fastest that
    fits; its predicted step is the estimate of the config with that implementation (second
    method: estimated directly)."""
    from tilefit.advise.rules_moe import RULE

    work = load_workload(_config(tmp_path, MIXTRAL, num_hidden_layers=1,
                                 experts_implementation="eager"), seq_len=SEQ)
    recipe = Recipe(batch_size=BATCH)
    with shared_traces():  # the direct estimates cost the audit's traces of the same steps
        audit = tilefit.audit(work, gpu="a100-80gb", recipe=recipe)
        direct = {impl: tilefit.estimate(work.with_config(experts_implementation=impl),
                                         gpu="a100-80gb", recipe=recipe).step_time_s
                  for impl in ("eager", "grouped_mm", "batched_mm")}
    (found,) = [f for f in audit.findings if f.rule == RULE]
    fastest = min(("grouped_mm", "batched_mm"), key=direct.__getitem__)
    assert (found.current, found.suggested) == ("eager", fastest)
    assert found.step_time_before_s == pytest.approx(direct["eager"], rel=1e-9)
    assert found.step_time_after_s == pytest.approx(direct[fastest], rel=1e-9)
    assert found.recommended and "experts_implementation" in found.fix


def test_no_experts_finding_where_transformers_default_is_fastest(tmp_path: Path) -> None:
    """In bf16 transformers' default runs torch's grouped kernel: on a step big enough to
    keep the GPU busy (on the 64-token toy step the host decides) nothing beats it."""
    from tilefit.advise.rules_moe import RULE

    work = load_workload(_config(tmp_path, MIXTRAL, num_hidden_layers=1, hidden_size=256,
                                 intermediate_size=512, num_local_experts=8,
                                 max_position_embeddings=256),
                         seq_len=256)
    audit = tilefit.audit(work, gpu="a100-80gb",
                          recipe=Recipe(batch_size=4, precision="bf16-true"))
    assert not [f for f in audit.findings if f.rule == RULE]


def test_fp32_experts_run_atens_per_group_fallback_and_the_audit_says_so(
        tmp_path: Path) -> None:
    """bf16-mixed keeps fp32 weights: transformers' grouped_mm is ATen's fallback there (the
    offsets read on the host, one mm per expert), which batched_mm beats on this small
    config; the compile what-if says that compiled, the experts run transformers' loop."""
    from tilefit.advise.rules_moe import RULE
    from tilefit.estimator.multitensor import kernel_launches
    from tilefit.hardware import get_device

    work = load_workload(_config(tmp_path, MIXTRAL, num_hidden_layers=1), seq_len=SEQ)
    recipe = Recipe(batch_size=BATCH)
    with shared_traces():  # the direct estimates cost the audit's traces of the same steps
        audit = tilefit.audit(work, gpu="a100-80gb", recipe=recipe)
        batched = tilefit.estimate(work.with_config(experts_implementation="batched_mm"),
                                   gpu="a100-80gb", recipe=recipe).step_time_s
        # the same step in bf16-true, where the grouped kernel runs (second method: estimated)
        pure = tilefit.estimate(work, gpu="a100-80gb",
                                recipe=Recipe(batch_size=BATCH, precision="bf16-true"))
    grouped = [c.record for c in audit.estimate.ops if c.record.op == "aten._grouped_mm.default"]
    experts = MIXTRAL["num_local_experts"]
    assert grouped and all(len(op.gemms) == experts for op in grouped)
    assert {kernel_launches(op, get_device("a100-80gb")) for op in grouped} == {experts}
    (found,) = [f for f in audit.findings if f.rule == RULE]
    assert found.suggested == "batched_mm"
    assert found.step_time_after_s == pytest.approx(batched, rel=1e-9)
    (compiled,) = [f for f in audit.findings if f.rule == "compile"]
    assert "with experts' weights in fp32" in compiled.reason, compiled.reason
    (dtype,) = [f for f in audit.findings if f.rule == "experts-dtype"]
    assert (dtype.current, dtype.suggested) == ("bf16-mixed", "bf16-true")
    assert dtype.step_time_after_s == pytest.approx(pure.step_time_s, rel=1e-9)


def test_an_experts_size_off_alignment_is_named_once_by_its_config_field(tmp_path: Path) -> None:
    """intermediate_size 1000 is off fp32's multiple of 32 (and so is the fused gate_up's 2 x
    1000 = 2000): one finding, on the field, not a second on an unnamed 2000 that no user can
    change apart from it."""
    work = load_workload(_config(tmp_path, MIXTRAL, num_hidden_layers=1, intermediate_size=1000,
                                 hidden_size=1024, num_attention_heads=8,
                                 num_key_value_heads=8), seq_len=128)
    audit = tilefit.audit(work, gpu="a100-80gb", recipe=Recipe(batch_size=4))
    dims = [(f.dimension, f.current, f.suggested) for f in audit.findings
            if f.rule == "weight-dim-alignment"]
    assert dims == [("intermediate_size", 1000, 1024)]


def _compiled(tmp_path: Path, precision: str) -> Any:
    from tilefit.recipe_parts import Compile

    work = load_workload(_config(tmp_path, MIXTRAL), seq_len=SEQ)
    return tilefit.trace(work.build, work.make_batch(BATCH), loss_fn=work.loss_fn,
                         recipe=Recipe(batch_size=BATCH, precision=precision,
                                       compile=Compile()), gpu="a100-80gb")


def test_compiled_fp32_experts_run_transformers_per_expert_loop(tmp_path: Path) -> None:
    """Under torch.compile transformers sends experts whose weights are not bf16 to its own
    custom op (transformers/integrations/moe.py, _can_use_grouped_mm): with bf16-mixed's fp32
    weights the step traces through it, one GEMM per expert, each its own kernel."""
    from tilefit.estimator.multitensor import kernel_launches
    from tilefit.hardware import get_device

    traced = _compiled(tmp_path, "bf16-mixed")
    loops = [op for op in traced.ops if op.op.startswith("transformers.grouped_mm_fallback")
             and op.step == 0]
    assert not any(op.op.startswith("aten._grouped_mm") for op in traced.ops)
    forward = [op for op in loops if op.phase == "forward"]
    backward = [op for op in loops if op.phase == "backward"]
    assert len(forward) == len(backward) == 4  # gate_up and down, 2 layers
    routed, h, i = BATCH * SEQ * 2, MIXTRAL["hidden_size"], MIXTRAL["intermediate_size"]
    layer = 2 * routed * h * 2 * i + 2 * routed * i * h  # as _check_grouped_flops
    assert sum(op.flops for op in forward) == 2 * layer
    assert sum(op.flops for op in backward) == 4 * layer
    experts = MIXTRAL["num_local_experts"]  # balanced: every expert gets 128 / 4 = 32 rows
    gate_up = next(op for op in forward if op.output_shapes[0][-1] == 2 * i)
    assert gate_up.gemms == (GemmShape(1, routed // experts, 2 * i, h, "fp32"),) * experts
    a100 = get_device("a100-80gb")
    # a zero fill per output and a matmul per expert: 1 + 4 forward, 2 + 2 x 4 backward
    assert kernel_launches(gate_up, a100) == 1 + experts
    assert {kernel_launches(op, a100) for op in backward} == {2 + 2 * experts}
    assert any("per-expert loop" in w for w in traced.warnings), traced.warnings
    # its offsets read on the host: no CUDA graph can capture it (reduce-overhead)
    with pytest.raises(TilefitError, match=r"transformers\.grouped_mm_fallback "):
        estimate_trace(dataclasses.replace(traced, compile_mode="reduce-overhead"), a100)


def test_compiled_bf16_experts_keep_torchs_grouped_gemm(tmp_path: Path) -> None:
    from tilefit.hardware import get_device

    traced = _compiled(tmp_path, "bf16-true")
    assert any(op.op.startswith("aten._grouped_mm") for op in traced.ops)
    assert not any(op.op.startswith("transformers.") for op in traced.ops)
    assert torch.compiler.is_compiling() is False  # the capture's flag was put back
    graphed = estimate_trace(dataclasses.replace(traced, compile_mode="reduce-overhead"),
                             get_device("a100-80gb"))
    assert "cudagraph_pool" in graphed.memory_breakdown  # replayed: the graphs' own pool


def test_before_ampere_transformers_runs_its_loop_in_eager_too(tmp_path: Path) -> None:
    """On CUDA transformers calls torch's grouped GEMM from compute capability 8.0 only
    (_can_use_grouped_mm): a T4 (7.5) step runs its per-expert loop, eager as well."""
    work = load_workload(_config(tmp_path, MIXTRAL), seq_len=SEQ)
    traced = tilefit.trace(work.build, work.make_batch(BATCH), loss_fn=work.loss_fn,
                           recipe=Recipe(batch_size=BATCH, precision="fp16-mixed"), gpu="t4")
    names = {op.op for op in traced.ops}
    assert "transformers.grouped_mm_fallback.default" in names
    assert not any(n.startswith("aten._grouped_mm") for n in names)
    assert any("this GPU has 7.5" in w for w in traced.warnings), traced.warnings
    from transformers.integrations import moe as hf_moe

    assert hf_moe._can_use_grouped_mm.__name__ == "_can_use_grouped_mm"  # put back


def test_under_compile_the_audit_weighs_batched_mm_against_the_loop_and_skips_eager(
        tmp_path: Path) -> None:
    """Compiled, grouped_mm with fp32 weights is transformers' per-expert loop; batched_mm is
    re-traced against it (its step equals a direct estimate); eager is not tried: its
    data-dependent loop breaks the graph."""
    from tilefit.advise.rules_moe import RULE
    from tilefit.recipe_parts import Compile

    work = load_workload(_config(tmp_path, MIXTRAL, num_hidden_layers=1), seq_len=SEQ)
    recipe = Recipe(batch_size=BATCH, compile=Compile())
    with shared_traces():  # the direct estimates cost the audit's traces of the same steps
        audit = tilefit.audit(work, gpu="a100-80gb", recipe=recipe)
        direct = {impl: tilefit.estimate(work.with_config(experts_implementation=impl),
                                         gpu="a100-80gb", recipe=recipe).step_time_s
                  for impl in ("grouped_mm", "batched_mm")}
    assert any("experts_implementation='eager'" in n and "graph" in n for n in audit.notes)
    assert audit.estimate.step_time_s == pytest.approx(direct["grouped_mm"], rel=1e-9)
    (found,) = [f for f in audit.findings if f.rule == RULE]
    assert (found.current, found.suggested) == ("grouped_mm", "batched_mm")
    assert found.step_time_after_s == pytest.approx(direct["batched_mm"], rel=1e-9)


def test_plan_weighs_pure_bf16_for_a_mixture_of_experts(tmp_path: Path) -> None:
    """In mixed precision (fp32 weights) the experts miss torch's bf16-only grouped GEMM, so
    the plan also sweeps bf16-true for a mixture of experts, and says what it changes; a
    dense model, or a GPU without bf16, gets no such recipe."""
    from tilefit.hardware import get_device
    from tilefit.planner.search import changes_of
    from tilefit.planner.space import moe_recipes

    a100, t4 = get_device("a100-80gb"), get_device("t4")
    assert [r.precision for r in moe_recipes(a100, "adamw", experts=True)] == ["bf16-true"]
    assert moe_recipes(a100, "adamw", experts=False) == moe_recipes(t4, "adamw",
                                                                    experts=True) == []
    (pure,) = moe_recipes(a100, "adamw", experts=True)
    assert any("pure bf16" in c for c in changes_of(pure, "adamw", offload=False))
    assert any("master copy on the CPU" in c for c in changes_of(pure, "adamw", offload=True))
    work = load_workload(_config(tmp_path, MIXTRAL, num_hidden_layers=1), seq_len=SEQ)
    # global batch 1: one micro-batch, each recipe traced once (the sweep of precisions is
    # what is checked, not the micro-batches)
    plan = tilefit.plan(work, gpu="a100-80gb", global_batch=1)
    rows = [r for r in plan.rows if r.precision == "bf16-true" and not r.offload]
    assert rows and all(r.fits for r in rows)
