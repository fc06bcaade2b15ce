"""Optional libraries' import-time log lines, silenced while tilefit imports them.

torchao logs a warning for each of its CUDA kernel libraries that it cannot load (every CPU
machine; tilefit never runs them, it traces on fake tensors), and torch's pytree module one for
each Enum constant torchao registers. transformers imports torchao whenever it is installed
(its quantizers), so without this every estimate would print four lines about a library the
user did not ask for. The loggers' levels are restored afterwards: the user's logging is
theirs.

``quiet_transformers`` likewise silences transformers' own notices while tilefit builds and
traces a model, and ``quiet_fake_errors`` the fake-tensor logger. Inside ``library_output_shown``
(the CLI's ``--verbose``) none of the three silences anything: the libraries' lines reach
stderr as they would without tilefit."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# bitsandbytes: its CPU backend logs that it cannot fetch an optional kernel from the Hub
# ("Failed to load CPU gemm_4bit_forward from kernels-community", bitsandbytes 0.50.2), and
# the kernels package it asks, offline, that it skips the publisher's trust check
IMPORT_TIME_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes", "kernels")

# whether the libraries' own output is shown (library_output_shown); a plain flag, not a
# context variable, so that a thread a library starts sees it too
_SHOWN = {"on": False}


@contextlib.contextmanager
def library_output_shown() -> Iterator[None]:
    """While the block runs, quiet_imports, quiet_fake_errors and quiet_transformers leave
    the libraries' log lines, warnings and progress bars alone (``tilefit --verbose``)."""
    before = _SHOWN["on"]
    _SHOWN["on"] = True
    try:
        yield
    finally:
        _SHOWN["on"] = before


def shown() -> bool:
    """Whether the libraries' own output is shown now (inside ``library_output_shown``)."""
    return _SHOWN["on"]


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Raise the import-time loggers to ERROR for the duration, then restore their levels."""
    if shown():
        yield
        return
    logs = [logging.getLogger(name) for name in IMPORT_TIME_LOGGERS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


# torch logs each fake-tensor op whose meta kernel raises, with its traceback, at ERROR
# (torch/_subclasses/fake_tensor.py: "failed while attempting to run meta for ..."); the
# error itself reaches tilefit, which reports it in its own words or skips the what-if
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


@contextlib.contextmanager
def quiet_fake_errors() -> Iterator[None]:
    """Silence the fake-tensor logger for the duration, then restore its level."""
    if shown():
        yield
        return
    log = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own notices while tilefit builds and traces a model (deprecation
    warnings, "use_cache=True is incompatible with gradient checkpointing") are about
    tilefit's fake copy, not the user's code: silence them for the duration."""
    import warnings

    if shown():
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None
    level = hf_logging.get_verbosity() if hf_logging is not None else None
    bars = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
        if hf_logging is not None:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()  # from_pretrained's "Loading weights" bar
        try:
            yield
        finally:
            if hf_logging is not None and level is not None:
                hf_logging.set_verbosity(level)
            if bars and hf_logging is not None:
                hf_logging.enable_progress_bar()
