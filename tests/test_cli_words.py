"""The library speaks Python, the CLI speaks flags (issue 44, item 6): the library's errors name
Recipe fields and Python calls; the CLI prints each as the flags of the command that raised
it."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import tilefit
from tilefit import Compile, Lora, Recipe
from tilefit.cli.app import app
from tilefit.cli.words import KEYWORDS, all_options, cli_words, commands
from tilefit.errors import TilefitError

SRC = Path(__file__).resolve().parents[1] / "src" / "tilefit"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SHELL = re.compile(r"`[^`]*`")  # a command to run in a shell (`tilefit gpus`): the same for both
# The library's errors that keep a flag, each with why.
CLI_ONLY = {
    "bench/": "run only by `tilefit bench` (only cli/ imports bench.step, sweeps and timing; "
              "report.plots imports the SweepRow type): --device, --sweep, --dtype are its own",
    "calibrate/": "run only by `tilefit calibrate` and `tilefit bench` (only cli/ and bench/ "
                  "import calibrate.live): --device cpu|cuda is theirs",
    "simulation/session.py": "torchrun's --nproc-per-node, which gpus= mirrors: torchrun's "
                             "flag, not tilefit's",
}


def _text(node: ast.expr) -> str | None:
    """A string constant or an f-string (its fields as {}), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _error_strings(tree: ast.Module) -> list[tuple[int, str]]:
    """Every string of each function that raises a TilefitError (but its docstring), and the
    module's constants that a TilefitError call names (PLAN_FIX)."""
    constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
    found: list[tuple[int, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", "")) == "TilefitError"]
        if not calls:
            continue
        doc = fn.body[0].value if isinstance(fn.body[0], ast.Expr) else None
        inner = {id(v) for n in ast.walk(fn) if isinstance(n, ast.JoinedStr) for v in n.values}
        found += [(n.lineno, text) for n in ast.walk(fn) if n is not doc and id(n) not in inner
                  and (text := _text(n)) is not None]  # type: ignore[arg-type]
        named = {n.id for c in calls for n in ast.walk(c) if isinstance(n, ast.Name)}
        found += [(v.lineno, text) for name, v in constants.items()
                  if name in named and (text := _text(v)) is not None]
    return found


def test_the_library_errors_name_no_flag() -> None:
    """(a) No fix, expected, given or problem of a TilefitError outside cli/ names a flag."""
    flagged = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where.startswith("cli/") or any(where.startswith(k) for k in CLI_ONLY):
            continue
        for line, text in _error_strings(ast.parse(path.read_text())):
            flags = FLAG.findall(SHELL.sub("", text))
            if flags:
                flagged.append(f"{where}:{line}: {flags}")
    assert not flagged, "\n".join(flagged)


# The library's other texts (notes, warnings, findings, reasons) that keep a flag: each file's
# flags, and why they are not tilefit's Python users' words.
FLAGS_KEPT: dict[str, tuple[set[str], str]] = {
    "planner/configs.py": ({"--nproc-per-node", "--num", "--config"},
                           "the launch lines of the configs it writes: torchrun's, deepspeed's "
                           "and accelerate's own flags"),
    "planner/launch.py": ({"--nproc-per-node", "--steps", "--record", "--config"},
                          "the training script it writes (its own argparse flags) and its "
                          "torchrun or accelerate launch line"),
    "planner/launch_deepspeed.py": ({"--nproc-per-node", "--steps", "--record", "--ds-config"},
                                    "the DeepSpeed script it writes (its own argparse flags) "
                                    "and its torchrun launch line"),
    "report/plan.py": ({"--write-configs", "--top", "--json"},
                       "print_plan is the CLI's terminal plan, and config_sections' aside is "
                       "shown there and on the CLI's --html page only: the plan command's "
                       "flags"),
    "tuning/diagnose.py": ({"--gpu", "--global-batch", "--allow-optimizer-change",
                            "--allow-peft"},
                           "PLAN_COMMAND, a shell command printed only in backticks (PLAN_FIX)"),
}


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the module's, classes' and functions' docstrings (read, never printed)."""
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}


def _flags_in_strings(source: str) -> list[tuple[int, str]]:
    """Each flag named by a string of ``source`` (an f-string's fields as {}), but in its
    docstrings and in a shell command in backticks."""
    tree = ast.parse(source)
    skip = _docstrings(tree) | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)
                                for v in n.values}
    return [(n.lineno, flag) for n in ast.walk(tree) if id(n) not in skip
            and (text := _text(n)) is not None  # type: ignore[arg-type]
            for flag in FLAG.findall(SHELL.sub("", text))]


def test_the_library_notes_name_no_flag() -> None:
    """No string of a library module outside cli/ (a note, a warning, a finding, a reason)
    names a flag: the CLI prints the library's Python calls as its flags (cli.common.say),
    the Python user reads them as written. FLAGS_KEPT says which stay, and why."""
    flagged = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where.startswith("cli/") or any(where.startswith(k) for k in CLI_ONLY):
            continue
        kept = FLAGS_KEPT.get(where, (set(), ""))[0]
        flagged += [f"{where}:{line}: {flag}" for line, flag in
                    _flags_in_strings(path.read_text()) if flag not in kept]
    assert not flagged, "\n".join(flagged)


def test_the_notes_scan_sees_a_flag_but_not_in_a_docstring_or_a_shell_command() -> None:
    source = '''
"""The module's --doc."""
NOTE = "pass --allow-peft"
def note(x):
    """Its --doc too."""
    return [f"--seq {x}", "run `tilefit plan --gpu h100`"]
'''
    assert _flags_in_strings(source) == [(3, "--allow-peft"), (6, "--seq")]


def test_the_scan_sees_a_flag() -> None:
    """The scan above catches a flag in a fix, in an f-string and in a dict of fixes."""
    source = '''
def check(x):
    fix = {"a": "pass --gpus 2"}[x]
    raise TilefitError("p", expected=f"--seq {x}", fix=fix)
'''
    texts = [t for _, t in _error_strings(ast.parse(source))]
    assert [f for t in texts for f in FLAG.findall(t)] == ["--gpus", "--seq"]


def test_a_call_becomes_its_flags() -> None:
    assert cli_words("pass Recipe(batch_size=8)") == "pass --batch 8"
    assert cli_words("Recipe(loss_sync=False)") == "--no-loss-sync"
    assert cli_words("Recipe(quantize='nf4', quant_compute_dtype='bf16')") == \
        "--quantize nf4 --quant-compute-dtype bf16"
    assert cli_words("Lora(targets=('q_proj', 'v_proj'))") == "--lora-targets q_proj,v_proj"
    assert cli_words("Parallelism(world_size=8, strategy='fsdp2')") == \
        "--gpus 8 --strategy fsdp2"
    assert cli_words("Recipe(compile=None), or x") == "drop --compile, or x"
    # nested parts: the part's own flag first (--lora, --compile)
    assert cli_words("Recipe(lora=Lora(rank=8), compile=Compile(mode='reduce-overhead'))") \
        == "--lora --lora-rank 8 --compile --compile-mode reduce-overhead"
    # the public functions' keywords, and a size in bytes as the command line reads it
    assert cli_words("pass load_workload(..., seq_len=1024), or x") == "pass --seq 1024, or x"
    assert cli_words("tilefit.estimate(..., gpu='h100')") == "--gpu h100"
    assert cli_words("tune(..., search=TuneSearch(memory_limit_bytes=16 * 2**30))") == \
        "--memory-limit 16GiB"
    assert cli_words("Recipe(max_grad_norm=None)") == "--max-grad-norm none"
    assert cli_words("Lora(targets=...)") == "--lora-targets TARGETS"
    assert cli_words("one of these: estimate(..., gpu=...)") == "one of these: --gpu GPU"
    # a field without a flag stays Python: the CLI cannot say it another way
    assert cli_words("Recipe(zero_grad_to_none=False)") == "Recipe(zero_grad_to_none=False)"
    assert cli_words("call recipe.on(get_device(gpu)) first") == \
        "call recipe.on(get_device(gpu)) first"


def _command(name: str) -> Any:
    return next(c for c in commands() if c.name == name)


def test_a_call_stays_python_where_the_command_lacks_a_flag() -> None:
    # plan has --global-batch, not --batch; estimate has --batch
    assert cli_words("Recipe(batch_size=8)", _command("plan")) == "Recipe(batch_size=8)"
    assert cli_words("Recipe(batch_size=8)", _command("estimate")) == "--batch 8"
    assert cli_words("PlanSearch(allow_lora=True)", _command("plan")) == "--allow-peft"


def test_every_keyword_has_a_flag_in_the_cli() -> None:
    options = all_options()
    missing = [f"{part}({k}=)" for part, keywords in KEYWORDS.items()
               for k, parameter in keywords.items() if parameter not in options]
    assert not missing


def _python_error(call: Callable[[], object]) -> TilefitError:
    with pytest.raises(TilefitError) as err:
        call()
    return err.value


def _cli_error(args: list[str]) -> str:
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


def _declared(command: str) -> set[str]:
    return {o for p in _command(command).params for o in (*p.opts, *p.secondary_opts)}


CASES = [  # (the Python call, what it names; the same mistake on the command line, its flags)
    ("bad precision", lambda: Recipe(precision="bf17"), "Recipe(precision='bf16-mixed')",
     ["estimate", "gpt2", "--precision", "bf17"], "--precision bf16-mixed"),
    ("ambiguous GPU", lambda: tilefit.get_device("a100"), "estimate(..., gpu='a100-40gb')",
     ["estimate", "gpt2", "--gpu", "a100"], "--gpu a100-40gb"),
    ("too long a sequence", lambda: tilefit.load_workload("gpt2", seq_len=5000),
     "load_workload(..., seq_len=1024)", ["estimate", "gpt2", "--seq", "5000"], "--seq 1024"),
    ("LoRA without a target", lambda: Lora(targets=()), "Lora(targets=('q_proj', 'v_proj'))",
     ["estimate", "gpt2", "--lora", "--lora-targets", ","], "--lora-targets q_proj,v_proj"),
    ("a quantized base without LoRA", lambda: Recipe(quantize="nf4"), "Recipe(lora=True)",
     ["estimate", "gpt2", "--quantize", "nf4"], "pass --lora"),
    ("reduce-overhead on the CPU",
     lambda: tilefit.estimate("gpt2", gpu="cpu",
                              recipe=Recipe(compile=Compile(mode="reduce-overhead"))),
     "estimate(..., gpu='h100')",
     ["estimate", "gpt2", "--gpu", "cpu", "--compile", "--compile-mode", "reduce-overhead"],
     "--gpu h100, or --compile --compile-mode default"),
]


@pytest.mark.parametrize(("python", "says", "args", "flags"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_python_and_the_shell_each_read_their_own_words(
        python: Callable[[], object], says: str, args: list[str], flags: str) -> None:
    """(b) The Python API's error names the Python words; the CLI's for the same mistake
    names the flags, each a flag of the command run, and no Python call."""
    err = _python_error(python)
    assert says in err.message, err.message
    assert not FLAG.findall(SHELL.sub("", err.message)), err.message
    out = _cli_error(args)
    assert flags in out, out
    assert not re.search(r"\b(Recipe|Lora|Parallelism|Compile|load_workload|estimate)\(", out)
    assert set(FLAG.findall(SHELL.sub("", out))) <= _declared(args[0]), out


def test_batch_size_in_both_words() -> None:
    assert _python_error(lambda: Recipe(batch_size=0)).fix == "pass Recipe(batch_size=8)"
    out = _cli_error(["estimate", "gpt2", "--batch", "0"])
    assert "fix: pass --batch 8" in out and "Recipe(" not in out


def test_a_tensor_batch_without_loss_fn_is_named_before_tracing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(c) A plain module's Tensor batch without loss_fn: the error names the Tensor the user
    gave (not the FakeTensor tracing makes of it) and the loss_fn to pass, before tracing."""
    import tilefit.tracing.step as step

    def no_trace(*_: object, **__: object) -> None:
        raise AssertionError("traced before checking the batch")

    monkeypatch.setattr(step, "_trace", no_trace)
    err = _python_error(lambda: tilefit.estimate(nn.Linear(4, 4), torch.randn(2, 4),
                                                 gpu="a100-80gb"))
    assert err.given == "a Tensor of shape (2, 4) as the batch, and no loss_fn"
    assert "FakeTensor" not in err.message
    assert (err.fix or "").startswith("pass loss_fn=lambda model, batch: ...")
    pair = _python_error(lambda: tilefit.estimate(
        nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4)), gpu="a100-80gb"))
    assert pair.given == "a tuple of 2: Tensor (2, 4), Tensor (2, 4) as the batch, and no loss_fn"
    assert "criterion(model(batch[0]), batch[1])" in (pair.fix or "")


def test_a_compiled_estimates_note_in_both_words() -> None:
    """An estimate's note (Estimate.warnings) names Compile(graph_breaks=True) from Python;
    the CLI's estimate prints it as --graph-breaks, the flag of the command run."""
    from tests.fixtures.tiny_models import mlp

    est = tilefit.estimate(mlp(), torch.randn(4, 32), gpu="a100-80gb",
                           loss_fn=lambda model, x: model(x).pow(2).mean(),
                           recipe=Recipe(precision="fp32", compile=True))
    python = "graph breaks are not looked for (Compile(graph_breaks=True) runs Dynamo"
    assert any(python in w for w in est.warnings), est.warnings
    r = CliRunner().invoke(app, ["estimate", "tests.fixtures.tiny_models:mlp",
                                 "--input-shape", "32", "--gpu", "a100-80gb", "--precision",
                                 "fp32", "--compile"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "graph breaks are not looked for (--graph-breaks runs Dynamo" in out
    assert "Compile(" not in out
