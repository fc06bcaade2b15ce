"""The model and recipe options declared once (cli/recipe_options.py, issue 44 item 1): each
Recipe field's options are in one table, every command that takes a recipe takes them from
it (or says which it does not take, and why), and each reaches the Recipe."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click
import pytest
import typer
from typer.testing import CliRunner

from tilefit.cli import audit, bench, noise, plan, tune
from tilefit.cli.app import app
from tilefit.cli.recipe_options import FIELD_OPTIONS, NOT_OPTIONS, SHARED, WORKLOAD
from tilefit.recipe import Recipe

# each command that takes a recipe, and the shared options it does not take (with why)
COMMANDS: dict[tuple[str, ...], dict[str, str]] = {
    ("estimate",): {}, ("audit",): audit.EXCLUDED, ("plan",): plan.EXCLUDED,
    ("tune",): tune.EXCLUDED, ("noise-scale",): noise.EXCLUDED, ("bench", "step"): bench.EXCLUDED}


def _command(path: tuple[str, ...]) -> click.Command:
    cmd: Any = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd  # type: ignore[no-any-return]


def _option_names(command: str) -> set[str]:
    return {p.name for p in _command((command,)).params if not getattr(p, "hidden", False)}


def test_each_recipe_field_has_its_options_in_the_one_table() -> None:
    fields = [f.name for f in dataclasses.fields(Recipe)]
    assert sorted(fields) == sorted([*FIELD_OPTIONS, *NOT_OPTIONS])  # each once, in one
    assert not set(FIELD_OPTIONS) & set(NOT_OPTIONS)
    assert all(reason for reason in NOT_OPTIONS.values())
    names = [name for name, _, _ in SHARED]
    assert len(names) == len(set(names))  # each option declared once
    flags = [option.param_decls for _, _, option in SHARED]
    assert len(flags) == len(set(flags))
    owned = [name for options in FIELD_OPTIONS.values() for name in options]
    assert len(owned) == len(set(owned))  # an option sets one field
    # every shared option sets a Recipe field, or names the model, its input or the GPU
    assert sorted(names) == sorted([*owned, *WORKLOAD, "gpu"])


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_recipe_command_takes_the_shared_options_or_says_why_not(
        path: tuple[str, ...]) -> None:
    excluded = COMMANDS[path]
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in excluded.values())
    params = {p.name: p for p in _command(path).params}
    for name, _, option in SHARED:
        param = params[name]  # taken, refused (hidden), or the command's own in its place
        hidden = getattr(param, "hidden", False)
        assert hidden == (name in excluded and param.help == option.help), (path, name)
        if name not in excluded:  # the shared declaration itself
            assert param.help == option.help, (path, name)  # type: ignore[attr-defined]
            if isinstance(param, click.Option):
                assert param.opts + param.secondary_opts == [
                    d for decl in option.param_decls for d in decl.split("/")], (path, name)
    # no command declares a shared flag of its own but in place of one it does not take
    shared_flags = {d for _, _, o in SHARED
                    for decl in o.param_decls or () for d in decl.split("/")}
    for param in params.values():
        if param.name not in excluded and param.name not in {n for n, _, _ in SHARED}:
            assert not set(param.opts) & shared_flags, (path, param.name)


def test_estimate_and_audit_take_every_shared_option() -> None:
    shared = {name for name, _, _ in SHARED}
    assert shared <= _option_names("estimate")
    assert shared - set(audit.EXCLUDED) == shared & _option_names("audit")
    assert "gpus" in _option_names("estimate") and "gpus" not in _option_names("audit")
    assert "html" in _option_names("audit")


@pytest.mark.parametrize(("argv", "said"), [
    (["plan", "no-such-model", "--global-batch", "8", "--batch", "4"],
     "tilefit plan does not take --batch: plan chooses the micro-batch itself"),
    (["plan", "no-such-model", "--global-batch", "8", "--precision", "fp32"],
     "tilefit plan does not take --precision: plan chooses the precision itself"),
    (["bench", "step", "no-such-model", "--compile"],
     "tilefit bench step does not take --compile: bench step runs the step eagerly"),
    (["bench", "step", "no-such-model", "--gpu", "h100"],
     "tilefit bench step does not take --gpu: bench step measures the live --device"),
    (["tune", "no-such-model", "--grad-checkpointing"],
     "tilefit tune does not take --grad-checkpointing: tune trains the model as it is built"),
    (["noise-scale", "no-such-model", "--optimizer", "sgd"],
     "tilefit noise-scale does not take --optimizer: noise-scale steps no optimizer"),
    (["audit", "no-such-model", "--gpus", "2"],
     "tilefit audit does not take --gpus: the audit is of one GPU's step"),
])
def test_an_option_a_command_cannot_honour_is_refused_before_the_model_loads(
        argv: list[str], said: str) -> None:
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    assert said in " ".join(r.output.split())
    assert "no-such-model" not in r.output  # refused before the model is looked up


def test_a_command_keeps_its_own_default_for_a_shared_option() -> None:
    params = {p.name: p for p in _command(("bench", "step")).params}
    assert params["batch"].default == 4  # bench step's, on a small device
    assert {p.name: p for p in _command(("estimate",)).params}["batch"].default == 8


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
