"""Where a script's tensors live on the simulated GPU.

Every tensor is a fake tensor on the CPU; which of them the script put on the GPU is kept
here. A tensor made with ``device="cuda"`` (or under ``torch.set_default_device("cuda")``) is
on the GPU; a tensor made without a device is in host memory, as on a GPU machine, and so
is what the ops on host tensors alone make (the Recorder propagates it). ``.cuda()`` /
``.to("cuda")`` of a host tensor is the host-to-device copy: a new GPU tensor; of a GPU
tensor, the tensor itself. ``pin_memory`` is answered as done. The device arguments are
rewritten to the CPU before torch sees them (a CPU build has no CUDA kernels)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tilefit.compat.simulated_cuda import called_from_torch_distributed, inside_torch
from tilefit.simulation.values import SimulationRecorder
from tilefit.tracing.traffic import op_tensors

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)
_MOVES = {"to", "cuda", "cpu", "type"}


def names_gpu(device: Any) -> bool:
    """Whether a device argument names the GPU: "cuda", "cuda:0", torch.device("cuda"), 0."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def names_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":", 1)[0] == "cpu"


class DevicePlacement(TorchFunctionMode):
    """The rewrite of device arguments, and the host or GPU placement of what is made."""

    def __init__(self, recorder: SimulationRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.default_gpu = False  # torch.set_default_device("cuda")
        self.copies_in = 0  # host-to-device copies the script made

    def on_gpu(self, t: torch.Tensor) -> bool:
        return not self.recorder.is_host(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "set_default_device":
            self.default_gpu = names_gpu(args[0] if args else kwargs.get("device"))
            return None
        if name in ("pin_memory", "is_pinned") and args:
            return True if name == "is_pinned" else args[0]
        kwargs.pop("pin_memory", None)
        if name in _MOVES and args and isinstance(args[0], torch.Tensor):
            return self._move(func, name, args, kwargs)
        to_gpu = names_gpu(kwargs.get("device")) or (
            self.default_gpu and kwargs.get("device") is None) or \
            called_from_torch_distributed()  # FSDP2's buffers, on its (CPU) mesh's device
        if names_gpu(kwargs.get("device")):  # "cpu" and "meta" stay as they are
            kwargs["device"] = CPU
        at = self.recorder.events
        with inside_torch():
            out = func(*args, **kwargs)
        if not to_gpu and not self.recorder.in_compiled_node and \
                next(op_tensors((args, kwargs)), None) is None:  # a factory of the code's
            self.recorder.made_on_host(out, since=at)  # (a compiled graph's runs on the GPU)
        return out

    def _move(self, func: Any, name: str, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        """Tensor.to / .cuda / .cpu: where the result lives decides whether it is a copy."""
        t, rest = args[0], list(args[1:])
        to_gpu = name == "cuda" or names_gpu(kwargs.get("device")) or any(
            names_gpu(a) for a in rest)
        to_host = name == "cpu" or names_cpu(kwargs.get("device")) or any(
            names_cpu(a) for a in rest)
        if name == "cuda":
            rest, kwargs = [], {k: v for k, v in kwargs.items() if k == "non_blocking"}
            name, func = "to", torch.Tensor.to
        rest = [CPU if names_gpu(a) else a for a in rest]
        if names_gpu(kwargs.get("device")):
            kwargs["device"] = CPU
        with inside_torch():
            out = func(t, *rest, **kwargs) if name != "cpu" else t
            if to_gpu and not self.on_gpu(t):
                out = self.recorder.copy_to_device(out)
                self.copies_in += 1
                if not isinstance(t, torch.nn.Parameter):  # a module's is labelled later
                    self.recorder.label(out, "inputs")
            elif to_host and self.on_gpu(t):
                out = out.clone() if out is t else out
                self.recorder.mark_host(out)
        return out
