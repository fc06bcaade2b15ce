"""The planner's state while it searches: the sweeps traced so far, their rows, the notes and
the trace count. ``PlanState`` owns it: the search adds recipes (``add``), rows swept
elsewhere (``add_rows``) and traces spent elsewhere (``count``); nothing sets its fields
from outside."""

from __future__ import annotations

import dataclasses

from tilefit.estimator.offload import OffloadLink, offload_peak_bytes, offload_step_time_s
from tilefit.hardware import Device
from tilefit.models import Workload
from tilefit.models.hf import refuses_sdpa
from tilefit.planner import multiplan, notes, space
from tilefit.planner.affine import SweepModel
from tilefit.planner.host import HostBudget, judged
from tilefit.planner.result import Confirmation
from tilefit.planner.rows import PlanRow, recipe_label
from tilefit.planner.search import (
    Depth,
    half_parameter_bytes,
    point_step,
    row_from,
    safe_sweep,
    sample_from,
    state_over,
    trace_step,
)
from tilefit.recipe import Recipe
from tilefit.tracing.kernels import reference_note
from tilefit.tracing.workload_traces import prefetch
from tilefit.vocab import FUSED_IMPLEMENTATION, parse_precision


def state_kind(spec: Recipe) -> tuple[object, ...]:
    """What decides a one-GPU recipe's model state (parameters, gradients, optimizer state):
    the weights' dtype, the update (an optimizer and its fused kernel keep the same state),
    the adapters and the quantized base. Attention, checkpointing, the fused loss, compile
    and the autocast dtype change activations only."""
    return (parse_precision(spec.precision).param_dtype,
            FUSED_IMPLEMENTATION.get(spec.optimizer, spec.optimizer), spec.lora, spec.quantize)


# the Recipe fields the planner varies; every other field is the user's, in every row and
# every config it writes (tests/test_plan_keeps_the_recipe.py walks the fields)
SEARCHED_FIELDS = frozenset({"batch_size", "precision", "optimizer", "grad_checkpointing",
                             "accumulation_steps", "attention", "parallel", "lora",
                             "quantize", "notes"})


class PlanState:
    """The search's state: sweeps traced so far, rows, notes, the trace count, for one GPU or
    ``world_size`` GPUs (rows per GPU; the sweep's depth is then multiplan.multi_depth's)."""

    def __init__(self, work: Workload, device: Device, global_batch: int, budget: int,
                 optimizer: str, depth: Depth, link: OffloadLink,
                 user: Recipe | None = None, world_size: int = 1,
                 host: HostBudget | None = None) -> None:
        self.work, self.device, self.global_batch = work, device, global_batch
        self.budget, self.optimizer, self.link = budget, optimizer, link
        self.host = host  # the CPU memory per node each row's must fit (planner.host)
        self.world_size = world_size
        self.depth = depth if world_size == 1 else multiplan.multi_depth(depth)
        # what every recipe keeps of the user's: every field the search does not vary
        # (SEARCHED_FIELDS; the fused loss and torch.compile may also be proposed)
        self.user = user or Recipe()
        friendly, others = space.micro_batch_candidates(global_batch)
        self.micro_batches = sorted(friendly + others)
        self.sweeps: dict[tuple[Recipe, bool], SweepModel] = {}
        self.tried: set[tuple[Recipe, bool]] = set()  # recipes swept (or that failed)
        # model states (state_kind) over the budget, with their bytes at full depth, and
        # the recipes left untraced because they keep one of them
        self.state_over: dict[tuple[object, ...], float] = {}
        self.untraced: list[Recipe] = []
        self.rows: list[PlanRow] = []
        self.notes: list[str] = []
        self.traces = 0
        # a Hugging Face class that refuses SDPA (Mamba, BLOOM, Gemma 2) runs its own
        # attention ("auto": eager where it has any): its recipes say so, and the eager
        # recipe is that one
        self.sdpa_refused = work.config is not None and not work.is_factory and \
            refuses_sdpa(work.config, work.task)

    def with_user(self, spec: Recipe) -> Recipe:
        """The recipe with every field of the user's that the search does not vary (their
        loop: clipping, loss read, how gradients are cleared; the allocator's settings; a
        mixture of experts' routing), the fused loss and torch.compile where either asks
        for them, as it is traced and keyed; "auto" attention for a class that refuses
        SDPA."""
        user = self.user
        attention = "auto" if self.sdpa_refused and spec.attention in ("sdpa", "eager") \
            else spec.attention
        carried = {f.name: getattr(user, f.name) for f in dataclasses.fields(Recipe)
                   if f.name not in SEARCHED_FIELDS}
        return dataclasses.replace(spec, **{**carried, "fused_ce": user.fused_ce or spec.fused_ce,
                                            "compile": user.compile or spec.compile,
                                            "attention": attention})

    def add(self, spec: Recipe, *, offload: bool = False) -> None:
        """Sweep ``spec`` (with the user's loop settings) over the micro-batches: its rows."""
        if (self.user.fused_ce or spec.fused_ce) and (self.user.compile or spec.compile):
            if notes.FUSED_CE_UNDER_COMPILE not in self.notes:
                self.notes.append(notes.FUSED_CE_UNDER_COMPILE)
            return
        spec = self.with_user(spec)
        if (spec, offload) in self.tried:  # the user's flags can make two recipes one
            return
        self.tried.add((spec, offload))
        kind = None if offload else state_kind(spec)
        if kind in self.state_over:
            self.untraced.append(spec)  # the same model state as a recipe over the budget
            return
        model = self._sweep(spec, self.notes, prune=kind is not None)
        if model is None and self.depth.lever and not self.sweeps:
            # the model may not build with fewer layers (per-layer config lists): trace it
            # at full depth instead
            self.notes.append(notes.FULL_DEPTH)
            self.depth = self.depth.in_full()
            model = self._sweep(spec, self.notes, prune=kind is not None)
        if model is None:
            return
        self.sweeps[(spec, offload)] = model
        over = None if kind is None else state_over(model, self.depth, self.budget)
        if over is not None:
            self.state_over[kind] = over
        # a sweep stopped at its smallest micro-batch (search.sweep) has that row alone
        stopped = over is not None and len({s.micro_batch for s in model.samples}) == 1
        self.rows.extend(self._rows(spec, model, offload, stopped=stopped))

    def state_note(self) -> str | None:
        """What was traced no further, or not at all, because its model state alone is over
        the budget (notes.state_over_budget); None where nothing was."""
        if not self.state_over:
            return None
        states = {f"{dtype} weights, {opt}" + (" with adapters" if lora else "")
                  + (f" on a {q} base" if q else ""): b
                  for (dtype, opt, lora, q), b in self.state_over.items()}
        return notes.state_over_budget(states, [recipe_label(r) for r in self.untraced],
                                       self.budget)

    def probe(self, spec: Recipe) -> list[PlanRow]:
        """``spec``'s rows (with the user's loop settings), traced but kept out of the plan:
        a note's evidence (what LoRA would need when --allow-peft was not given)."""
        spec = self.with_user(spec)
        if spec.fused_ce and spec.compile:
            return []
        model = self._sweep(spec, [])
        return [] if model is None else self._rows(spec, model, offload=False)

    def _sweep(self, spec: Recipe, said: list[str], *, prune: bool = False
               ) -> SweepModel | None:
        """``spec`` traced at the sweep's points (counted), or None with a note in ``said``;
        ``prune``: no further than its smallest micro-batch where its model state is over
        the budget (search.sweep)."""
        model = safe_sweep(self.work, spec, self.micro_batches, self.depth, self.device, said,
                           state_budget=self.budget if prune else None)
        self.traces += len(model.samples) if model is not None else len(self.depth.traced) \
            * len({min(self.micro_batches), max(self.micro_batches)})
        return model

    def _rows(self, spec: Recipe, model: SweepModel, offload: bool, *,
              stopped: bool = False) -> list[PlanRow]:
        """The sweep's rows, one per micro-batch (``stopped``: a sweep stopped at its
        smallest micro-batch, that one's row alone)."""
        bs = [min(s.micro_batch for s in model.samples)] if stopped else self.micro_batches
        return judged([row_from(spec, model, b, self.global_batch, self.depth, self.device,
                                self.budget, self.work.tokens_per_sample, self.optimizer,
                                offload=self.link if offload else None) for b in bs],
                      self.host)

    def add_rows(self, rows: list[PlanRow], traces: int) -> None:
        """Rows swept by another search (multiplan's), and the traces it took."""
        self.rows.extend(judged(rows, self.host))
        self.traces += traces

    def count(self, traces: int) -> None:
        """Traces spent on this plan's behalf by another search (the multi-GPU fallback)."""
        self.traces += traces

    def any_fits(self, *, allow_optimizer_change: bool, offload: bool) -> bool:
        """Whether a full fine-tuning plan (PEFT aside) of the kind fits."""
        return any(r.fits and not r.peft and (allow_optimizer_change or not r.changes_optimizer)
                   and (offload or not r.offload) for r in self.rows)

    def confirm_step(self, row: PlanRow) -> tuple[Workload, Recipe]:
        """The (workload, recipe) that ``confirm`` traces for ``row``: its full depth, its
        micro-batch and accumulation, rank 0 of its engine (DeepSpeed ZeRO: the one-GPU step
        it is modelled on), as trace_sample asks for it."""
        parallel = multiplan.parallel_of(row)
        full = self.depth.full
        return point_step(self.work, row.recipe, row.micro_batch, full,
                          self.depth.in_full(), row.accumulation_steps,
                          None if parallel is None or parallel.modelled else parallel)

    def prefetch_confirmation(self, row: PlanRow) -> bool:
        """Start ``confirm``'s trace of ``row`` on a free core (tracing.workload_traces.prefetch),
        for a later ``confirm(row)`` to collect; whether it started."""
        return prefetch([self.confirm_step(row)], self.device, queue=True)

    def confirm(self, row: PlanRow) -> tuple[PlanRow, Confirmation]:
        """``row`` traced in full: the row with the trace's figures, and the comparison;
        where the step ran transformers' reference code for a kernel of mamba-ssm,
        causal-conv1d or flash-linear-attention, a note says so as the estimate does."""
        tr = trace_step(self.confirm_step(row), self.device)
        s = sample_from(tr, self.device, row.micro_batch, self.depth.full,
                        multiplan.parallel_of(row))
        self.traces += 1
        for line in reference_note(tr.reference_kernels, cuda=self.device.kind == "cuda"):
            if line not in self.notes:
                self.notes.append(line)
        reserved = None
        if row.offload and row.strategy is None:  # ZeRO-Offload: modelled in the sample
            params16 = half_parameter_bytes(s.parameters_bytes, row.precision)
            peak = offload_peak_bytes(params16, s.work_peak_bytes, s.param_count)
            step = offload_step_time_s(s.micro_time_s, row.accumulation_steps,
                                       s.param_count, self.link)
        else:
            peak = max(s.peak_bytes, s.peak_optimizer_bytes)
            step = row.accumulation_steps * s.micro_time_s + s.fixed_time_s
            if s.fragmentation_ratio:
                reserved = round(peak * (1 + s.fragmentation_ratio))
        conf = Confirmation(row.predicted_peak_memory_bytes, round(peak),
                            row.predicted_step_time_s, step,
                            affine_reserved_bytes=row.predicted_reserved_bytes,
                            traced_reserved_bytes=reserved, alloc_retries=s.alloc_retries,
                            steady_alloc_retries=s.steady_alloc_retries)
        scale = row.predicted_step_time_s / step if step else 1.0
        tokens = row.tokens_per_s * scale if row.tokens_per_s is not None else None
        confirmed = dataclasses.replace(
            row, predicted_peak_memory_bytes=round(peak), predicted_reserved_bytes=reserved,
            predicted_step_time_s=step,
            samples_per_s=self.global_batch / step if step else 0.0, tokens_per_s=tokens,
            mfu=row.mfu * scale, steady_alloc_retries=s.steady_alloc_retries)
        return confirmed, conf
