"""A fit trial's memory peaks, overall and per phase window (forward, backward, optimizer),
and tilefit.loop's hooks that feed them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tilefit.loop import Hooks
from tilefit.tuning.simulate import MemoryLimitMode

# tilefit.loop's phases in a fit trial's three peak windows (forward, backward, optimizer);
# the forward's window is entered by the trial itself, before its batch is made
TUNER_WINDOWS = {"backward": "backward", "loss_check": "backward", "scaler": "optimizer",
                 "clip_grad": "optimizer", "optimizer": "optimizer", "zero_grad": "optimizer"}


class PeakWatch:
    """Peaks of one trial, overall and per phase (forward, backward, optimizer)."""

    def __init__(self, mode: MemoryLimitMode | None = None,
                 device: torch.device | None = None) -> None:
        self.mode = mode
        self.device = device
        self.baseline_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.phase_peaks: dict[str, int] = {}
        self._phase: str | None = None

    def phase(self, name: str) -> None:
        """End the current phase (recording its peak) and start ``name``; nothing where
        ``name`` is the current phase (its window goes on)."""
        if (self.mode is None and self.device is None) or name == self._phase:
            return
        if self._phase is not None:
            if self.mode is not None:
                window = self.mode.window_peak_bytes
            else:
                assert self.device is not None
                torch.cuda.synchronize(self.device)
                window = torch.cuda.max_memory_allocated(self.device)
            self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), window)
            self.peak_bytes = max(self.peak_bytes or 0, window)
        self._phase = name
        if self.mode is not None:
            self.mode.reset_window()
        elif self.device is not None and name:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self) -> None:
        self.phase("")
        self._phase = None


def trial_hooks(watch: PeakWatch | None,
                autocast: Callable[[], contextlib.AbstractContextManager[Any]]) -> Hooks:
    """tilefit.loop's hooks for a trial: ``autocast()`` around the forward; the loop's
    phases folded into the watch's three windows (the forward's begins before its batch is
    made, entered by the trial itself: the loader's work is part of it)."""
    if watch is None:
        return Hooks(forward=autocast)

    def phase(name: str) -> None:
        window = TUNER_WINDOWS.get(name)
        if window is not None:
            watch.phase(window)

    return Hooks(phase=phase, forward=autocast)
