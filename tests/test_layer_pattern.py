"""A repeating pattern of layer kinds (tilefit.models.layer_pattern) and the layer lever over
its repeats: the extrapolated step against a second method, the model traced in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tilefit import Recipe, estimate
from tilefit.advise import lever
from tilefit.estimator import estimate_trace
from tilefit.hardware import get_device
from tilefit.models import Workload, load_workload
from tilefit.models.layer_pattern import depth_changes, layer_kinds, period_of, repeated_period
from tilefit.planner import notes
from tilefit.planner.search import depth_of
from tilefit.tracing.workload_traces import trace_workload

LINEAR, FULL = "linear_attention", "full_attention"
# Qwen3.5's text model at the zoo's width: three gated-delta-rule layers to one attention layer
QWEN35 = {"num_hidden_layers": 12, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
          "max_position_embeddings": 128, "linear_conv_kernel_dim": 4,
          "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "layer_types": [LINEAR, LINEAR, LINEAR, FULL] * 3}


def _workload(tmp_path: Path, model_type: str, **fields: object) -> Workload:
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(cfg.to_dict(), default=str))
    return load_workload(str(path), seq_len=64)


def test_period_by_hand() -> None:
    assert period_of(("a", "a", "a")) == 1
    assert period_of(("a", "b") * 3) == 2
    assert period_of(("a", "a", "b") * 2) == 3
    assert period_of(("a", "b", "b")) == 3  # no shorter pattern repeats: the whole stack


def test_cutting_a_config_keeps_its_pattern() -> None:
    cfg = {"model_type": "gemma2", "num_hidden_layers": 8, "layer_types": ["s", "f"] * 4,
           "attn_layer_indices": [1, 3, 5, 7], "hybrid_override_pattern": "M*" * 4,
           "eos_token_id": [1, 2]}
    got = depth_changes(cfg, "num_hidden_layers", period=2, repeats=2)
    assert got == {"num_hidden_layers": 4, "layer_types": ["s", "f", "s", "f"],
                   "attn_layer_indices": [1, 3], "hybrid_override_pattern": "M*M*"}
    # token ids are no per-layer field: left as they are


def test_hybrids_read_from_their_config_class(tmp_path: Path) -> None:
    q = _workload(tmp_path, "qwen3_5_text", **QWEN35)
    assert layer_kinds(q.config) == (LINEAR, LINEAR, LINEAR, FULL) * 3
    assert repeated_period(q.config, "num_hidden_layers") == 4
    # Jamba states its pattern as periods (attention every 4th layer from the 3rd): the
    # config class's per-layer properties give the kinds
    jamba = _workload(tmp_path, "jamba", num_hidden_layers=12, attn_layer_period=4,
                      attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
                      num_experts=4, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    assert repeated_period(jamba.config, "num_hidden_layers") == 4
    # DeepSeek's dense first layer repeats nothing
    ds = _workload(tmp_path, "deepseek_v3", num_hidden_layers=8, first_k_dense_replace=1)
    assert layer_kinds(ds.config) is None and depth_of(ds).traced == (8,)


def test_a_repeated_pattern_extrapolates_to_the_full_trace(tmp_path: Path) -> None:
    work = _workload(tmp_path, "qwen3_5_text", **QWEN35)
    depth = depth_of(work)
    assert (depth.period, depth.full, depth.traced, depth.layers) == (4, 3, (1, 2), 12)
    assert "traced at 4, 8 of 12 layers (1 and 2 repeats of its 4-layer pattern)" in \
        notes.deep_model(depth)
    device, recipe = get_device("a100-80gb"), Recipe(batch_size=4)
    shallow = []
    for n in depth.traced:
        cut = depth.workload_at(work, n)
        assert cut.config["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL] * n
        tr = trace_workload(cut, recipe, device)
        shallow.append((tr, estimate_trace(tr, device)))
    got = lever.extrapolate((shallow[0], shallow[1]), depth)
    want = estimate(work, recipe=recipe, gpu=device)
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert got.peak_memory_bytes == want.peak_memory_bytes
    assert got.flops == want.flops and got.param_count == want.param_count
    assert "extrapolated to 12 layers from traces at 4 and 8" in got.warnings
