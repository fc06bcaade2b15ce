"""transformers' optional kernels that a traced step ran as their PyTorch reference code.

Mamba, Mamba-2, their hybrids and the linear-attention models call fused kernels from
packages that are not installed where tilefit traces (mamba-ssm, causal-conv1d,
flash-linear-attention: CUDA and Triton builds with no fake kernel); transformers then runs
its own reference PyTorch code for them (integrations/hub_kernels.py,
``use_kernel_func_from_hub_with_fallback``), and that code is what the trace records and the
estimate costs. On a GPU machine where the package is installed, transformers calls the
package's kernel instead, which tilefit does not model: the trace says so
(docs/references.md, section 41).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from torch import nn

from tilefit.compat.transformers import KernelCall, kernel_distribution, reference_kernels
from tilefit.tracing.records import ReferenceKernel


class KernelFallbacks:
    """Which of transformers' optional kernels the traced step called, and from which
    module (each traced as its reference PyTorch code)."""

    def __init__(self) -> None:
        self.calls: dict[ReferenceKernel, None] = {}  # in the order first called

    @contextlib.contextmanager
    def watching(self, model: nn.Module, module_now: Callable[[], str]) -> Iterator[None]:
        """While the step runs: each call noted with the module running then."""
        def on_call(call: KernelCall) -> None:
            self.calls.setdefault(ReferenceKernel(call.name, call.package, call.installed,
                                                  module_now()))

        with reference_kernels(model, on_call):
            yield

    @property
    def kernels(self) -> tuple[ReferenceKernel, ...]:
        return tuple(self.calls)


def distributions(kernels: Sequence[ReferenceKernel]) -> list[str]:
    """The kernels' pip distributions, sorted: ["causal-conv1d", "mamba-ssm"]."""
    return sorted({kernel_distribution(k.package) for k in kernels})


def reference_note(kernels: Sequence[ReferenceKernel], *, cuda: bool) -> list[str]:
    """What the trace assumed, for Trace.warnings (on a CPU target the reference code is
    what runs: the packages' kernels are CUDA or Triton builds)."""
    if not kernels or not cuda:
        return []
    names = ", ".join(sorted({k.name for k in kernels}))
    dists = " and ".join(distributions(kernels))
    installed = {k.installed for k in kernels}
    where = ("not installed here" if installed == {False} else
             "installed here, but their kernels do not run on fake tensors"
             if installed == {True} else "some installed here; no kernel of theirs runs on "
             "fake tensors")
    mamba = ("Mamba's selective scan kernel keeps its states out of GPU memory and "
             "recomputes them in the backward: expect a faster step and a smaller peak there"
             if any(k.package == "mamba_ssm" for k in kernels) else "expect a faster step "
             "there")
    are = "is" if " and " not in dists else "are"
    return [f"transformers' reference PyTorch code was traced for {names} ({dists}: "
            f"{where}), and the step is costed as that code runs on the GPU. Where {dists} "
            f"{are} installed on the GPU machine, transformers calls their fused kernels "
            f"instead, which tilefit does not model ({mamba})"]
