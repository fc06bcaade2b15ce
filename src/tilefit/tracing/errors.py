"""Errors raised inside the traced step or while building its fake model, translated into
a TilefitError that names the op and the module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tilefit.compat.fake import FAKE_ERRORS, missing_fake_op
from tilefit.errors import TilefitError
from tilefit.tracing.recorder import ROOT_CODE, Recorder
from tilefit.vocab import MICRO_PHASES

__all__ = ["USER_CODE_ERRORS", "explain_build_errors", "explain_fake_errors", "first_line",
           "raised_at", "where_in_step"]

USER_CODE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                    AssertionError, NotImplementedError)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def raised_at(exc: BaseException) -> str | None:
    """The last line outside torch that the error passed through: the model's, or the
    library's code that raised it ("peft/tuners/lora/layer.py:2594"), short of the
    site-packages or checkout it is in; None where every frame is torch's."""
    torch_dir = Path(torch.__file__).parent
    # tilefit's own package folder (not any folder named "tilefit": a checkout cloned into
    # git's default folder name, or the user's project, may be called that)
    tilefit_dir = Path(__file__).resolve().parents[1]
    found: tuple[str, int] | None = None
    tb = exc.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        if torch_dir not in path.parents and tilefit_dir not in path.parents:
            found = (str(path), tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    path, line = found
    parts = Path(path).parts
    cut = max((i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")),
              default=len(parts) - 3)
    return "/".join(parts[cut + 1:]) + f":{line}"


def where_in_step(recorder: Recorder) -> str:
    """Where in the step an error happened, in words."""
    if recorder.phase not in MICRO_PHASES:
        return f"the {recorder.phase} step"
    name = recorder.failing_module
    if name == ROOT_CODE:
        return f"the forward of the model itself ({recorder.root_name})"
    return f"module {name!r}" if name else "code outside any module (the loss function?)"


@contextlib.contextmanager
def explain_fake_errors(recorder: Recorder) -> Iterator[None]:
    """Errors raised inside the user's step become a TilefitError naming the op and module
    (an op without a fake implementation: ``no_fake_implementation``'s)."""
    try:
        yield
    except TilefitError:
        raise
    except Exception as exc:
        op = missing_fake_op(exc)
        if op is None:
            _explain_step_error(exc, recorder)
            raise
        raise no_fake_implementation(op, where_in_step(recorder)) from None


def no_fake_implementation(op: str, where: str) -> TilefitError:
    """The error for an op tilefit cannot run on fake tensors: a custom or extension op (a
    CUDA extension's kernel) without a fake implementation to give its outputs' shapes;
    the same for a traced model and a simulated script."""
    return TilefitError(
        f"the code calls {op} in {where}, an op with no fake implementation: tilefit cannot "
        "know the shape of what it returns without running it",
        expected="custom and extension ops registered with a fake (meta) implementation",
        given=f"{op} without one", fix=f"register one beside the op, e.g. "
        f"@torch.library.register_fake({op.split('.')[0]!r}) returning torch.empty_like of "
        "its output's shape; tilefit then costs the op by the bytes it moves")


def _explain_step_error(exc: Exception, recorder: Recorder) -> None:
    """A TilefitError for a fake-tensor or user-code error raised in the step; returns for
    any other (the caller re-raises it)."""
    if isinstance(exc, FAKE_ERRORS):
        func = getattr(exc, "func", None)
        op = str(func) if func is not None else type(exc).__name__
        where = where_in_step(recorder)
        raise TilefitError(
            f"the model cannot run on fake tensors: {op} in {where} needs real values or a "
            "real kernel",
            expected="a training step whose control flow does not depend on tensor values "
            "(no .item(), .tolist(), nonzero() or data-dependent branches) and ops with "
            "fake/meta implementations",
            given=f"{type(exc).__name__} from {op} in {where}",
            fix="move the value-dependent code out of the step (e.g. compute it once before "
            "training), or register a fake implementation for the custom op with "
            "torch.library.register_fake",
        ) from None
    if isinstance(exc, USER_CODE_ERRORS):
        where = where_in_step(recorder)
        at = raised_at(exc)
        raise TilefitError(
            f"one training step of the model failed in {where}: {type(exc).__name__}: "
            f"{first_line(exc)}",
            expected="a model whose forward, loss and backward run on the given batch",
            given=f"{type(exc).__name__} in {where} ({recorder.phase})"
            + (f", raised at {at}" if at else ""),
            fix="check the batch shape (Recipe(batch_size=...); load_workload(..., seq_len=...); "
            "load_workload(..., input_shape=...)) against the model, and run the model once "
            "on a real batch of that shape to see the full error",
        ) from None


@contextlib.contextmanager
def explain_build_errors() -> Iterator[None]:
    """Errors while building the fake model become a TilefitError."""
    try:
        yield
    except TilefitError:
        raise
    except FAKE_ERRORS as exc:
        raise TilefitError(f"the model could not be built on fake tensors: {exc}",
                           expected="a model whose construction needs no real tensor values",
                           given=type(exc).__name__,
                           fix="build the model on the meta device and pass the module") from None
    except USER_CODE_ERRORS as exc:
        raise TilefitError(f"the model could not be built: {type(exc).__name__}: "
                           f"{first_line(exc)}",
                           expected="a model (or factory) that builds without real data",
                           given=type(exc).__name__,
                           fix="build it once in plain PyTorch to see the full error") from None
