"""Tracing a step on another core: a forked process runs the trace and sends its Trace back.

An audit's what-ifs and a plan's sweep points are independent traces; a second core can run
one while this process runs another. The child is a fork of this process (the model
definitions, the imported libraries and the fake-tensor set-up are already here), so it
traces exactly what this process would, and its Trace (a frozen, picklable record) comes back
over a pipe. It is purely a speed-up: where the child fails for any reason (an error in the
step, a crash, a signal), ``Background.result`` returns None and the asker traces in-process,
meeting the same error a serial run meets. Nothing runs in the background where forking is
not safe or not useful: off Linux (macOS forks unsafely), once this process has initialised
CUDA (a forked child cannot use it), inside a daemonic process (it may have no children), on
one usable core, or with ``TILEFIT_JOBS=1``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from tilefit.errors import TilefitError

# how many processes may trace at once (this one included); default: the usable cores
JOBS_ENV = "TILEFIT_JOBS"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def jobs() -> int:
    """Processes that may trace at once: ``TILEFIT_JOBS``, else the usable cores."""
    raw = os.environ.get(JOBS_ENV)
    if raw is None or raw == "":
        return usable_cores()
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise TilefitError(f"{JOBS_ENV} must be a whole number of processes, 1 or more",
                           expected="e.g. TILEFIT_JOBS=1 (no background traces) or 2",
                           given=repr(raw), fix=f"unset {JOBS_ENV}, or set it to 1 or more")
    return value


def background_slots() -> int:
    """How many traces may run in background processes at once (0: none)."""
    if not sys.platform.startswith("linux"):
        return 0
    if multiprocessing.current_process().daemon:
        return 0
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return 0
    return max(0, jobs() - 1)


class Background:
    """One trace running in a forked child; ``result()`` waits for it (None if it failed)."""

    def __init__(self, trace: Callable[[], Any]) -> None:
        ctx = multiprocessing.get_context("fork")
        self._receive, send = ctx.Pipe(duplex=False)
        # what this process has buffered would otherwise be written twice
        sys.stdout.flush()
        sys.stderr.flush()
        self._process = ctx.Process(target=_child, args=(send, trace), daemon=True)
        self._process.start()
        send.close()
        self._done = False
        self._value: Any | None = None

    @property
    def running(self) -> bool:
        """Whether its result is still to be collected (the child may have finished)."""
        return not self._done

    def result(self) -> Any | None:
        """The child's result (the same on every call); None where it raised, crashed or
        was killed."""
        if self._done:
            return self._value
        self._done = True
        try:
            kind, value = self._receive.recv()
        except (EOFError, OSError, ValueError, TypeError, AttributeError):
            kind, value = "failed", None  # died before sending, or sent what cannot load
        finally:
            self._receive.close()
            self._process.join()
        self._value = value if kind == "ok" else None
        return self._value

    def cancel(self) -> None:
        """Stop the child if it still runs (its result is not wanted)."""
        if self._done:
            return
        self._done = True
        self._process.kill()
        self._process.join()
        self._receive.close()


def _child(send: Any, trace: Callable[[], Any]) -> None:
    """In the forked child: trace on one thread, send the result, and leave without running
    this process's exit handlers (they belong to the parent). One thread: the child is one
    core's work, and GNU OpenMP's thread team does not survive a fork, so a library that
    opens a parallel region itself (bitsandbytes' CPU quantize, called while a QLoRA model
    is built) would wait forever at its barrier after a parent ran one with more threads;
    torch.set_num_threads(1) sets the child's OpenMP thread count, so no team is formed."""
    try:
        import torch

        torch.set_num_threads(1)
        message: tuple[str, Any] = ("ok", trace())
    except BaseException:  # the parent re-traces in-process and reports the error itself
        message = ("failed", None)
    try:
        send.send(message)
    finally:
        send.close()
        os._exit(0)
