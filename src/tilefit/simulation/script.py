"""``tilefit run SCRIPT``: a user's unmodified training script (or ``-m MODULE``) run under
the simulated GPU (tilefit.simulation.session), with its own arguments, as ``python`` runs it:
``sys.argv`` is the script and its arguments, the script's folder comes first on
``sys.path``, and it runs as ``__main__``. Both are restored after."""

from __future__ import annotations

import contextlib
import dataclasses
import runpy
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from tilefit.compat.fake import missing_fake_op
from tilefit.errors import TilefitError
from tilefit.hardware import Device
from tilefit.recipe import DEFAULT_GPU
from tilefit.simulation.session import DEFAULT_STEPS, Simulation, simulate


class ScriptFailed(Exception):
    """The script raised before its first optimizer step: nothing to predict."""

    def __init__(self, traceback_text: str, error: str) -> None:
        super().__init__(error)
        self.traceback_text = traceback_text  # the script's own traceback
        self.error = error  # its last line


def _check_script(path: str) -> Path:
    """The script's path, after checking that it exists and compiles (a syntax error is
    the user's one-line error, not a traceback from inside runpy)."""
    script = Path(path)
    if not script.is_file():
        raise TilefitError(f"no script at {path}", expected="the path of a Python file",
                           given=path, fix="check the path (tilefit run train.py ARGS...), "
                           "or run a module with -m package.module")
    try:
        compile(script.read_bytes(), str(script), "exec")
    except SyntaxError as exc:
        raise TilefitError(f"the script does not compile: {exc.msg}",
                           expected="a Python file that python can run",
                           given=f"{exc.filename}:{exc.lineno}",
                           fix="fix the syntax error, then run again") from None
    return script


@contextlib.contextmanager
def _as_main(argv: list[str], folder: str | None) -> Iterator[None]:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    if folder is not None:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path


def run_script(script: str | None, args: list[str], *, module: str | None = None,
               gpu: str | Device = DEFAULT_GPU, steps: int = DEFAULT_STEPS,
               gpus: int = 1) -> Simulation:
    """Run ``script`` (or ``module``) with ``args`` under the simulated ``gpu`` (rank 0 of
    ``gpus``) until its ``steps``-th optimizer step; the Simulation holds the estimate of
    the last step."""
    if (script is None) == (module is None):
        raise TilefitError("tilefit run takes a script or a module",
                           expected="tilefit run SCRIPT [ARGS]... or tilefit run -m MODULE "
                           "[ARGS]...", given="both" if script else "neither",
                           fix="name one script, or one module with -m")
    path = _check_script(script) if script is not None else None
    failure: list[str] = []
    try:
        with simulate(gpu=gpu, steps=steps, gpus=gpus) as sim:
            _run(path, module, args, failure)
    except TilefitError:
        if failure:  # the script's own error came first: it is the one to show
            raise ScriptFailed(failure[0], failure[0].strip().splitlines()[-1]) from None
        raise
    if failure:
        assert sim.result is not None
        last = failure[0].strip().splitlines()[-1]
        done = sim.found.steps_run if sim.found is not None else 0
        sim.result = dataclasses.replace(sim.result, warnings=(
            *sim.result.warnings, f"the script raised after {done} optimizer step(s); the "
            f"step shown is its last complete one: {last}"))
    return sim


def _run(path: Path | None, module: str | None, args: list[str], failure: list[str]) -> None:
    """The script as ``python`` runs it; its exception is kept (its traceback as text)."""
    try:
        if path is not None:
            with _as_main([str(path), *args], str(path.resolve().parent)):
                runpy.run_path(str(path), run_name="__main__")
        else:
            assert module is not None
            with _as_main([module, *args], ""):
                runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failure.append(f"SystemExit: {exc.code}")
    except TilefitError:  # what the simulation refuses (FSDP2 in a script): tilefit's error
        raise
    except Exception as exc:  # the user's code: anything it raises is shown as it raised it
        if missing_fake_op(exc) is not None:  # but an op tilefit cannot simulate: named by
            raise  # the simulation, with its module (session.simulate)
        failure.append(traceback.format_exc())
