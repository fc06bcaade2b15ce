"""The host's memory as a plan's second budget: a row whose CPU memory (PlanRow.
host_memory_bytes: ZeRO-Offload's optimizer state on the CPU, a DeepSpeed engine's copies
while it initialises, as DeepSpeed's own estimator counts them, tilefit.estimator.zero) is
over it does not fit, as a row over the GPU's budget does not.

The budget is the training machine's RAM per node: ``PlanSearch(host_memory_bytes=...)``
(``tilefit plan --host-memory``), else the GPU spec file's ``[host] memory_bytes``, else this
machine's RAM (page size x physical pages, POSIX sysconf)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from tilefit.hardware import Device
from tilefit.planner import rank
from tilefit.planner.result import MultiGpuPlan
from tilefit.planner.rows import PlanRow
from tilefit.units import fmt_bytes

GIVEN, SPEC_FILE, MACHINE = "given", "spec file", "this machine"
UNREAD = ("this machine's RAM could not be read (no POSIX sysconf): CPU memory is shown but "
          "not checked; PlanSearch(host_memory_bytes=...) gives the training machine's")


@dataclasses.dataclass(frozen=True)
class HostBudget:
    """The CPU memory per node a plan may use, and where that figure came from (GIVEN,
    SPEC_FILE or MACHINE)."""

    memory_bytes: int
    source: str

    def words(self) -> str:
        """The budget in a sentence's words, with how to change it."""
        gib = fmt_bytes(self.memory_bytes)
        if self.source == GIVEN:
            return f"the {gib} of host memory given (PlanSearch(host_memory_bytes=...))"
        if self.source == SPEC_FILE:
            return f"the GPU spec file's {gib} of host memory (host.memory_bytes)"
        return (f"this machine's {gib} of RAM (PlanSearch(host_memory_bytes=...) sets the "
                "training machine's)")

    def to_dict(self) -> dict[str, object]:
        return {"bytes": self.memory_bytes, "source": self.source}


def machine_memory_bytes() -> int | None:
    """This machine's physical RAM (SC_PAGE_SIZE x SC_PHYS_PAGES); None where the system
    does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def host_budget(given: int | None, device: Device) -> HostBudget | None:
    """``given`` (PlanSearch.host_memory_bytes), else the device's spec file's, else this
    machine's RAM; None where none is known (nothing is then checked)."""
    if given is not None:
        return HostBudget(given, GIVEN)
    if device.host_memory_bytes is not None:
        return HostBudget(device.host_memory_bytes, SPEC_FILE)
    ram = machine_memory_bytes()
    return None if ram is None else HostBudget(ram, MACHINE)


def judged(rows: Sequence[PlanRow], host: HostBudget | None) -> list[PlanRow]:
    """``rows`` with the host budget beside each CPU memory figure (PlanRow.fits_host)."""
    if host is None:
        return list(rows)
    return [r if r.host_memory_bytes is None else
            dataclasses.replace(r, host_budget_bytes=host.memory_bytes) for r in rows]


def dropped_for_host(rows: Sequence[PlanRow], objective: str, allow_change: bool
                     ) -> PlanRow | None:
    """The row that would be chosen were CPU memory not checked, where the host's memory
    rules it out; None where the host changed nothing."""
    if all(r.fits_host for r in rows):
        return None
    free = [dataclasses.replace(r, host_budget_bytes=None) for r in rows]
    would = rank.choose(free, objective, allow_change)
    if would is None:
        return None
    row = rows[next(i for i, r in enumerate(free) if r is would)]
    return None if row.fits_host else row


def engine_words(row: PlanRow) -> str:
    """The engine that needs the row's CPU memory, in words."""
    if row.strategy is None:
        return "ZeRO-Offload"
    offload = " with ZeRO-Offload" if row.offload else ""
    return f"DeepSpeed {row.strategy}{offload} on {row.world_size} GPUs"


def over_host_note(row: PlanRow, host: HostBudget, chosen: PlanRow | None,
                   multi: MultiGpuPlan | None) -> str:
    """The best plan for the GPU, dropped for the host's memory, and what fits instead
    (``chosen``; else the fewest GPUs that fit, ``multi``; else nothing)."""
    assert row.host_memory_bytes is not None
    said = (f"{engine_words(row)} ({row.recipe_label()}, micro-batch {row.micro_batch} x "
            f"{row.accumulation_steps}) fits the GPU but needs "
            f"{fmt_bytes(row.host_memory_bytes)} of CPU memory per node, over "
            f"{host.words()}")
    if chosen is not None:
        return (f"{said}; what fits both: {chosen.recipe_label()}, micro-batch "
                f"{chosen.micro_batch} x {chosen.accumulation_steps}, "
                f"{chosen.samples_per_s:,.2f} samples/s")
    if multi is not None and multi.gpus is not None and multi.best is not None:
        return (f"{said}; nothing else fits one GPU: {multi.gpus} GPUs do "
                f"({multi.best.recipe_label()}, see multi-GPU)")
    return f"{said}; no other plan fits"
