"""transformers' mixture-of-experts layers on fake tensors.

transformers 5.x decorates each MoE model's experts class with ``@use_experts_implementation``
(transformers/integrations/moe.py): its forward dispatches on ``config._experts_implementation``
(private) to ``grouped_mm`` (the default: tokens sorted by expert, one ``aten._grouped_mm``
per projection, the experts' rows given by offsets), ``batched_mm`` (each token-slot's expert
weights gathered, one bmm) or ``eager`` (a Python loop over the experts hit). Two things fail
on fake tensors, both answered here:

- ``aten._grouped_mm``'s meta kernel (torch/_meta_registrations.py) accepts bf16 only, while
  the CPU and CUDA kernels take fp32 and fp16 too, through ``_grouped_mm_fallback`` (one mm
  per group; aten/src/ATen/native/GroupedMMUtils.h). Its output for other dtypes is made
  here with the meta kernel's own ``_create_grouped_mm_output_tensor`` (private), the layout
  the real kernels allocate.
- the eager loop asks the data which experts are hit (``nonzero``), whether an index is the
  sentinel (``.item()`` of ``expert_idx == num_experts``) and which tokens each expert has
  (``torch.where``): ``RoutedExperts`` answers them from a routing assumption, between an
  experts module's forward hooks (``begin``/``end``)."""

from __future__ import annotations

import contextlib
import sys
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._meta_registrations import _create_grouped_mm_output_tensor

from tilefit.compat import probes
from tilefit.compat.fake import TorchDispatchMode

# transformers' per-expert fallback ops (transformers/integrations/moe.py): the experts'
# GEMMs where it does not call torch's grouped kernel (under torch.compile with weights that
# are not bf16): the offsets read on the host (``offs.tolist()``, a sync), the outputs
# zero-filled, then one ``torch.mm`` per expert hit (two in the backward), each issued from
# Python (docs/references.md, section 40)
EXPERT_LOOP_OPS = frozenset({"transformers.grouped_mm_fallback.default",
                             "transformers.grouped_mm_fallback_backward.default"})

# transformers' rule on CUDA for torch's grouped GEMM (torch >= 2.9: compute capability 8.0
# or later; transformers/integrations/moe.py, _can_use_grouped_mm); below it, its loop
GROUPED_MM_MIN_CAPABILITY = (8, 0)

# tokens per expert (expert 0 first) of ``routed`` token-slots over ``experts``, at most
# ``cap`` each (the tokens: top-k picks an expert once per token)
CountsFn = Callable[[int, int, int], tuple[int, ...]]

_GROUPED = torch.ops.aten._grouped_mm.default
_NONZERO = torch.ops.aten.nonzero.default
_ITEM = torch.ops.aten._local_scalar_dense.default


def loops_on(capability: tuple[int, int] | None) -> bool:
    """Whether transformers runs its per-expert loop on a CUDA GPU of this compute
    capability in eager mode (None: a CPU target, no)."""
    return capability is not None and capability < GROUPED_MM_MIN_CAPABILITY


@contextlib.contextmanager
def experts_dispatch_for(capability: tuple[int, int] | None) -> Iterator[None]:
    """transformers' choice between torch's grouped GEMM and its per-expert loop
    (EXPERT_LOOP_OPS) as it makes it on the target GPU: the trace runs on CPU fake tensors,
    where its CUDA rule is not asked. Below compute capability 8.0 (V100, T4 and the Turing
    cards) it takes the loop; ``None`` (a CPU target) or 8.0 and later: its own answer. Its
    private ``_can_use_grouped_mm`` is replaced while the step runs."""
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:  # pragma: no cover - transformers without MoE integrations
        hf_moe = None
    if not loops_on(capability):
        yield
        return
    probes.read("transformers")
    if not hasattr(hf_moe, "_can_use_grouped_mm"):
        probes.went_blind("transformers", "its choice between torch's grouped GEMM and its "
                          "per-expert loop before compute capability 8.0 (integrations.moe."
                          "_can_use_grouped_mm): the experts are traced with its answer for "
                          "this CPU")
        yield
        return
    with unittest.mock.patch.object(hf_moe, "_can_use_grouped_mm",
                                    lambda *args, **kwargs: False):
        yield


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``@use_experts_implementation`` made: its __init__ sets
    ``is_concatenated``, ``has_gate`` and ``config`` on each; ``num_experts`` is the class's.
    None found in a model whose modeling module imports that decorator: the probe is blind
    (tilefit.compat.probes)."""
    found = [m for m in model.modules()
             if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")
             and hasattr(m, "num_experts") and hasattr(m, "config")]
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    if not found and any(hasattr(mod, "use_experts_implementation") for mod in modules):
        probes.went_blind("transformers", "the experts modules of this mixture of experts "
                          "(none made by use_experts_implementation was recognised): the "
                          "routing assumption (Recipe(routing=...)) is not applied")
    return found


def experts_implementation(module: nn.Module) -> str:
    """What the experts module runs: ``config._experts_implementation`` (None: eager, its
    own forward)."""
    return str(getattr(module.config, "_experts_implementation", None) or "eager")


def routing_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """(tokens, top_k) from an experts forward's ``(hidden_states, top_k_index,
    top_k_weights)``: ``top_k_index`` is (tokens, top_k)."""
    index = args[1] if len(args) > 1 else kwargs["top_k_index"]
    return int(index.shape[0]), int(index.shape[-1])


def grouped_mm_needs_bf16(args: tuple[Any, ...]) -> bool:
    """Whether the fast grouped kernel runs: both operands bf16 (else torch's fallback)."""
    return all(getattr(a, "dtype", None) == torch.bfloat16 for a in args[:2])


class RoutedExperts(TorchDispatchMode):
    """Below the recorder, above the fake mode: a non-bf16 ``_grouped_mm`` gets its output,
    and inside an eager experts forward the data-dependent ops get the routing's answers."""

    def __init__(self, counts: CountsFn) -> None:
        super().__init__()
        self.counts = counts
        self._hit: list[tuple[int, int]] | None = None  # (expert, tokens) of the experts hit
        self._at = -1  # the loop's iteration: an index into _hit
        self.fallback_grouped = 0  # non-bf16 grouped GEMMs answered
        self.expert_loops = 0  # transformers' per-expert loop ops seen (EXPERT_LOOP_OPS)

    def begin(self, tokens: int, top_k: int, experts: int) -> None:
        """An eager experts forward starts: ``tokens`` x ``top_k`` slots over ``experts``."""
        counts = self.counts(tokens * top_k, experts, tokens)
        self._hit = [(e, c) for e, c in enumerate(counts) if c]
        self._at = -1

    def end(self) -> None:
        self._hit, self._at = None, -1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if str(func) in EXPERT_LOOP_OPS:
            self.expert_loops += 1
        if func is _GROUPED and not grouped_mm_needs_bf16(args):
            self.fallback_grouped += 1
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            return _create_grouped_mm_output_tensor(args[0], args[1], offs,
                                                    kwargs.get("out_dtype"))
        if self._hit is not None:
            answer = self._answer(func, args[0] if args else None)
            if answer is not None:
                return answer
        return func(*args, **kwargs)

    def _answer(self, func: Any, x: Any) -> Any:
        """The eager loop's questions, in its order: ``expert_hit = (...).nonzero()`` (the
        experts hit); per iteration ``expert_idx == self.num_experts`` (a bool: no, the
        next expert), ``expert_mask[expert_idx]`` and ``gate_up_proj[expert_idx]`` (an index:
        that expert's), ``torch.where(expert_mask[expert_idx])`` (its tokens)."""
        hit = self._hit or []
        if func is _NONZERO:
            rows = len(hit) if x.dim() == 1 else hit[self._at][1]
            return torch.empty((rows, x.dim()), dtype=torch.int64, device=x.device)
        if func is _ITEM and x.dtype == torch.bool:
            self._at += 1
            return False
        if func is _ITEM and 0 <= self._at < len(hit):
            return hit[self._at][0]
        return None
