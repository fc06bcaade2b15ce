"""``torch.compile(model)`` in the user's script, as Inductor runs it on the simulated GPU.

The compiled module's calls are captured as the tracer captures a compiled step
(tilefit.tracing.compiled): AOTAutograd traces the module's forward and backward jointly
with Inductor's decompositions and partitioner, and the graphs run node by node under the
simulation's recorder, each node carrying Inductor's plan (fused into a kernel, or an extern
kernel; allocated or kept in registers). The capture runs outside the recorder (its tracing
records nothing), under the simulation's fake mode, with the code's autocast as it is at the
call; a new input signature (shapes, dtypes, training, grad mode) is captured again, as
Dynamo recompiles. The graph is the module's whole forward (fullgraph=True): graph breaks are
not predicted; the optimizer step and the loss outside the module stay eager, as they do
under torch.compile(model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tilefit.compat.compile import (
    aot_capture,
    flatten_batch,
    inductor_decompositions,
    inductor_partition_fn,
    inside_optimized_module,
    unflatten_batch,
)
from tilefit.compat.fake import FakeTensorMode, outside_dispatch_modes
from tilefit.compat.simulated_cuda import inside_torch, patched
from tilefit.quiet_imports import quiet_imports
from tilefit.tracing.compiled import GraphCompiler, LossModule


class _Outputs:
    """The compiled call's outputs as AOTAutograd takes them: its tensors, flat; what else
    it returns (and how it nests) is kept to rebuild the output."""

    def __init__(self) -> None:
        self.spec: Any = None
        self.leaves: list[Any] = []

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, ...]:
        args, kwargs = batch
        self.leaves, self.spec = flatten_batch(model(*args, **kwargs))
        return tuple(x for x in self.leaves if isinstance(x, torch.Tensor))


class SimulatedCompiled(nn.Module):
    """What ``torch.compile(model)`` returns under the simulation: the model, its calls run
    as compiled graphs. Attributes not its own are the model's, as on OptimizedModule."""

    def __init__(self, model: nn.Module, recorder: Any, mode: FakeTensorMode, *,
                 cpu: bool = False) -> None:
        super().__init__()
        self._orig_mod = model
        # a tuple, not registered as a submodule: the recorder, the fake mode, the graphs
        # captured by call signature, and whether the target is the CPU (Inductor's C++)
        self._tilefit = (recorder, mode, {}, cpu)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = flatten_batch((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        key = (str(spec), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
               torch.is_grad_enabled(), self._orig_mod.training,
               torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        captured = self._tilefit[2]
        if key not in captured:
            captured[key] = self._capture(leaves, spec, tensors)
        fn, outputs = captured[key]
        with inside_optimized_module():
            outs = iter(fn(*tensors))
        rebuilt = [next(outs) if isinstance(x, torch.Tensor) else x for x in outputs.leaves]
        return unflatten_batch(rebuilt, outputs.spec)

    def _capture(self, leaves: list[Any], spec: Any, tensors: list[torch.Tensor]
                 ) -> tuple[Callable[..., Any], _Outputs]:
        recorder, mode, _, cpu = self._tilefit
        outputs = _Outputs()
        call = LossModule(self._orig_mod, outputs, leaves, spec)
        compiler = GraphCompiler(recorder, cpu=cpu)
        # the capture is torch's own work on this machine: no CUDA here for its RNG state
        with quiet_imports(), outside_dispatch_modes(), mode, inside_torch(), \
                inside_optimized_module(), \
                patched(torch.cuda, {"is_available": lambda: False}):
            fn = aot_capture(call, call.tensors(), fw_compiler=compiler, bw_compiler=compiler,
                             partition_fn=inductor_partition_fn(),
                             decompositions=inductor_decompositions())
        return fn, outputs
