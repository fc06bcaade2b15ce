"""No third-party noise (issue 43, item 6): a default `tilefit estimate` / `audit` / `plan`
writes only tilefit's own lines on stderr (its notes, warnings and errors), nothing of
transformers, bitsandbytes, torchao or torch; `tilefit --verbose` lets the libraries' lines
through. Each CLI run is a fresh process (run_cli), so the libraries' import-time lines are
the ones a user meets; the runs combine cases to stay few."""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from tests.conftest import run_cli
from torch import nn

from tilefit.compat.modules import acyclic_mod_tracker
from tilefit.quiet_imports import (
    IMPORT_TIME_LOGGERS,
    library_output_shown,
    quiet_imports,
    quiet_transformers,
)

# one layer each: the commands run the same code as on two (the audit the same what-ifs and
# findings, the plan the same recipes; each layer's kernel wrappers nest alike), a third
# faster (the Mamba audit ~17 -> ~14 s, the plan ~14 -> ~9.5 s)
MAMBA = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64,
         "num_hidden_layers": 1, "state_size": 8, "vocab_size": 256, "expand": 2,
         "conv_kernel": 4, "time_step_rank": 4}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 256, "max_position_embeddings": 128}
# how tilefit's CLI writes on stderr (cli/common.py's err_console): "note: ...",
# "warning: ...", "error: ...", "wrote FILE"; one line each at the test's terminal width
TILEFITS_OWN = re.compile(r"(note|warning|error): \S|wrote \S")


@pytest.fixture(autouse=True)
def one_line_per_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich wraps stderr at COLUMNS (80 when piped): wide enough, each message is one line
    that starts with tilefit's prefix, and any other line is someone else's."""
    monkeypatch.setenv("COLUMNS", "100000")


def _config(tmp_path: Path, name: str, config: dict[str, object]) -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return str(path)


def _foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if line.strip() and not TILEFITS_OWN.match(line)]


@pytest.mark.parametrize("case", ["qlora-moe", "mamba-gpu-audit-lora", "moe-plan"])
def test_a_default_command_writes_only_tilefits_lines(case: str, tmp_path: Path) -> None:
    mixtral = _config(tmp_path, "mixtral", MIXTRAL)
    args = {
        # bitsandbytes' CPU backend logs on import that it cannot fetch gemm_4bit_forward
        # from the Hub (a CPU with AVX512-BF16); transformers pulls in torchao, which logs its
        # kernel libraries and torch's pytree its Enums; the kernel wrappers of Mixtral's and
        # Mamba's layers nest, which torch's ModTracker warned about
        "qlora-moe": ("estimate", mixtral, "--quantize", "nf4", "--lora", "--seq", "32"),
        # (the reference selective scan's ops grow with the sequence: 16 tokens keep the
        # audit's what-ifs, its compiled ones included, short)
        "mamba-gpu-audit-lora": ("audit", _config(tmp_path, "mamba", MAMBA), "--gpu",
                                 "a100-80gb", "--seq", "16", "--lora", "--lora-targets",
                                 "in_proj,x_proj,dt_proj"),
        "moe-plan": ("plan", mixtral, "--global-batch", "1", "--seq", "32"),
    }[case]
    out = run_cli(*args, timeout_s=300)
    assert out.returncode == 0, out.stderr
    assert _foreign_lines(out.stderr) == [], out.stderr


NOISY_MODEL = '''
import logging
import warnings

from torch import nn


class Noisy(nn.Linear):
    """A model whose forward speaks as the libraries do: through their loggers and warnings."""

    def forward(self, x):
        logging.getLogger("bitsandbytes.cextension").warning("NOISE bitsandbytes logger")
        logging.getLogger("transformers.modeling_utils").warning("NOISE transformers logger")
        warnings.warn("NOISE a library's UserWarning", UserWarning)
        return super().forward(x)


def build():
    return Noisy(32, 32)
'''


def test_verbose_lets_the_libraries_lines_through(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "noisymodel.py").write_text(NOISY_MODEL)
    monkeypatch.setenv("PYTHONPATH",
                       os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    args = ("estimate", "noisymodel:build", "--input-shape", "32", "--gpu", "h100")
    out = run_cli("--verbose", *args, timeout_s=300)
    assert out.returncode == 0, out.stderr
    for line in ("NOISE bitsandbytes logger", "NOISE transformers logger",
                 "UserWarning: NOISE a library's UserWarning"):
        assert line in out.stderr, out.stderr


def test_the_quiet_blocks_leave_the_libraries_alone_under_verbose() -> None:
    from transformers.utils import logging as hf_logging

    log = logging.getLogger(IMPORT_TIME_LOGGERS[0])
    verbosity = hf_logging.get_verbosity()  # WARNING unless TRANSFORMERS_VERBOSITY says
    with quiet_imports(), quiet_transformers():  # tilefit's default
        assert not log.isEnabledFor(logging.WARNING)
        assert hf_logging.get_verbosity() == logging.ERROR
    with library_output_shown(), quiet_imports(), quiet_transformers():  # --verbose
        assert log.isEnabledFor(logging.WARNING)
        assert hf_logging.get_verbosity() == verbosity
    with quiet_imports():  # and silenced again after
        assert not log.isEnabledFor(logging.WARNING)


class _Wrapper(nn.Module):
    """Like a kernel wrapper of transformers' (kernels' Func): a module no model path names
    whose forward calls another of its class."""

    def __init__(self, inner: _Wrapper | None = None) -> None:
        super().__init__()
        self.__dict__["inner"] = inner  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.inner is None else self.inner(x) * 2


def test_nested_unnamed_modules_make_no_tracker_warning() -> None:
    model = nn.Linear(4, 4)
    outer = _Wrapper(_Wrapper())
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acyclic_mod_tracker():
            outer(model(torch.ones(2, 4, requires_grad=True))).sum().backward()
    assert [str(w.message) for w in caught] == []
    assert warnings.formatwarning is formatwarning  # ModTracker replaces it as it warns


def test_simulate_from_python_writes_nothing_of_the_libraries() -> None:
    """`tilefit.simulate` in a fresh process (a notebook's first call): transformers' import,
    which imports torchao, used to log torchao's kernel libraries and pytree's Enum warnings
    on entering the block."""
    _writes_nothing("import torch, tilefit\n"
                    "with tilefit.simulate(gpu='h100', steps=1):\n"
                    "    m = torch.nn.Linear(8, 8).cuda(); o = torch.optim.SGD(m.parameters())\n"
                    "    m(torch.randn(2, 8, device='cuda')).sum().backward(); o.step()\n")


def test_estimate_of_a_module_after_importing_transformers_writes_nothing() -> None:
    """A notebook that imported transformers (top level only) and then estimates its own
    module: Recipe.for_model asks whether the module is a PreTrainedModel, whose lazy import
    loaded transformers' quantizers, and torchao's kernel lines with them."""
    _writes_nothing("import torch, transformers, tilefit\n"
                    "m = torch.nn.Linear(8, 8)\n"
                    "tilefit.estimate(m, torch.randn(2, 8), gpu='h100', "
                    "loss_fn=lambda m, x: m(x).sum())\n")


def _writes_nothing(code: str) -> None:
    """``code`` run in a fresh interpreter succeeds and writes nothing on stderr."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr
