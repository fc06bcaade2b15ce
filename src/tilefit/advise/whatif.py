"""Re-estimating the step with a fix applied, reusing what can be reused.

- A weight-dimension what-if (vocab 50257 -> 50304) rewrites the existing trace: every op whose
  shapes hold the old value gets the new one, its GEMM dims follow, and its bytes and FLOPs are
  scaled by the change in elements; estimate_trace then costs it in milliseconds.
- A precision what-if that only changes how fp32 GEMMs run (tf32) re-costs the same trace.
- What changes shapes non-locally (batch, sequence, hidden size) or memory (optimizer,
  checkpointing) is re-traced, once per distinct recipe/workload (cached).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tilefit.advise.findings import Change
from tilefit.advise.lever import extrapolate, lever_depth, near_the_line, one_side_binds
from tilefit.errors import TilefitError, error_line
from tilefit.estimator import Estimate, estimate_trace
from tilefit.hardware import Device
from tilefit.models import Workload
from tilefit.recipe import Compile, Recipe
from tilefit.tracing.records import GemmShape, OpRecord, Trace

if TYPE_CHECKING:
    import torch.nn as nn


def _swap(shape: tuple[int, ...], old: int, new: int) -> tuple[int, ...]:
    return tuple(new if d == old else d for d in shape)


def swap_gemm_dim(g: GemmShape, old: int, new: int) -> GemmShape:
    """The GEMM with each of M, N, K that equals ``old`` replaced by ``new``."""
    return replace(g, m=new if g.m == old else g.m, n=new if g.n == old else g.n,
                   k=new if g.k == old else g.k)


def _numel(shapes: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in shapes)


def rewrite_op(op: OpRecord, old: int, new: int) -> OpRecord:
    """The op as it would be with dimension ``old`` replaced by ``new`` (unchanged if no
    shape or GEMM of it holds ``old``)."""
    touched = any(old in s for s in op.input_shapes + op.output_shapes) or any(
        old in (g.m, g.n, g.k) for g in op.gemms)
    if not touched:
        return op
    ins = tuple(_swap(s, old, new) for s in op.input_shapes)
    outs = tuple(_swap(s, old, new) for s in op.output_shapes)
    before = _numel(op.input_shapes + op.output_shapes)
    ratio = _numel(ins + outs) / before if before else 1.0
    gemms = tuple(swap_gemm_dim(g, old, new) for g in op.gemms)
    if op.gemms:
        old_work = sum(g.batch * g.m * g.n * g.k for g in op.gemms)
        new_work = sum(g.batch * g.m * g.n * g.k for g in gemms)
        flops = round(op.flops * new_work / old_work) if old_work else op.flops
    else:
        flops = round(op.flops * ratio)
    attention = op.attention
    if attention is not None:
        attention = {k: (new if (k in ("sq", "sk", "d") and v == old) else v)
                     for k, v in attention.items()}
    return replace(op, input_shapes=ins, output_shapes=outs, bytes=round(op.bytes * ratio),
                   flops=flops, gemms=gemms, attention=attention)


def rewrite_dim(tr: Trace, old: int, new: int) -> Trace:
    """The trace with every occurrence of dimension ``old`` replaced by ``new``. Memory
    (storages) is kept: the what-if is for time."""
    return replace(tr, ops=tuple(rewrite_op(op, old, new) for op in tr.ops))


@dataclass
class WhatIf:
    """The audited step plus a cache of re-traces keyed by (workload, recipe)."""

    workload: Workload | None  # None for a traced nn.Module: no re-traces
    recipe: Recipe
    device: Device
    trace: Trace
    estimate: Estimate
    retrace_fn: Callable[[Workload, Recipe], Trace] | None = None
    retraces: int = 0
    # layer path -> module, for fixes written as layer constructors: the audited nn.Module's
    # own, else filled on first use with the workload built on the meta device
    # (rules_dims.module_map)
    named_modules: dict[str, nn.Module] | None = None
    # what-ifs of a deep model traced at two depths and extrapolated (advise.lever)
    lever: bool = True
    _cache: dict[tuple[Workload, Recipe, tuple[tuple[int, int], ...]], Estimate] = field(
        default_factory=dict)
    # the compiled re-traces themselves: one trace serves every compile mode (the modes
    # differ in how the estimator costs the same graphs)
    _compiled: dict[tuple[Workload, Recipe], Trace] = field(default_factory=dict)
    # what the rules could not predict, and why (Audit.notes): nothing is skipped silently
    notes: list[str] = field(default_factory=list)

    def skipped(self, rule: str, what: str, why: BaseException | str) -> None:
        """Note that ``rule`` could not predict ``what``, and why (an error's first line)."""
        reason = why if isinstance(why, str) else error_line(why)
        note = f"{rule}: {what} could not be predicted ({reason})"
        if note not in self.notes:
            self.notes.append(note)

    def try_retrace(self, rule: str, what: str, workload: Workload | None = None,
                    **recipe_changes: Any) -> Estimate | None:
        """retrace(), or None with a note (skipped) where the variant cannot be traced."""
        try:
            return self.retrace(workload, **recipe_changes)
        except TilefitError as err:
            self.skipped(rule, what, err)
            return None

    def try_apply(self, rule: str, what: str, change: Change) -> Estimate | None:
        """apply(), or None with a note (skipped) where the variant cannot be traced."""
        try:
            return self.apply(change)
        except TilefitError as err:
            self.skipped(rule, what, err)
            return None

    def with_dim(self, old: int, new: int) -> Estimate:
        return estimate_trace(rewrite_dim(self.trace, old, new), self.device)

    def with_precision_cost(self, precision: str) -> Estimate:
        return estimate_trace(replace(self.trace, precision=precision), self.device)

    def with_compile_mode(self, mode: str) -> Estimate:
        """The same compiled step in another torch.compile mode (the graphs are the same;
        how the host issues them and the memory they hold differ)."""
        return estimate_trace(replace(self.trace, compile_mode=mode), self.device)

    @property
    def can_retrace(self) -> bool:
        return self.retrace_fn is not None and self.workload is not None

    def retrace(self, workload: Workload | None = None, **recipe_changes: Any) -> Estimate:
        """Trace and estimate the workload (default: the audited one) with recipe changes."""
        if not self.can_retrace:
            raise RuntimeError("no re-trace available for a model given as an nn.Module")
        work = workload if workload is not None else self.workload
        assert work is not None
        return self._estimate(work, replace(self.recipe, **recipe_changes))

    def apply(self, change: Change) -> Estimate:
        """The step re-estimated with ``change`` applied: re-traced with its recipe and
        config fields and sequence length (the audited trace where it has none of them),
        then its weight dimensions rewritten in that trace (TilefitError where the variant
        cannot be built or traced)."""
        if change.retraces:
            if not self.can_retrace:
                raise TilefitError("a model given as an nn.Module is not re-traced",
                                   expected="a catalog name, config.json or factory",
                                   given="an nn.Module", fix="pass its config.json")
            assert self.workload is not None
            work = self.workload
            if change.config:
                work = work.with_config(**dict(change.config))
            if change.seq_len is not None:
                work = work.with_seq_len(change.seq_len)
            return self._estimate(work, replace(self.recipe, **dict(change.recipe)),
                                  change.rewrite)
        tr = self.trace
        for old, new in change.rewrite:
            tr = rewrite_dim(tr, old, new)
        return estimate_trace(tr, self.device)

    def _estimate(self, work: Workload, recipe: Recipe,
                  rewrite: tuple[tuple[int, int], ...] = ()) -> Estimate:
        """A what-if's estimate (cached): a deep model's traced at two shallow depths and
        extrapolated (advise.lever), else, or near the out-of-memory line, traced in full."""
        key = (work, recipe, rewrite)
        if key not in self._cache:
            depth = lever_depth(work) if self.lever else None
            est = None
            if depth is not None and depth.field is not None:
                try:
                    low, high = (self._costed(depth.workload_at(work, n), recipe, rewrite)
                                 for n in depth.traced)
                    if one_side_binds(low[1], high[1]):
                        est = extrapolate((low, high), depth)
                except TilefitError as err:  # it does not build or trace shallower: in full
                    self.skipped("layer lever", f"the step at {depth.layers_text(depth.traced)} "
                                 "layers", err)
                if est is not None and near_the_line(est):
                    est = None
            self._cache[key] = est if est is not None else self._costed(work, recipe,
                                                                        rewrite)[1]
        return self._cache[key]

    def _costed(self, work: Workload, recipe: Recipe,
                rewrite: tuple[tuple[int, int], ...]) -> tuple[Trace, Estimate]:
        """The step traced, its weight dimensions rewritten, and costed."""
        tr = self._trace_of(work, recipe)
        for old, new in rewrite:
            tr = rewrite_dim(tr, old, new)
        return tr, estimate_trace(tr, self.device)

    def _trace_of(self, work: Workload, recipe: Recipe) -> Trace:
        """One re-trace (a compiled one shared by the compile modes), counted."""
        if recipe.compile:
            return self._compiled_trace(work, recipe)
        assert self.retrace_fn is not None
        self.retraces += 1
        return self.retrace_fn(work, recipe)

    def _compiled_trace(self, work: Workload, recipe: Recipe) -> Trace:
        """A compiled re-trace, shared by the compile modes (traced once, in "default")."""
        key = (work, replace(recipe, compile=Compile()))
        if key not in self._compiled:
            assert self.retrace_fn is not None
            self.retraces += 1
            self._compiled[key] = self.retrace_fn(work, key[1])
        return replace(self._compiled[key], compile_mode=recipe.compile_mode)


def gemm_time_with(e: Estimate, swap: Callable[[GemmShape], GemmShape]) -> float:
    """Time of the steady step's GEMM ops with each GEMM shape mapped through ``swap``
    (a quick GEMM-only what-if for batch candidates)."""
    from tilefit.estimator.cost import gemm_time_s

    return sum(gemm_time_s(swap(g), dt, e.device) for _, g, dt in e.gemms())
