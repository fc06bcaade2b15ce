"""The model and recipe options declared once (cli/recipe_options.py, issue 44 item 1):
`estimate` and `audit` take the same options, and each reaches the Recipe."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.cli.recipe_options import SHARED


def _option_names(command: str) -> set[str]:
    group = typer.main.get_command(app)
    cmd = group.commands[command]  # type: ignore[attr-defined]
    return {p.name for p in cmd.params}


def test_estimate_and_audit_take_every_shared_option() -> None:
    shared = {name for name, _, _ in SHARED}
    for command in ("estimate", "audit"):
        assert shared <= _option_names(command), command
    assert "gpus" in _option_names("estimate") and "gpus" not in _option_names("audit")
    assert "html" in _option_names("audit")


def test_the_quantized_base_flags_reach_the_recipe(tmp_path: pytest.TempPathFactory) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256}
    path = tmp_path / "config.json"  # type: ignore[operator]
    path.write_text(json.dumps(config))
    flags = ["--lora", "--quantize", "fp4", "--no-double-quant", "--quant-compute-dtype",
             "float32", "--no-prepare-kbit", "--seq", "32", "--batch", "2"]
    r = CliRunner().invoke(app, ["estimate", str(path), *flags, "--json", "--no-ops"])
    assert r.exit_code == 0, r.output
    recipe = json.loads(r.stdout[r.stdout.index("{"):])["recipe"]
    assert (recipe["quantize"], recipe["double_quant"], recipe["quant_compute_dtype"],
            recipe["prepare_kbit"], recipe["batch_size"]) == ("fp4", False, "fp32", False, 2)
    # a setting of a quantized base without one: named, with the flag that adds it
    r = CliRunner().invoke(app, ["audit", str(path), "--no-prepare-kbit"])
    assert r.exit_code == 2 and "--no-prepare-kbit describes a quantized base" in r.output
    assert "--quantize nf4" in r.output
