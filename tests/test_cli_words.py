"""The library speaks Python, the CLI speaks flags (issue 44, item 6): a fix the library
writes as a Recipe, Lora or Parallelism call is printed by the CLI as the flags that say it."""

from __future__ import annotations

from typer.testing import CliRunner

from tilefit import Recipe
from tilefit.cli.app import app
from tilefit.cli.words import cli_words
from tilefit.errors import TilefitError


def test_a_call_becomes_its_flags() -> None:
    assert cli_words("pass Recipe(batch_size=8)") == "pass --batch 8"
    assert cli_words("Recipe(loss_sync=False)") == "--no-loss-sync"
    assert cli_words("Recipe(quantize='nf4', quant_compute_dtype='bf16')") == \
        "--quantize nf4 --quant-compute-dtype bf16"
    assert cli_words("Lora(targets=('q_proj', 'v_proj'))") == "--lora-targets q_proj,v_proj"
    assert cli_words("Parallelism(world_size=8, strategy='fsdp2')") == \
        "--gpus 8 --strategy fsdp2"
    assert cli_words("Recipe(compile=None), or x") == "drop --compile, or x"
    # a field without a flag stays Python: the CLI cannot say it another way
    assert cli_words("Recipe(zero_grad_to_none=False)") == "Recipe(zero_grad_to_none=False)"
    assert cli_words("call recipe.on(get_device(gpu)) first") == \
        "call recipe.on(get_device(gpu)) first"


def test_python_and_the_shell_each_read_their_own_words() -> None:
    try:
        Recipe(batch_size=0)
    except TilefitError as err:
        assert err.fix == "pass Recipe(batch_size=8)"
    r = CliRunner().invoke(app, ["estimate", "gpt2", "--batch", "0"])
    assert r.exit_code == 2 and "fix:      pass --batch 8" in r.output, r.output
    assert "Recipe(" not in r.output
