"""benchmarks/gpu_validation.py: import-safe, skips cleanly without CUDA, helpers testable."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_validation.py"


@pytest.fixture(scope="module")
def gv():
    spec = importlib.util.spec_from_file_location("gpu_validation", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_skips_without_cuda(gv, tmp_path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the skip path is not taken")
    out = tmp_path / "val.json"
    assert gv.main([str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["status"] == "skipped" and "no CUDA" in data["reason"]
    assert "skipped" in capsys.readouterr().out


def test_shapes_and_summary(gv) -> None:
    shapes = gv.gemm_shapes(300)
    assert len(shapes) == 300 and len({s for s, _ in shapes}) == 300
    assert all(128 <= v <= 8192 + 64 for s, _ in shapes for v in s)
    # errors +10%, -30% (aligned) and +50% (misaligned): median of |.| over all = 0.3
    summary = gv.summarize_errors([0.1, -0.3, 0.5], [True, True, False])
    assert summary["all"]["median_error"] == pytest.approx(0.3)
    assert summary["aligned"]["count"] == 2
    assert summary["aligned"]["median_error"] == pytest.approx(0.2)
    assert summary["misaligned"]["median_error"] == pytest.approx(0.5)


def test_estimate_checks_summarise_rows(gv) -> None:
    rows = [{"workload": "a", "peak_error": 0.01, "step_time_error": -0.10},
            {"workload": "b", "peak_error": -0.05, "step_time_error": 0.12}]
    mem = gv.check_estimate_memory(rows)
    # |-0.05| > 3%: fails, and names the worst workload
    assert (mem["status"], mem["worst"], mem["max_error"]) == ("fail", "b", 0.05)
    step = gv.check_estimate_step_time(rows)
    assert step["status"] == "pass" and step["median_error"] == pytest.approx(0.11)
    assert gv.check_estimate_memory([])["status"] == "pending"


@pytest.fixture(scope="module")
def families():
    path = PATH.parent / "gpu_families.py"
    spec = importlib.util.spec_from_file_location("gpu_families", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("name", "expected"), [
    # torch.profiler's spelling and tilefit's records' spelling of the same ops
    ("aten::addmm", "gemm"), ("aten.bmm.default", "gemm"), ("aten::mm", "gemm"),
    ("aten::_softmax", "softmax"), ("aten::_softmax_backward_data", "softmax"),
    ("aten::native_layer_norm_backward", "normalization"),
    ("aten::native_dropout", "elementwise"), ("aten::gelu_backward", "elementwise"),
    ("aten::_foreach_mul_", "foreach"), ("aten::copy_", "copy"),
    ("aten::embedding_dense_backward", "embedding_backward"), ("aten::sum", "reduction"),
    ("aten::view", "view"), ("aten::t", "view"),
    ("cudaLaunchKernel", "other"), ("ProfilerStep#1", "other"), ("aten::no_such_op", "other"),
])
def test_profiler_ops_fall_in_the_cost_models_categories(families, name, expected) -> None:
    assert families.category(name) == expected


def test_category_totals_drop_views_and_non_aten_rows(families) -> None:
    rows = [("aten::addmm", 2e-3), ("aten::mm", 1e-3), ("aten::_softmax", 5e-4),
            ("aten::view", 1.0), ("cudaMemcpyAsync", 1.0), ("aten::add_", 0.0)]
    assert families.by_category(rows) == pytest.approx({"gemm": 3e-3, "softmax": 5e-4})


def test_the_capped_allocator_check_predicts_on_the_cpu() -> None:
    # gpu_memory_check.predict_squeezed, the replay half of the retries check: a cap at the
    # uncapped reserved peak (plus cuBLAS's workspace) needs no release; 2 MiB under it the
    # allocator must release its cache at least once, or run out
    import sys

    sys.path.insert(0, str(PATH.parent))
    from gpu_memory_check import CASES, predict_squeezed
    from tilefit import Recipe, trace
    from tilefit.estimator import cublas_workspace_bytes
    from tilefit.estimator.allocator_replay import events_of, replay
    from tilefit.hardware import get_device

    case = next(c for c in CASES if c.name.startswith("gpt2-like"))
    tr = trace(case.build, case.batch(), loss_fn=case.loss_fn, gpu="a100-80gb",
               recipe=Recipe(optimizer=case.optimizer, precision="fp32"))
    need = replay(events_of(tr)).peak_reserved_bytes + \
        cublas_workspace_bytes(get_device("a100-80gb"))
    roomy = predict_squeezed(case, "fp32", need, gpu="a100-80gb")
    assert roomy == {"oom": False, "alloc_retries": 0, "steady_alloc_retries": 0}
    tight = predict_squeezed(case, "fp32", need - 2**21, gpu="a100-80gb")
    assert tight["oom"] or tight["alloc_retries"] >= 1


def test_the_lora_check_runs_its_cases_on_the_cpu(tmp_path) -> None:
    # gpu_lora_check's rows, on this CPU: each case built for real (peft, bitsandbytes'
    # nf4 through from_pretrained) and measured by MemTracker, beside the estimate
    import sys

    sys.path.insert(0, str(PATH.parent))
    from gpu_lora_check import cases, run, summary
    from tilefit.models import load_workload

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows = run(load_workload(str(tmp_path / "config.json"), seq_len=64), kind="cpu")
    assert [r["case"] for r in rows] == [name for name, _ in cases()]
    assert all(r["measured_peak_reserved_bytes"] is None for r in rows)  # no caching allocator
    result = summary(rows)
    assert result["status"] == "pass", [(r["case"], r["peak_memory_error"]) for r in rows]


def test_each_section_is_saved_as_it_ends_and_an_error_stays_in_its_section(
        gv, tmp_path, monkeypatch) -> None:
    # the CUDA path with every check stubbed: the JSON on disk after the second guarded
    # section already holds the first two, and a section that raises is reported in place
    import argparse
    import time

    out = tmp_path / "val.json"
    seen: list[set[str]] = []
    gemm = {"status": "pass", "dtype": "bf16", "device": "x",
            "uncalibrated": {"all": {"median_error": 0.1}},
            "calibrated": {"all": {"median_error": 0.05}}}
    monkeypatch.setattr(gv, "check_gemm", lambda dtype, count: gemm)
    monkeypatch.setattr(gv, "estimate_rows", lambda snapshots: [])

    def lora() -> dict:
        seen.append(set(json.loads(out.read_text())))
        raise RuntimeError("no bitsandbytes kernel")

    monkeypatch.setattr(gv, "check_alloc_retries", lambda rows: {"status": "pending"})
    monkeypatch.setattr(gv, "check_lora", lora)
    for name in ("check_tune", "check_host", "check_families", "check_optimizer"):
        monkeypatch.setattr(gv, name, lambda: {"status": "pass"})
    result: dict = {}
    args = argparse.Namespace(dtype="bf16", count=1, out=str(out))
    gv._on_cuda(args, result, gv._saver(result, str(out), time.perf_counter()))
    # when the lora section ran, the GEMM, estimate and retries sections were on disk
    assert {"gemm", "estimate_rows", "alloc_retries"} <= seen[0]
    data = json.loads(out.read_text())
    assert data["lora"] == {"status": "error", "reason": "RuntimeError: no bitsandbytes kernel"}
    assert data["optimizer"] == {"status": "pass"} and result["status"] == "pass"


def test_the_rnn_check_varies_each_term_alone_and_summarises() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_rnn_check import BASE, grid, summary

    shapes = grid()
    assert shapes[0] == BASE and len(set(shapes)) == len(shapes)
    for shape in shapes[1:]:  # one term differs from the base
        assert sum(a != b for a, b in zip(shape, BASE, strict=True)) == 1
    row = {"mode": "LSTM", "hidden": 256, "batch": 16, "seq": 64, "layers": 1,
           "bidirectional": False, "autocast": "fp32", "output_dtype": "torch.float32",
           "reserve_bytes": 2 * 256 * 16 * 64 * 4, "peak_bytes_over_start": 0, "step_ms": 1.0}
    out = summary([row, {"shape": list(BASE), "autocast": "bf16", "error": "x"}])
    assert out["reserve_bytes_per_state_element"] == [8.0]  # 2 x 4 bytes, by hand
    assert out["output_dtype_by_autocast"] == {"fp32": "torch.float32"} and out["errors"] == 1
