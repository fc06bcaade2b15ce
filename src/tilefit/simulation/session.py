"""``tilefit.simulate``: the user's own training code run as if ``cuda`` were a chosen GPU.

Inside ``with simulate(gpu="h100", steps=3) as sim:`` the code's tensors are fake tensors
(no memory the size of the model is allocated; docs/references.md, section 47), "cuda" is
presented to it (tilefit.simulation.gpu, .devices), every aten op and storage is recorded by
the tracer's Recorder as the target GPU runs it (CUDA autocast's policy and the target's
kernels: tilefit.tracing.autocast), and the loop's phases and steps are read from its own
calls (tilefit.simulation.watch). After ``steps`` optimizer steps the code is stopped; the last
step is costed by the estimator, the same code ``tilefit.estimate`` uses, and ``sim.result``
is the Estimate."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tilefit.compat import probes
from tilefit.compat.accelerate import fresh_accelerate_state
from tilefit.compat.bitsandbytes import quant_state_tensors
from tilefit.compat.fake import FakeTensorMode, missing_fake_op, new_fake_mode
from tilefit.compat.modules import ModulePath
from tilefit.compat.simulated_cuda import (
    fake_parameter_swaps,
    foreach_for_fake_parameters,
    patched,
    presented_device,
)
from tilefit.compat.transformers import gpu_mask_semantics
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate, estimate_trace, overhead_bytes
from tilefit.estimator.cost import CostContext, op_time_s
from tilefit.hardware import Device, get_device
from tilefit.quiet_imports import quiet_fake_errors
from tilefit.recipe import DEFAULT_GPU
from tilefit.simulation.compiled import SimulatedCompiled
from tilefit.simulation.devices import GPU, DevicePlacement
from tilefit.simulation.findings import Findings, build_trace, findings_of, trace_so_far
from tilefit.simulation.gpu import cuda_answers
from tilefit.simulation.pretrained import LoadOnGpu, pretrained_from_config
from tilefit.simulation.ranks import simulated_ranks
from tilefit.simulation.values import BOUND_NOTE, SimulationRecorder
from tilefit.simulation.watch import StepWatch, StopSimulation
from tilefit.tracing.attention import AttentionRouter
from tilefit.tracing.autocast import CudaAutocast
from tilefit.tracing.cpu_kernels import cpu_target_kernels
from tilefit.tracing.errors import no_fake_implementation, where_in_step
from tilefit.tracing.fakes import fake_copy
from tilefit.tracing.records import Trace
from tilefit.tracing.target import Target, resolve_target

DEFAULT_STEPS = 3


@dataclasses.dataclass
class Simulation:
    """A simulation's state while the code runs, and its outcome after the block."""

    device: Device
    steps: int
    result: Estimate | None = None  # the last step's estimate: tilefit.estimate's object
    trace: Trace | None = None
    found: Findings | None = None
    stopped: bool = False  # stopped after ``steps`` optimizer steps (else the code ended)
    # what the code asked torch.save / safetensors to write (of fake tensors): not written
    unwritten: list[str] = dataclasses.field(default_factory=list)
    world_size: int = 1  # the ranks the code ran as rank 0 of
    # the models the code asked from_pretrained for: built from their configs, no weights
    pretrained: list[str] = dataclasses.field(default_factory=list)
    engines: list[str] = dataclasses.field(default_factory=list)  # "ddp" where it built one

    def __repr__(self) -> str:
        """One line; the detail is in the fields."""
        return (f"Simulation(gpu={self.device.name!r}, steps_run="
                f"{self.found.steps_run if self.found else 0}, result={self.result!r})")


class _Readings:
    """What torch.cuda's memory and event queries answer while the code runs."""

    def __init__(self, recorder: SimulationRecorder, device: Device, target: Target) -> None:
        self.recorder, self.device, self.target = recorder, device, target
        self.peak_from = 0
        self.syncs: list[str] = []
        self.sync_at: list[int] = []  # the events at which the code synchronized

    def _timeline(self) -> list[int]:
        """The GPU's live tensor bytes after each event of the record so far."""
        return trace_so_far(self.recorder, self.target).live_bytes_timeline(rounded=False)

    def allocated_bytes(self) -> int:
        return self._timeline()[-1]

    def peak_allocated_bytes(self) -> int:
        """The most bytes alive at once since the last reset."""
        return max(self._timeline()[self.peak_from:])

    def reserved_bytes(self) -> int:
        """What the caching allocator would hold at its peak so far (the allocator model
        replayed over the record: tilefit.estimator.reserved)."""
        from tilefit.estimator.reserved import allocator_config_of, reserved_memory

        tr = trace_so_far(self.recorder, self.target)
        if not tr.storages:
            return 0
        limit = self.device.memory_bytes - overhead_bytes(self.device)
        return reserved_memory(tr, limit, allocator_config_of(tr)).peak_reserved_bytes

    def reset_peak(self) -> None:
        self.peak_from = self.recorder.events

    def now(self) -> int:
        return self.recorder.events

    def elapsed_s(self, start: int, end: int) -> float:
        ctx = CostContext(precision="fp32")
        return sum(op_time_s(op, self.device, ctx) for op in self.recorder.ops[start:end])

    def synchronized(self, what: str) -> None:
        self.syncs.append(what)
        self.sync_at.append(self.recorder.events)


@contextlib.contextmanager
def simulate(gpu: str | Device = DEFAULT_GPU, steps: int = DEFAULT_STEPS,
             gpus: int = 1) -> Iterator[Simulation]:
    """Run the block's training code as if ``cuda`` were ``gpu`` (a catalog name, a spec
    file, a Device; "cpu" for this machine), stopping it after ``steps`` optimizer steps;
    then ``sim.result`` is the estimate of its last (steady) step, ``sim.found`` what the
    code was seen to do (precision, optimizers, clipping, accumulation, models, host
    reads). ``gpus``: the code runs as rank 0 of that many (torchrun's environment, a fake
    process group for init_process_group; DDP: tilefit.simulation.ranks)."""
    _check_gpus(gpus)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TilefitError("steps is the number of optimizer steps to run",
                           expected="an integer of at least 1 (2 or more: the first step "
                           "creates the optimizer state)", given=repr(steps),
                           fix="steps=3")
    target, _ = resolve_target(gpu)
    dev = gpu if isinstance(gpu, Device) else get_device(gpu)  # "cpu": this machine's
    sim = Simulation(dev, steps, world_size=gpus)
    recorder = SimulationRecorder(ModulePath(), "")
    watch = StepWatch(recorder, steps)
    readings = _Readings(recorder, dev, target)
    placement = DevicePlacement(recorder)
    cuda = target.kind == "cuda"
    if cuda:
        _import_before_cuda()
    with contextlib.ExitStack() as stack:
        collected = stack.enter_context(probes.collecting())
        probes.read("torch")
        stack.enter_context(quiet_fake_errors())
        stack.enter_context(_ops_without_fakes_named(recorder))
        stack.enter_context(watch.watching())  # its forward hook before the tracker's
        if cuda:
            stack.enter_context(cuda_answers(dev, readings, gpus))
            stack.enter_context(presented_device(placement.on_gpu, GPU))
            stack.enter_context(foreach_for_fake_parameters())
        stack.enter_context(fresh_accelerate_state())
        mode = new_fake_mode()
        watch.compile_module = lambda m: SimulatedCompiled(m, recorder, mode, cpu=not cuda)
        stack.enter_context(pretrained_from_config(sim.pretrained, _loader(mode, recorder), cuda))
        stack.enter_context(fake_parameter_swaps())
        stack.enter_context(unwritten_saves(sim.unwritten))
        if gpus > 1:
            stack.enter_context(simulated_ranks(gpus, recorder, sim.engines))
        stack.enter_context(mode)
        stack.enter_context(recorder.tracker)
        stack.enter_context(recorder)
        if gpus > 1:  # FSDP2 frees its gathered parameters by resizing their storage
            stack.enter_context(recorder.watching_resizes())
        stack.enter_context(CudaAutocast(None, AttentionRouter(target, recorder)) if cuda
                            else cpu_target_kernels())  # the target's kernels
        stack.enter_context(gpu_mask_semantics(recorder.ones))
        if cuda:  # on a CPU target the code's tensors are where it puts them: this CPU
            stack.enter_context(placement)
        try:
            yield sim
        except StopSimulation:
            sim.stopped = True
        # TF32 for fp32 matmuls, as the code left it (allow_tf32 / set_float32_matmul_precision)
        watch.facts.tf32 = torch.get_float32_matmul_precision() != "highest"
    _finish(sim, recorder, watch, placement, readings, list(collected))


def _loader(mode: FakeTensorMode, recorder: SimulationRecorder) -> LoadOnGpu:
    """A model built on the meta device made fake, its weights (a quantized base's packed
    weights and quantization state) on the GPU, as from_pretrained loads them there."""
    def load(meta: nn.Module) -> nn.Module:
        model = fake_copy(meta, mode)
        tensors = [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]
        recorder.unmark_host(tensors)
        recorder.label(tensors, "parameters")
        return model
    return load


@contextlib.contextmanager
def _ops_without_fakes_named(recorder: SimulationRecorder) -> Iterator[None]:
    """An op the simulation cannot run (no fake implementation) raises tilefit's error,
    naming it and the module that called it."""
    try:
        yield
    except Exception as exc:
        op = missing_fake_op(exc)
        if op is None:
            raise
        raise no_fake_implementation(op, where_in_step(recorder)) from None


def _check_gpus(gpus: int) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise TilefitError("gpus is the number of GPUs the code runs on, as torchrun's "
                           "--nproc-per-node", expected="an integer of at least 1",
                           given=repr(gpus), fix="pass simulate(..., gpus=8)")


@contextlib.contextmanager
def unwritten_saves(unwritten: list[str]) -> Iterator[None]:
    """torch.save and safetensors' save_file write nothing (their tensors are fake: there is
    nothing to write, and the user's files are never touched); each path is listed."""
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", f)
        unwritten.append(str(path))

    def save_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> None:
        unwritten.append(str(filename))

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(torch, {"save": save}))
        if importlib.util.find_spec("safetensors") is not None:
            import safetensors.torch

            stack.enter_context(patched(safetensors.torch, {"save_file": save_file}))
        yield


# libraries that pick a CUDA backend when they are first imported with torch.cuda answering
# that a GPU is there, and then reach for the CUDA runtime a CPU build has not got
# (bitsandbytes: torch._C._cuda_getCurrentRawStream): imported before the GPU is presented,
# they keep their CPU backend; tilefit runs their ops on fake tensors (tilefit.compat)
_CUDA_PROBING = ("bitsandbytes",)


def _import_before_cuda() -> None:
    from tilefit.quiet_imports import quiet_imports

    for name in _CUDA_PROBING:
        if importlib.util.find_spec(name) is not None:
            with quiet_imports():
                importlib.import_module(name)


def _finish(sim: Simulation, recorder: SimulationRecorder, watch: StepWatch,
            placement: DevicePlacement, readings: _Readings, notes: list[str]) -> None:
    if not watch.boundaries:
        raise TilefitError(
            "the code made no optimizer step, so there is no training step to predict",
            expected="a training loop that calls optimizer.step() (or a Trainer's fit)",
            given="no optimizer.step() before the code ended",
            fix="run the training part of the script (check its arguments, e.g. the "
                "number of epochs or max_steps)")
    if recorder.bounded:
        notes.append(BOUND_NOTE.format(ops=", ".join(recorder.bounded)))
    found = findings_of(watch, recorder, placement, readings, sim.stopped, sim.steps)
    tr = build_trace(recorder, watch, readings.target, found, notes, readings.sync_at)
    if sim.world_size > 1:
        tr = dataclasses.replace(tr, world_size=sim.world_size,
                                 strategy=sim.engines[0] if sim.engines else None)
    with torch.no_grad():
        sim.result = estimate_trace(tr, sim.device)
    sim.trace, sim.found = tr, found
