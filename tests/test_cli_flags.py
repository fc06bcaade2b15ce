"""Every command-line flag that tilefit's messages name is a flag tilefit's CLI has.

Error messages, help texts and footers tell people what to type; a flag that does not exist
(``--seq-len`` where the option is ``--seq``) sends them to an error. The flags are collected
from every string literal under src/tilefit (docstrings included) and checked against the
options of every command of the typer app.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import typer

from tilefit.cli.app import app

SRC = Path(__file__).resolve().parents[1] / "src" / "tilefit"
# A flag: two dashes and a lowercase word, not preceded by a word character or a dash (so
# "a--b" and "---" are not flags). Underscores are included so that another program's
# --nproc_per_node is read whole, not as --nproc.
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")

# Flags of other programs that tilefit's generated configs and commands name.
OTHER_PROGRAMS = {
    "--config_file",  # accelerate launch --config_file accelerate.yaml (planner/configs.py)
    "--nproc-per-node",  # torchrun --nproc-per-node N (planner/configs.py, launch.py)
    "--record",  # the torchrun script's own flag (planner/launch.py)
    "--ds-config",  # the DeepSpeed script's own flag (planner/launch_deepspeed.py)
    "--num_gpus",  # deepspeed --num_gpus 1 train.py, the offload snippet's launch (configs.py)
}


def cli_options() -> set[str]:
    """Every option string (``--gpu``, and ``--no-ops`` of ``--ops/--no-ops``) of every
    command and subcommand of the app."""
    found: set[str] = set()

    def walk(command: Any) -> None:
        for param in command.params:
            found.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    return found


def flags_in_source() -> dict[str, set[str]]:
    """flag -> the files whose string literals name it."""
    out: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in FLAG.findall(node.value):
                    out.setdefault(flag, set()).add(str(path.relative_to(SRC)))
    return out


def test_the_collectors_see_the_cli_and_the_messages() -> None:
    options = cli_options()
    # options of several commands, a negative flag, and not the old spelling
    assert {"--seq", "--batch", "--memory-limit", "--in", "--no-ops", "--gpu"} <= options
    assert "--seq-len" not in options and "--batch-size" not in options
    named = flags_in_source()
    assert "cli/tune.py" in named["--memory-limit"]
    assert FLAG.findall("torchrun --nproc_per_node 2 a--b ---x") == ["--nproc_per_node"]


def test_every_flag_named_in_a_string_is_an_option_of_some_command() -> None:
    options = cli_options()
    named = flags_in_source()
    unknown = {flag: sorted(files) for flag, files in named.items()
               if flag not in options and flag not in OTHER_PROGRAMS}
    assert unknown == {}, f"flags named in messages that no tilefit command has: {unknown}"
    # the allow-list holds only flags that are really named, and none of tilefit's own
    assert set(named) >= OTHER_PROGRAMS
    assert not OTHER_PROGRAMS & options
