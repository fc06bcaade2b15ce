"""transformers' optional kernels that a traced step ran as their PyTorch reference code.

Mamba, Mamba-2, their hybrids and the linear-attention models call fused kernels from
packages that are not installed where tilefit traces (mamba-ssm, causal-conv1d,
flash-linear-attention: CUDA builds); transformers then runs its own reference PyTorch code
for them (integrations/hub_kernels.py, ``use_kernel_func_from_hub_with_fallback``), and
that code is what the trace records and the estimate costs. On a GPU machine where the
package is installed, transformers calls the package's kernel instead, which tilefit does
not model: the trace says so (docs/references.md, section 41).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from tilefit.compat.transformers import KernelCall, kernel_distribution, reference_kernels


class KernelFallbacks:
    """Which of transformers' optional kernels the traced step called (each traced as its
    reference PyTorch code)."""

    def __init__(self) -> None:
        self.ran: set[KernelCall] = set()

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator[None]:
        with reference_kernels(model, self.ran):
            yield

    def notes(self, *, cuda: bool) -> list[str]:
        """What the trace assumed, for Trace.warnings (on a CPU target the reference code
        is what runs: the packages' kernels are CUDA or Triton builds)."""
        if not self.ran or not cuda:
            return []
        names = ", ".join(sorted({c.name for c in self.ran}))
        dists = " and ".join(sorted({kernel_distribution(c.package) for c in self.ran}))
        installed = {c.installed for c in self.ran}
        where = ("not installed here" if installed == {False} else
                 "installed here, but their kernels do not run on fake tensors"
                 if installed == {True} else "some installed here; no kernel of theirs runs "
                 "on fake tensors")
        mamba = ("Mamba's selective scan kernel keeps its states out of GPU memory and "
                 "recomputes them in the backward: expect a faster step and a smaller peak "
                 "there" if any(c.package == "mamba_ssm" for c in self.ran)
                 else "expect a faster step there")
        return [f"transformers' reference PyTorch code was traced for {names} ({dists}: "
                f"{where}), and the step is costed as that code runs on the GPU. Where "
                f"{dists} {'is' if ' and ' not in dists else 'are'} installed on the GPU "
                "machine, transformers calls their fused kernels instead, which tilefit does "
                f"not model ({mamba})"]
