"""`tilefit bench step --lora [--quantize nf4]`: the model built for real as peft (and
bitsandbytes, through transformers' from_pretrained) build it, measured on this CPU by
PyTorch's MemTracker, beside tilefit's prediction of the same recipe (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilefit.cli.app import app

runner = CliRunner()

# a Llama of 2 layers, hidden 128, 2 KV heads, vocab 512, an untied head
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
          "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128,
          "tie_word_embeddings": False}


def _bench(tmp_path: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    r = runner.invoke(app, ["bench", "step", str(path), "--batch", "2", "--seq", "64",
                            "--precision", "bf16-mixed", "--steps", "1", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("extra", [
    ("--lora", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj"),
    ("--lora", "--quantize", "nf4"),
])
def test_a_lora_step_is_measured_as_peft_builds_it(tmp_path: Path, extra: tuple[str, ...]
                                                   ) -> None:
    full = _bench(tmp_path)
    row = _bench(tmp_path, *extra)
    assert row["recipe"]["lora"] is not None
    # the adapters were really applied: no full-size gradients or AdamW state, and (nf4)
    # 4-bit weights, so the measured step holds less than full fine-tuning's
    assert row["measured_peak_memory_bytes"] < 0.8 * full["measured_peak_memory_bytes"]
    # and the trace predicts what the real libraries allocated
    assert abs(row["peak_memory_error"]) <= 0.02, row


def test_quantize_without_lora_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    r = runner.invoke(app, ["bench", "step", str(path), "--quantize", "nf4"])
    assert r.exit_code == 2 and "--lora" in r.output
