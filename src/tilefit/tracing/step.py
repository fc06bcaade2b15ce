"""Run one real training step of the user's code, twice, on fake tensors, and record it.

The stages: ``prepare`` (tracing.fakes: the fake model, batch, optimizer and scaler),
``_run_two_steps`` (step 0, then the steady step replayed from it, each micro-batch and
optimizer step run by tilefit.loop, the one training step, its phases recorded) and
``_to_trace``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch

from tilefit.compat import probes
from tilefit.compat.bitsandbytes import logical_numel, quant_state_tensors, quant_states_lifted
from tilefit.compat.bnb_dispatch import dense_buffers, gpu_props
from tilefit.compat.compile import mutating_ops_in_place
from tilefit.compat.fake import FakeTensorMode, new_fake_mode, tree_leaves
from tilefit.compat.modules import ModulePath
from tilefit.compat.transformers import gpu_mask_semantics
from tilefit.errors import TilefitError
from tilefit.hardware import Device
from tilefit.loop import (
    Hooks,
    LossFn,
    check_default_loss_batch,
    clear_gradients,
    default_loss,
    micro_batch,
    optimizer_update,
)
from tilefit.old_keywords import refuses_old_keywords
from tilefit.quiet_imports import quiet_fake_errors, quiet_imports, quiet_transformers
from tilefit.recipe import DEFAULT_GPU, Recipe, batch_recipe, is_named_model
from tilefit.tracing.attention import AttentionRouter
from tilefit.tracing.autocast import autocast_for
from tilefit.tracing.compiled import (
    capture_step,
    check_compile_supported,
    compile_notes,
    graph_breaks,
)
from tilefit.tracing.cpu_kernels import cpu_target_kernels
from tilefit.tracing.distributed import parallel_spec, process_group, root_name
from tilefit.tracing.errors import explain_build_errors, explain_fake_errors
from tilefit.tracing.fakes import Prepared, prepare
from tilefit.tracing.gc_pause import gc_paused
from tilefit.tracing.kernels import KernelFallbacks, reference_note
from tilefit.tracing.moe import ExpertsTrace
from tilefit.tracing.optimizers import host_step_counters, optimizer_state_tensors, paged_note
from tilefit.tracing.recorder import Recorder, StepMarks
from tilefit.tracing.records import ReferenceKernel, Trace
from tilefit.tracing.request import ModelSpec, TraceRequest
from tilefit.tracing.scaler import TracedScaler
from tilefit.tracing.target import check_device_options, resolve_target
from tilefit.vocab import check_compile_mode, parse_routing


@refuses_old_keywords
def trace(model: Any, batch: Any = None, *, recipe: Recipe | None = None,
          gpu: str | Device | None = None, loss_fn: LossFn | None = None,
          replay_steady_step: bool = True) -> Trace:
    """Trace two training steps (the first creates optimizer state lazily; the second is the
    steady state) of ``model`` under ``recipe`` as ``gpu`` would run them, on fake tensors.

    ``model``: a catalog name, a config.json path, ``package.module:function`` or a
    tilefit Workload (``batch``: the micro-batch size, default ``recipe.batch_size``), or an
    nn.Module / zero-argument factory with an example ``batch`` as your DataLoader yields it
    (its samples are the micro-batch; ``loss_fn(model, batch)`` the loss, by default the
    model output's ``.loss`` or its mean). ``recipe``: the step (tilefit.recipe.Recipe;
    default ``Recipe.for_model(model)``, the loop the model's framework runs), its
    ``precision="auto"`` the GPU's default. ``gpu``: a catalog name, a Device, or "cpu" for
    this machine (default DEFAULT_GPU). With ``recipe.parallel`` on several GPUs (ddp or
    fsdp2) rank 0 is traced, the model wrapped in the real engine under PyTorch's fake
    process group (tilefit.tracing.distributed); the batch is one rank's. DDP runs both
    steps in full: it rebuilds its buckets in the second forward.

    The steady step's forward and backward are the first step's again (same ops, same
    tensors), so by default they are replayed from the first step's records rather than run
    twice; its optimizer step always runs. With accumulation the second micro-batch is
    likewise the first's ops, its gradients added into the kept ones (tracing.replay).
    Neither is replayed where the first left a tensor alive that is no gradient (a cache
    made on the first call). ``replay_steady_step=False`` runs every step and micro-batch in
    full (a check of that assumption for models whose second forward differs). 0.1.0's
    keywords (precision=, device=, ...) are refused with their new spelling
    (tilefit.old_keywords)."""
    gpu = DEFAULT_GPU if gpu is None else gpu
    recipe = recipe or Recipe.for_model(model)
    if is_named_model(model):
        from tilefit.tracing.workload_traces import trace_workload

        return trace_workload(model, batch_recipe(recipe, batch), gpu)
    return trace_module(model, batch, recipe, gpu,
                        loss_fn=loss_fn, replay_steady_step=replay_steady_step)


def trace_module(model: ModelSpec, batch: Any, recipe: Recipe, gpu: str | Device, *,
                 loss_fn: LossFn | None = None, replay_steady_step: bool = True) -> Trace:
    """``trace`` of an nn.Module or factory on an example batch (the recipe's own batch
    size is the batch's): the one place a recipe becomes a TraceRequest."""
    if batch is None:
        raise TilefitError("an nn.Module (or factory) needs an example batch",
                           expected="trace(model, batch, ...)", given="no batch",
                           fix="pass one batch as your DataLoader yields it")
    if loss_fn is None:  # before tracing: the batch named as the user gave it
        check_default_loss_batch(batch)
    target, dev = resolve_target(gpu)
    recipe = recipe.on(dev)
    parallel = parallel_spec(recipe.parallel.world_size, recipe.parallel.strategy)
    check_device_options(recipe.spec, dev)
    request = TraceRequest(
        recipe=recipe, target=target, loss_fn=loss_fn or default_loss, parallel=parallel,
        # DDP's steady buckets come from its rebuild in the second forward, and FSDP2's
        # first all-gathers make its unsharded parameters (views, once): no replay
        # kept gradients make the steady step's backward accumulate into them: traced, not
        # replayed from step 0 (where they were created)
        replay_steady_step=replay_steady_step and recipe.zero_grad_to_none
        and (parallel is None or parallel.strategy not in ("ddp", "fsdp2")),
        # a data-parallel engine's micro-batches differ (no_sync, its buckets): all run
        replay_micro_step=replay_steady_step and parallel is None)
    _check_compile(request)
    # quiet_imports: the first trace may import transformers' quantizers, and torchao with them;
    # gc_paused: a quarter faster (tilefit.tracing.gc_pause)
    # probes.collecting: what a compat probe could not check of a library is noted
    with quiet_imports(), quiet_fake_errors(), quiet_transformers(), gc_paused(), \
            probes.collecting() as blind:
        probes.read("torch")  # its fake tensors, dispatch modes and private tracing APIs
        tr = _trace(model, batch, request)
    if blind:
        tr = dataclasses.replace(tr, warnings=(*tr.warnings, *blind))
    return tr if recipe.alloc_conf is None else dataclasses.replace(
        tr, alloc_conf=recipe.alloc_conf)


def _check_compile(request: TraceRequest) -> None:
    """compile needs a torch that has Inductor, one GPU, and a CUDA target for
    reduce-overhead's CUDA graphs."""
    recipe, parallel = request.recipe, request.parallel
    check_compile_mode(recipe.compile_mode, request.compiled)
    if recipe.compile is None:
        return
    if recipe.compile_mode == "reduce-overhead" and not request.cuda:
        raise TilefitError(
            "compile_mode='reduce-overhead' replays the step as CUDA graphs, which need a "
            "CUDA GPU", expected="a GPU target (estimate(..., gpu='a100-80gb'), 'h100', ...) "
            "with Recipe(compile=Compile(mode='reduce-overhead'))", given="the CPU",
            fix="pass a GPU: estimate(..., gpu='h100'), or "
            "Recipe(compile=Compile(mode='default'))")
    if parallel is not None:
        raise TilefitError(
            "compile=True is not predicted on several GPUs yet",
            expected="Recipe(compile=Compile()) on one GPU, or Recipe(parallel=Parallelism("
            "...)) without compile",
            given=f"Recipe(compile=Compile(), parallel=Parallelism(world_size="
            f"{parallel.world_size}))",
            fix="pass Recipe(compile=None) or Parallelism(world_size=1)")
    check_compile_supported()


def _trace(model: ModelSpec, batch: Any, request: TraceRequest) -> Trace:
    mode = new_fake_mode()
    tracker = ModulePath()
    target = request.target
    # bitsandbytes' 4-bit GEMM holds its dequantized weight inside the op: booked beside it
    recorder = Recorder(tracker, "", transients=functools.partial(dense_buffers,
                                                                  gpu=gpu_props(target)))
    # a compiled graph's mutating custom ops (the fused cross-entropy's) run in place under
    # the recorder; torch's global tables are restored on exit
    with process_group(request.parallel, gloo=target.kind == "cpu") as mesh, \
            mutating_ops_in_place(Recorder):
        with explain_build_errors():
            prep = prepare(model, batch, request, recorder, mode, mesh)
        return _trace_prepared(prep, request, recorder, mode)


def _trace_prepared(prep: Prepared, request: TraceRequest, recorder: Recorder,
                    mode: FakeTensorMode) -> Trace:
    tracker, target = recorder.tracker, request.target
    probes.read_model(prep.model)
    recorder.set_root(root_name(prep.model))
    router = AttentionRouter(target, recorder) if target.kind == "cuda" else None
    autocast = autocast_for(target, request.low_dtype, router)
    experts = ExpertsTrace(prep.model, parse_routing(request.recipe.routing),
                           target.compute_capability if target.kind == "cuda" else None)
    kernels = KernelFallbacks()
    # the CUDA target's kernels are registered with its autocast policy (autocast_for)
    cpu = cpu_target_kernels() if target.kind == "cpu" else contextlib.nullcontext()
    with mode, kernels.watching(prep.model, lambda: recorder.module), cpu:
        recorder.register_existing(list(prep.model.parameters()) +
                                   list(prep.model.buffers()) +
                                   list(quant_state_tensors(prep.model)), "parameters")
        recorder.register_existing(prep.batch, "inputs")
        if prep.scaler_state is not None:
            recorder.register_existing(prep.scaler_state, "optimizer_state")
        if request.compiled:
            prep = _with_compiled(prep, request, recorder, autocast)
        with contextlib.ExitStack() as stack:
            stack.enter_context(tracker)
            stack.enter_context(experts.active(recorder))  # below the recorder
            stack.enter_context(recorder)
            if autocast is not None:
                stack.enter_context(autocast)
            stack.enter_context(gpu_mask_semantics(recorder.ones, prep.model))
            stack.enter_context(explain_fake_errors(recorder))
            if request.parallel is not None:
                stack.enter_context(recorder.watching_resizes())
            _run_two_steps(prep, request, recorder, autocast)
    return _to_trace(prep, request, recorder, router, experts.notes(), kernels.kernels)


def _with_compiled(prep: Prepared, request: TraceRequest, recorder: Recorder,
                   autocast: Any) -> Prepared:
    """Capture the loss computation as torch.compile would, before the recorder runs (the
    capture records nothing). The target's autocast policy applies while the forward is
    traced, so its casts are in the graphs; only then: AOTAutograd's own Python (its
    decompositions, functionalization) would otherwise pass through the mode too."""

    @contextlib.contextmanager
    def forward_autocast() -> Iterator[None]:
        if autocast is None:
            yield
            return
        with autocast:
            autocast.begin_forward()
            try:
                yield
            finally:
                autocast.end_forward()
                autocast.end_backward()

    compile_ = request.recipe.compile
    with gpu_mask_semantics(model=prep.model), explain_fake_errors(recorder), \
            quant_states_lifted(prep.model):
        compiled = capture_step(prep.model, prep.batch, request.loss_fn, recorder,
                                cpu=not request.cuda, forward_context=forward_autocast,
                                checkpointed=request.recipe.grad_checkpointing)
        if compile_ is not None and compile_.graph_breaks:
            compiled.breaks = graph_breaks(prep.model, prep.batch, request.loss_fn)
    return dataclasses.replace(prep, compiled=compiled)


def _step_hooks(prep: Prepared, recorder: Recorder, autocast: Any) -> Hooks:
    """How the tracer watches tilefit.loop's step: each phase recorded, the target's
    autocast policy around the forward (not around a compiled forward: its casts are in the
    graph), the optimizer's state labelled once it is made."""
    if prep.compiled is not None:
        autocast = None

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        if autocast is not None:
            autocast.begin_forward()
        yield
        if autocast is not None:
            autocast.end_forward()

    @contextlib.contextmanager
    def backward() -> Iterator[None]:
        yield
        if autocast is not None:
            autocast.end_backward()

    def stepped(optimizer: torch.optim.Optimizer) -> None:
        recorder.label(optimizer_state_tensors(optimizer), "optimizer_state")

    return Hooks(phase=recorder.enter_phase, forward=forward, backward=backward,
                 stepped=stepped)


def _run_two_steps(prep: Prepared, request: TraceRequest, recorder: Recorder,
                   autocast: Any) -> None:
    """Step 0 (lazy optimizer state), then the steady step 1, whose forward and backward
    are replayed from step 0 unless ``request.replay_steady_step`` is off or step 0 left a
    tensor behind that is no gradient (tracing.replay)."""
    recipe = request.recipe
    hooks = _step_hooks(prep, recorder, autocast)
    scaler = None if prep.scaler_state is None else TracedScaler(prep.scaler_state,
                                                                  recorder.enter_phase)
    first: StepMarks | None = None
    for step in (0, 1):
        recorder.begin_step(step)
        forward_at = recorder.events
        pending: list[tuple[int, int | None]] = []
        if first is not None and request.replay_steady_step and \
                recorder.can_replay(first.forward, first.optimizer):
            pending = recorder.replay(first.forward, first.optimizer, step=1)
            with recorder.paused():  # the replayed backward made these gradients
                for p in prep.params:
                    p.grad = torch.zeros_like(p)
        else:
            first_micro = recorder.events
            for micro in range(min(recipe.accumulation_steps, 2)):
                _micro_batch(prep, request, recorder, hooks, scaler, micro, first_micro)
            recorder.begin_micro(0)
        optimizer_at = recorder.events
        # clip_grad_norm_'s default on real CPU and CUDA tensors: its foreach kernels
        optimizer_update(prep.optimizer, prep.params, recipe, scaler=scaler,
                         clip_foreach=True, hooks=hooks)
        zero_grad_at = recorder.events
        clear_gradients(prep.optimizer, recipe, hooks)
        marks = StepMarks(forward_at, optimizer_at, zero_grad_at, recorder.events)
        if first is not None and pending:
            recorder.settle(pending, first=first, steady=marks)
        if first is None and request.cuda:  # torch.optim's step counters stay on the CPU
            recorder.mark_host(host_step_counters(prep.optimizer))
        first = first or marks


def _micro_batch(prep: Prepared, request: TraceRequest, recorder: Recorder, hooks: Hooks,
                 scaler: TracedScaler | None, micro: int, first_at: int) -> None:
    """Micro-batch ``micro`` of a step: run, or after the first (which began at event
    ``first_at``) replayed from it (tracing.replay: the same ops, its gradients accumulated)
    unless replays are off or it cannot be (the first made a lasting storage that is no
    gradient)."""
    recorder.begin_micro(micro)
    grads = [p.grad for p in prep.params if p.grad is not None]
    if not (micro > 0 and request.replay_micro_step
            and recorder.replay_micro(first_at, micro, grads)):
        compiled = prep.compiled
        micro_batch(compiled.loss if compiled is not None
                    else lambda: request.loss_fn(prep.model, prep.batch),
                    request.recipe, scaler=scaler, hooks=hooks)
        recorder.micro_runs += 1
    recorder.label([p.grad for p in prep.params if p.grad is not None], "gradients")


def _to_trace(prep: Prepared, request: TraceRequest, recorder: Recorder,
              router: AttentionRouter | None, notes: list[str] | None = None,
              kernels: tuple[ReferenceKernel, ...] = ()) -> Trace:
    recipe, target, parallel = request.recipe, request.target, request.parallel
    samples, tokens = samples_and_tokens(prep.batch)
    warnings = []
    if recorder.stand_in_reads:
        warnings.append(f"the optimizer read {recorder.stand_in_reads} value(s) from tensors "
                        "(.item()); on fake tensors 1 stood in for each (they scale the "
                        "update; no shape depends on them)")
    if prep.compiled is not None:
        warnings.extend(compile_notes(prep.compiled, prep.compiled.breaks,
                                      recipe.compile_mode))
    if router is not None and router.choices.get("math"):
        per_micro = router.choices["math"] // max(recorder.micro_runs, 1)
        warnings.append(f"attention ran the math kernel {per_micro} time(s) per micro-batch: "
                        "it materialises the S x S scores (fp32 or unsupported head dim or "
                        "mask)")
    if any(op.op.startswith("aten._cudnn_rnn.") for op in recorder.ops):
        warnings.append(CUDNN_RESERVE_NOTE)
    warnings.extend(prep.notes)
    warnings.extend(notes or ())
    warnings.extend(reference_note(kernels, cuda=target.kind == "cuda"))
    paged = paged_note(recipe.optimizer, prep.optimizer)
    if paged is not None:
        warnings.append(paged)
    optimizer = recipe.optimizer
    return Trace(
        target=target, precision=recipe.spec.name,
        optimizer=optimizer if isinstance(optimizer, str) else getattr(
            optimizer, "__name__", "custom"),
        attention=recipe.attention, grad_checkpointing=recipe.grad_checkpointing,
        accumulation_steps=recipe.accumulation_steps,
        traced_micro_steps=min(recipe.accumulation_steps, 2),
        ops=tuple(recorder.ops), storages=recorder.storages(), n_events=recorder.events,
        param_count=sum(logical_numel(p) for p in prep.model.parameters()),
        trainable_param_count=sum(p.numel() for p in prep.params),
        trainable_param_tensors=len(prep.params),
        samples_per_micro_batch=samples, tokens_per_micro_batch=tokens,
        warnings=tuple(warnings), compiled=prep.compiled is not None,
        compile_mode=recipe.compile_mode if prep.compiled is not None else "default",
        world_size=1 if parallel is None else parallel.world_size,
        strategy=None if parallel is None else parallel.strategy,
        reference_kernels=kernels,
    )


# what the trace of a cuDNN RNN leaves out (tracing.target_kernels)
CUDNN_RESERVE_NOTE = (
    "nn.LSTM / GRU / RNN traced as cuDNN's fused RNN (one _cudnn_rnn, its GEMMs counted; "
    "under autocast in fp16, as ATen's cuDNN autocast kernel casts it); cuDNN's reserve "
    "space, what its forward keeps for the backward, is not published and not counted")


def samples_and_tokens(batch: Any) -> tuple[int, int | None]:
    """A micro-batch's samples (the leading dimension of its first tensor) and tokens (its
    input_ids' elements, where it is a dict that has them)."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return int(ids.shape[0]), int(ids.numel())
    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        return 1, None
    return int(leaves[0].shape[0]), None
