"""What the user copies from `plan` is valid as copied: its code and JSON blocks are never
wrapped, on a terminal or in a pipe (issue 46, item 9). Each kind of one-GPU plan's configs
(autocast, pure bf16, 8-bit Adam, LoRA, ZeRO-Offload) printed as the CLI prints them to a
pipe (a console 80 columns wide that is no terminal): each block is there as it is, and
parses. The CLI itself is checked in tests/test_plan.py and tests/test_audit.py, on their
shared traces."""

from __future__ import annotations

import ast
import io
import json

import pytest
from tests.test_plan_configs import EIGHT_BIT, LORA, MIXED, OFFLOAD, PURE

from tilefit.cli.common import TableConsole
from tilefit.planner import configs
from tilefit.report.plan import _print_configs, config_sections


def parses(name: str, text: str) -> None:
    """A block to paste parses: JSON as JSON, the rest as Python."""
    if text.lstrip().startswith(("{", "[")):
        json.loads(text)
    else:
        ast.parse(text, filename=name)


@pytest.mark.parametrize("row", [MIXED, PURE, EIGHT_BIT, LORA, OFFLOAD],
                         ids=["autocast", "pure-bf16", "adam-8bit", "lora", "zero-offload"])
def test_each_block_is_printed_as_it_is_and_parses(row) -> None:  # type: ignore[no-untyped-def]
    cfg = configs.single_gpu_configs(row, "causal-lm")
    out = io.StringIO()
    _print_configs(TableConsole(file=out, width=80, force_terminal=False), cfg)
    printed = out.getvalue()
    sections = config_sections(cfg)
    assert len(sections) >= 4
    for name, _, text in sections:
        assert text in printed, f"{name} is not printed as it is"
        parses(name, text)
    assert max(len(line) for line in printed.splitlines()) > 80  # long lines kept whole
    for name, text in cfg["files"].items():  # what --write-configs writes
        parses(name, text)
