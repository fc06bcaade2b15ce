"""``torch.cuda`` and ``torch.accelerator`` as a script sees them on the simulated GPU: the
device's name, memory, SMs and compute capability from tilefit's catalog entry, memory
statistics from the simulation's record of the script's tensors, events on its predicted
clock."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from tilefit.compat.simulated_cuda import patched
from tilefit.hardware import Device


class Readings(Protocol):
    """What the simulation knows as the script runs (tilefit.simulation.session)."""

    def allocated_bytes(self) -> int: ...
    def peak_allocated_bytes(self) -> int: ...
    def reserved_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def elapsed_s(self, start: int, end: int) -> float: ...
    def now(self) -> int: ...
    def synchronized(self, what: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """``torch.cuda.get_device_properties`` of the simulated GPU: the fields scripts and
    libraries read (name, total_memory, major/minor, multi_processor_count)."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0


def properties(device: Device) -> DeviceProperties:
    cc = device.compute_capability or (0, 0)
    return DeviceProperties(device.display_name, device.memory_bytes, cc[0], cc[1],
                            device.sms)


class SimulatedEvent:
    """``torch.cuda.Event``: ``record`` marks the simulation's clock (the ops issued so far);
    ``elapsed_time`` is the predicted device time between two marks, in milliseconds."""

    readings: Readings  # set by cuda_answers for the simulation's life

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.at: int | None = None

    def record(self, stream: Any = None) -> None:
        self.at = self.readings.now()

    def synchronize(self) -> None:
        self.readings.synchronized("torch.cuda.Event.synchronize()")

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: SimulatedEvent) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return 1e3 * self.readings.elapsed_s(self.at, end.at)


class SimulatedStream:
    """``torch.cuda.Stream`` / ``current_stream()``: one stream; waits are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: SimulatedEvent | None = None) -> SimulatedEvent:
        event = event or SimulatedEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> SimulatedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _memory_stats(readings: Readings) -> dict[str, int]:
    """The keys of torch.cuda.memory_stats() that scripts and loggers read."""
    allocated, reserved = readings.allocated_bytes(), readings.reserved_bytes()
    return {"allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": readings.peak_allocated_bytes(),
            "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved,
            "active_bytes.all.current": allocated, "num_alloc_retries": 0, "num_ooms": 0}


def _constant(value: Any) -> Callable[..., Any]:
    return lambda *args, **kwargs: value


def _cuda_table(device: Device, readings: Readings, world_size: int) -> dict[str, Any]:
    props = properties(device)
    stream = SimulatedStream()
    cc = (props.major, props.minor)

    def mem_get_info(*args: Any) -> tuple[int, int]:
        return device.memory_bytes - readings.allocated_bytes(), device.memory_bytes

    def synchronize(*args: Any) -> None:
        readings.synchronized("torch.cuda.synchronize()")

    return {
        "is_available": _constant(True), "is_initialized": _constant(True),
        "device_count": _constant(world_size), "current_device": _constant(0),
        "set_device": _constant(None), "init": _constant(None), "_lazy_init": _constant(None),
        "get_device_name": _constant(props.name), "get_device_properties": _constant(props),
        "get_device_capability": _constant(cc),
        "get_arch_list": _constant([f"sm_{cc[0]}{cc[1]}"]),
        "is_bf16_supported": _constant(device.supports("bf16")),
        "synchronize": synchronize, "empty_cache": _constant(None),
        "memory_allocated": lambda *a: readings.allocated_bytes(),
        "max_memory_allocated": lambda *a: readings.peak_allocated_bytes(),
        # the allocator model's peak over the record so far: reserved memory is held until
        # empty_cache, so the current figure is taken as the peak's
        "memory_reserved": lambda *a: readings.reserved_bytes(),
        "max_memory_reserved": lambda *a: readings.reserved_bytes(),
        "memory_stats": lambda *a: _memory_stats(readings),
        "reset_peak_memory_stats": lambda *a: readings.reset_peak(),
        "reset_max_memory_allocated": lambda *a: readings.reset_peak(),
        "mem_get_info": mem_get_info,
        "Event": SimulatedEvent, "Stream": SimulatedStream,
        "current_stream": _constant(stream), "default_stream": _constant(stream),
        "stream": lambda s=None: contextlib.nullcontext(),
        "is_current_stream_capturing": _constant(False),
        "manual_seed": _constant(None), "manual_seed_all": _constant(None),
        "seed": _constant(None), "seed_all": _constant(None),
    }


@contextlib.contextmanager
def cuda_answers(device: Device, readings: Readings, world_size: int = 1) -> Iterator[None]:
    """torch.cuda and torch.accelerator answer as ``device`` would, for the block."""
    SimulatedEvent.readings = readings
    table = _cuda_table(device, readings, world_size)
    accelerator = {
        "is_available": _constant(True), "device_count": _constant(world_size),
        "current_accelerator": lambda *a, **k: torch.device("cuda"),
        "current_device_index": _constant(0), "current_device_idx": _constant(0),
        "set_device_index": _constant(None), "set_device_idx": _constant(None),
        "current_stream": table["current_stream"], "synchronize": table["synchronize"],
        "memory_allocated": table["memory_allocated"],
        "max_memory_allocated": table["max_memory_allocated"],
        "reset_peak_memory_stats": table["reset_peak_memory_stats"],
        "empty_cache": _constant(None),
    }
    accelerator = {k: v for k, v in accelerator.items() if hasattr(torch.accelerator, k)}
    with patched(torch.cuda, table), patched(torch.accelerator, accelerator):
        yield
