"""Run one real training step of the user's code, twice, on fake tensors, and record it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tilefit.dtypes import torch_dtype
from tilefit.errors import TilefitError
from tilefit.hardware import Device, get_device
from tilefit.models.cast import cast_floating
from tilefit.quiet_imports import quiet_transformers
from tilefit.tracing.attention import AttentionRouter
from tilefit.tracing.autocast import CudaAutocast
from tilefit.tracing.compiled import (
    CompiledStep,
    capture_step,
    check_compile_supported,
    compile_notes,
    graph_breaks,
)
from tilefit.tracing.distributed import (
    Parallel,
    parallel_spec,
    process_group,
    root_name,
    wrap_model,
)
from tilefit.tracing.float8 import convert_linears
from tilefit.tracing.gc_pause import gc_paused
from tilefit.tracing.hf_compat import gpu_mask_semantics, use_checkpoint_function
from tilefit.tracing.optimizers import (
    OPTIMIZER_NAMES,
    OptimizerSpec,
    host_step_counters,
    make_optimizer,
    optimizer_state_tensors,
)
from tilefit.tracing.recorder import Recorder, StepMarks
from tilefit.tracing.records import Trace
from tilefit.tracing.target import Target
from tilefit.tracing.torch_compat import (
    FAKE_ERRORS,
    FakeTensorMode,
    ModulePath,
    checkpoint_region_tagger,
    new_fake_mode,
)
from tilefit.vocab import (
    ATTENTIONS,
    MICRO_PHASES,
    Precision,
    check_compile_mode,
    check_max_grad_norm,
    check_precision_supported,
    gpus_supporting,
    parse_precision,
)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
ModelSpec = nn.Module | Callable[[], nn.Module]

# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py): init_scale 2**16,
# growth_factor 2.0, backoff_factor 0.5, growth_interval 2000.
SCALER_INIT, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL = 2.0**16, 2.0, 0.5, 2000


def resolve_target(device: str | Device) -> tuple[Target, Device | None]:
    """The target semantics for ``device``; "cpu" needs no Device to trace."""
    if isinstance(device, str) and device.strip().lower() == "cpu":
        return Target("cpu", None, 1, foreach=False), None
    dev = get_device(device)
    return Target.from_device(dev), dev


def check_options(precision: str, optimizer: OptimizerSpec, attention: str,
                  accumulation_steps: int, device: Device | None) -> None:
    spec = parse_precision(precision)
    if isinstance(optimizer, str) and optimizer.lower() not in OPTIMIZER_NAMES:
        raise TilefitError(f"unknown optimizer {optimizer!r}",
                           expected="one of " + ", ".join(OPTIMIZER_NAMES),
                           given=repr(optimizer), fix="pass one of the names above")
    if attention not in ATTENTIONS:
        raise TilefitError(f"unknown attention implementation {attention!r}",
                           expected="one of " + ", ".join(ATTENTIONS), given=repr(attention),
                           fix="use sdpa (PyTorch's fused kernels) unless you need eager")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) \
            or accumulation_steps < 1:
        raise TilefitError("accumulation_steps must be a whole number >= 1",
                           expected="1, 2, 4, ...", given=repr(accumulation_steps),
                           fix="pass the number of micro-batches per optimizer step")
    if device is not None:
        check_precision_supported(spec, device)
    elif spec.requires == "fp8":
        raise TilefitError(
            f"precision {spec.name} runs fp8 GEMMs on a GPU's Tensor Cores, not on the CPU",
            expected="a GPU with fp8 Tensor Cores: " + ", ".join(gpus_supporting("fp8")),
            given="device='cpu'", fix="pass --gpu h100 (or another GPU above)")


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()),
                                   dtype=dtype or t.dtype, device="cpu")


def fake_copy(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of the user's module whose parameters and buffers are fake CPU tensors; the
    user's module, its weights and its device are untouched (nothing real is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters(recurse=True):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_fake_like(p, mode), requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        if id(b) not in memo:
            memo[id(b)] = _fake_like(b, mode)
    return copy.deepcopy(model, memo)


def fake_batch(batch: Any, mode: FakeTensorMode, float_dtype: torch.dtype | None) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dt = float_dtype if (float_dtype is not None and x.is_floating_point()) else None
            return _fake_like(x.contiguous() if x.device.type != "meta" else x, mode, dt)
        return x
    return tree_map(conv, batch)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """model(**batch).loss for dict batches (Hugging Face models with labels in the batch):
    the loss of a step when no loss_fn is given, for trace, estimate and tune alike."""
    if not isinstance(batch, Mapping):
        raise TilefitError(
            "no loss_fn given and the batch is not a dict",
            expected="a dict batch for a model that returns .loss (Hugging Face), or loss_fn",
            given=f"a batch of type {type(batch).__name__}",
            fix="pass loss_fn=lambda model, batch: criterion(model(batch[0]), batch[1])")
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise TilefitError(
            "the model's output has no .loss",
            expected="labels in the batch so the model computes its loss, or a loss_fn",
            given=f"output of type {type(out).__name__} without loss",
            fix="add labels to the batch, or pass loss_fn=lambda model, batch: ...")
    return loss


def _set_attention(model: nn.Module, attention: str) -> None:
    if attention == "auto":
        return
    setter = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if setter is not None:
        setter(attention)
    elif config is not None and hasattr(config, "_attn_implementation"):
        config._attn_implementation = attention
    else:
        raise TilefitError(
            f"attention={attention!r} needs a Hugging Face model",
            expected="a transformers PreTrainedModel, or attention='auto' for plain modules",
            given=type(model).__name__,
            fix="pass attention='auto'; a plain module's own code decides its attention")


def _enable_checkpointing(model: nn.Module, context_fn: Callable[[], Any] | None, *,
                          compiled: bool = False) -> None:
    """Hugging Face's own checkpointing (its choice of layers), non-reentrant; ``compiled``:
    as torch.compile runs it, each checkpointed call tagged for the partitioner to recompute
    (tilefit.tracing.torch_compat.checkpoint_region_tagger) instead of torch.utils.checkpoint's
    saved-tensor hooks."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TilefitError(
            "grad_checkpointing=True needs a model with gradient_checkpointing_enable()",
            expected="a Hugging Face model, or torch.utils.checkpoint inside your forward "
            "(then leave grad_checkpointing=False: the trace follows your code)",
            given=type(model).__name__,
            fix="call torch.utils.checkpoint.checkpoint in your model's forward")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None and not compiled:
        kwargs["context_fn"] = context_fn
    enable(gradient_checkpointing_kwargs=kwargs)
    if compiled:
        use_checkpoint_function(model, checkpoint_region_tagger())


def _recompute_contexts(target: Target, recorder: Recorder, low: torch.dtype | None
                        ) -> Callable[[], tuple[Any, Any]] | None:
    """torch.utils.checkpoint's context_fn: the recomputed forward runs inside the autograd
    engine, where torch-function modes are not active, so the CUDA autocast policy and the
    attention routing are entered again around it."""
    if target.kind != "cuda":
        return None

    def recompute() -> CudaAutocast:
        mode = CudaAutocast(low, AttentionRouter(target, recorder))
        mode.enabled = True
        return mode

    return lambda: (contextlib.nullcontext(), recompute())


def _samples_and_tokens(batch: Any) -> tuple[int, int | None]:
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return int(ids.shape[0]), int(ids.numel())
    leaves = [x for x in torch.utils._pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        return 1, None
    return int(leaves[0].shape[0]), None


USER_CODE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                    AssertionError, NotImplementedError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _where(recorder: Recorder) -> str:
    """Where in the step an error happened, in words."""
    if recorder.phase not in MICRO_PHASES:
        return f"the {recorder.phase} step"
    name = recorder.failing_module
    return f"module {name!r}" if name else "code outside any module (the loss function?)"


@contextlib.contextmanager
def _explain_fake_errors(recorder: Recorder) -> Iterator[None]:
    """Errors raised inside the user's step become a TilefitError naming the op and module."""
    try:
        yield
    except TilefitError:
        raise
    except FAKE_ERRORS as exc:
        func = getattr(exc, "func", None)
        op = str(func) if func is not None else type(exc).__name__
        where = _where(recorder)
        raise TilefitError(
            f"the model cannot run on fake tensors: {op} in {where} needs real values or a "
            "real kernel",
            expected="a training step whose control flow does not depend on tensor values "
            "(no .item(), .tolist(), nonzero() or data-dependent branches) and ops with "
            "fake/meta implementations",
            given=f"{type(exc).__name__} from {op} in {where}",
            fix="move the value-dependent code out of the step (e.g. compute it once before "
            "training), or register a fake implementation for the custom op with "
            "torch.library.register_fake",
        ) from None
    except USER_CODE_ERRORS as exc:
        where = _where(recorder)
        raise TilefitError(
            f"one training step of the model failed in {where}: {type(exc).__name__}: "
            f"{_first_line(exc)}",
            expected="a model whose forward, loss and backward run on the given batch",
            given=f"{type(exc).__name__} in {where} ({recorder.phase})",
            fix="check the batch shape (--batch, --seq, --input-shape) against the model, and "
            "run the model once on a real batch of that shape to see the full error",
        ) from None


@dataclass(frozen=True)
class TraceOptions:
    """What the traced step does besides the model and the batch (validated)."""

    loss_fn: LossFn
    optimizer: OptimizerSpec
    precision: Precision
    grad_checkpointing: bool
    accumulation_steps: int
    attention: str
    replay_steady_step: bool
    max_grad_norm: float | None = None  # clip_grad_norm_ before the optimizer step
    foreach: bool | None = None  # the target's foreach default (CUDA: True)
    cuda: bool = False  # the target is a CUDA GPU (host memory and device memory differ)
    loss_sync: bool = False  # the loop reads the loss on the host after each micro-batch
    compile: bool = False  # forward and backward as torch.compile (Inductor) runs them
    compile_mode: str = "default"  # with compile: a vocab.CompileMode
    graph_breaks: bool = False  # with compile: run Dynamo over the step to list its breaks
    parallel: Parallel | None = None  # data-parallel engine and world size; None: one device

    @property
    def low_dtype(self) -> torch.dtype | None:
        """Autocast's dtype, None without autocast."""
        low = self.precision.autocast_dtype
        return torch_dtype(low) if low else None

    @property
    def pure_half(self) -> torch.dtype | None:
        """The 16-bit dtype the weights are held in (pure bf16 or fp16 training), None when
        they are fp32."""
        held = self.precision.param_dtype
        return None if held == "fp32" else torch_dtype(held)


@dataclass(frozen=True)
class _Prepared:
    """The fake model, batch and optimizer one trace runs."""

    model: nn.Module
    batch: Any
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    compiled: CompiledStep | None = None  # the captured loss computation (compile=True)
    notes: tuple[str, ...] = ()  # what wrapping the model in a data-parallel engine noted


def trace(
    model: ModelSpec,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSpec = "adamw",
    precision: str = "fp32",
    grad_checkpointing: bool = False,
    accumulation_steps: int = 1,
    attention: str = "auto",
    device: str | Device = "cpu",
    replay_steady_step: bool = True,
    max_grad_norm: float | None = None,
    loss_sync: bool = False,
    compile: bool = False,
    compile_mode: str = "default",
    graph_breaks: bool = False,
    world_size: int = 1,
    strategy: str | None = None,
) -> Trace:
    """Trace two training steps (the first creates optimizer state lazily; the second is the
    steady state) of ``model`` on ``batch`` as ``device`` would run them, on fake tensors.

    The steady step's forward and backward are the first step's again (same ops, same
    tensors; only the optimizer state around them differs), so by default they are replayed
    from the first step's records rather than run twice; its optimizer step always runs.
    ``replay_steady_step=False`` runs both steps in full (a check of that assumption for
    models whose second forward differs, such as lazy modules). ``max_grad_norm``: clip the
    gradients' total norm before each optimizer step, as the Hugging Face Trainer (1.0 by
    default) and Lightning's gradient_clip_val do. ``loss_sync``: the loop reads the loss on
    the host after each micro-batch's backward, so the host waits for the GPU there (the HF
    Trainer's default logging_nan_inf_filter=True does; so does a loss printed or logged
    to a progress bar each step). ``compile``: the forward and backward as
    ``torch.compile`` (Inductor, default mode) runs them (tilefit.tracing.compiled): the
    activations its partitioner saves, its fused kernels; the optimizer step stays eager.
    ``compile_mode`` (with ``compile``): "reduce-overhead" replays the graphs as CUDA graphs
    (CUDA targets only; the same ops, recorded on the trace for the estimator).
    ``graph_breaks`` (with ``compile``): run Dynamo over the step first and list where it
    would break it into several graphs (the prediction is of one graph); seconds more.
    ``world_size`` and ``strategy`` ("ddp" or "fsdp2"; several
    GPUs default to fsdp2): trace rank 0 of a data-parallel step, the model wrapped in the
    real engine under PyTorch's fake process group (tilefit.tracing.distributed); the batch
    is one rank's. DDP runs both steps in full: it rebuilds its buckets in the second
    forward."""
    target, dev = resolve_target(device)
    parallel = parallel_spec(world_size, strategy)
    check_options(precision, optimizer, attention, accumulation_steps, dev)
    check_max_grad_norm(max_grad_norm)
    options = TraceOptions(
        loss_fn=loss_fn or default_loss, optimizer=optimizer,
        precision=parse_precision(precision), grad_checkpointing=grad_checkpointing,
        accumulation_steps=accumulation_steps, attention=attention,
        # DDP's steady buckets come from its rebuild in the second forward: no replay
        replay_steady_step=replay_steady_step and (parallel is None
                                                   or parallel.strategy != "ddp"),
        max_grad_norm=max_grad_norm, loss_sync=loss_sync, compile=compile,
        compile_mode=compile_mode, graph_breaks=graph_breaks, parallel=parallel,
        foreach=target.foreach, cuda=target.kind == "cuda")
    _check_compile(options)
    with quiet_transformers(), gc_paused():  # tilefit.tracing.gc_pause: a quarter faster
        return _trace(model, batch, options, target)


def _check_compile(options: TraceOptions) -> None:
    """compile=True needs a torch that has Inductor, and no checkpointing (yet);
    graph_breaks=True needs compile=True."""
    if options.graph_breaks and not options.compile:
        raise TilefitError("graph_breaks=True looks for torch.compile's graph breaks",
                           expected="compile=True with graph_breaks=True",
                           given="compile=False", fix="add --compile (compile=True)")
    check_compile_mode(options.compile_mode, options.compile)
    if not options.compile:
        return
    if options.compile_mode == "reduce-overhead" and not options.cuda:
        raise TilefitError(
            "compile_mode='reduce-overhead' replays the step as CUDA graphs, which need a "
            "CUDA GPU", expected="a GPU target (--gpu a100-80gb, h100, ...) with "
            "--compile-mode reduce-overhead", given="the CPU",
            fix="pass a GPU with --gpu, or drop --compile-mode (compile_mode='default')")
    if options.parallel is not None:
        raise TilefitError(
            "compile=True is not predicted on several GPUs yet",
            expected="compile=True on one GPU, or --gpus/--strategy without --compile",
            given=f"--gpus {options.parallel.world_size} --compile",
            fix="drop --compile or --gpus")
    check_compile_supported()


def _trace(model: ModelSpec, batch: Any, options: TraceOptions, target: Target) -> Trace:
    mode = new_fake_mode()
    tracker = ModulePath()
    recorder = Recorder(tracker, "")
    with process_group(options.parallel, gloo=target.kind == "cpu") as mesh:
        with _explain_build_errors():
            prep = _prepare(model, batch, options, target, recorder, mode, mesh)
        return _trace_prepared(prep, options, target, recorder, mode)


def _trace_prepared(prep: _Prepared, options: TraceOptions, target: Target,
                    recorder: Recorder, mode: FakeTensorMode) -> Trace:
    tracker = recorder.tracker
    recorder.set_root(root_name(prep.model))
    router = AttentionRouter(target, recorder) if target.kind == "cuda" else None
    autocast = _autocast_for(target, options.low_dtype, router)
    with mode:
        recorder.register_existing(list(prep.model.parameters()) +
                                   list(prep.model.buffers()), "parameters")
        recorder.register_existing(prep.batch, "inputs")
        if prep.scaler_state is not None:
            recorder.register_existing(prep.scaler_state, "optimizer_state")
        if options.compile:
            prep = _with_compiled(prep, options, recorder, autocast)
        with contextlib.ExitStack() as stack:
            stack.enter_context(tracker)
            stack.enter_context(recorder)
            if autocast is not None:
                stack.enter_context(autocast)
            stack.enter_context(gpu_mask_semantics())
            stack.enter_context(_explain_fake_errors(recorder))
            if options.parallel is not None:
                stack.enter_context(recorder.watching_resizes())
            _run_two_steps(prep, options, recorder, autocast)
    return _to_trace(prep, options, target, recorder, router)


def _with_compiled(prep: _Prepared, options: TraceOptions, recorder: Recorder,
                   autocast: Any) -> _Prepared:
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

    with gpu_mask_semantics(), _explain_fake_errors(recorder):
        compiled = capture_step(prep.model, prep.batch, options.loss_fn, recorder,
                                cpu=not options.cuda, forward_context=forward_autocast,
                                checkpointed=options.grad_checkpointing)
        if options.graph_breaks:
            compiled.breaks = graph_breaks(prep.model, prep.batch, options.loss_fn)
    return dataclasses.replace(prep, compiled=compiled)


def _build_model(model: ModelSpec, mode: FakeTensorMode, meta: bool = False) -> nn.Module:
    """The fake model: the factory's product built under the fake mode, or a fake copy.
    ``meta``: a factory's model on the meta device (FSDP2 shards it, then materialises it)."""
    if isinstance(model, nn.Module):
        return fake_copy(model, mode)
    with torch.device("meta") if meta else mode:
        built = model()
    if not isinstance(built, nn.Module):
        raise TilefitError("the model factory did not return an nn.Module",
                           expected="a zero-argument callable returning torch.nn.Module",
                           given=type(built).__name__, fix="return the module")
    return built


def _prepare(model: ModelSpec, batch: Any, options: TraceOptions, target: Target,
             recorder: Recorder, mode: FakeTensorMode, mesh: Any = None) -> _Prepared:
    parallel = options.parallel
    fmodel = _build_model(model, mode, meta=parallel is not None and parallel.strategy == "fsdp2")
    with mode:
        _set_attention(fmodel, options.attention)
        if options.pure_half is not None:
            cast_floating(fmodel, options.pure_half)
        notes: tuple[str, ...] = ()
        if options.precision.float8_linears and options.low_dtype is not None:
            fmodel, notes = convert_linears(fmodel, options.low_dtype)
        if options.grad_checkpointing:
            _enable_checkpointing(fmodel,
                                  _recompute_contexts(target, recorder, options.low_dtype),
                                  compiled=options.compile)
        fmodel.train()
    if parallel is not None:
        fmodel, wrap_notes = wrap_model(fmodel, parallel, mesh, mode, recorder,
                                        param_dtype=options.low_dtype)
        notes += wrap_notes
    with mode:
        fbatch = fake_batch(batch, mode, options.pure_half)
        params = [p for p in fmodel.parameters() if p.requires_grad]
        if not params:
            raise TilefitError("the model has no trainable parameters",
                               expected="at least one parameter with requires_grad=True",
                               given="none", fix="unfreeze the parameters to train")
        try:
            opt = make_optimizer(options.optimizer, params, foreach=target.foreach)
        except USER_CODE_ERRORS as exc:
            raise TilefitError(
                f"the optimizer could not be created: {type(exc).__name__}: {exc}",
                expected="a name (adamw, sgd, ...) or a factory params -> Optimizer",
                given=repr(options.optimizer), fix="call the factory once on "
                "model.parameters() to see the full error") from None
        scaler_state = None
        if options.precision.grad_scaler:
            scaler_state = (torch.full((1,), SCALER_INIT), torch.zeros(1, dtype=torch.int32),
                            torch.zeros(1))
    return _Prepared(fmodel, fbatch, params, opt, scaler_state, notes=notes)


@contextlib.contextmanager
def _explain_build_errors() -> Iterator[None]:
    """Errors while building the fake model become a TilefitError."""
    try:
        yield
    except TilefitError:
        raise
    except FAKE_ERRORS as exc:
        raise TilefitError(f"the model could not be built on fake tensors: {exc}",
                           expected="a model whose construction needs no real tensor values",
                           given=type(exc).__name__,
                           fix="build the model on the meta device and pass the module") from None
    except USER_CODE_ERRORS as exc:
        raise TilefitError(f"the model could not be built: {type(exc).__name__}: "
                           f"{_first_line(exc)}",
                           expected="a model (or factory) that builds without real data",
                           given=type(exc).__name__,
                           fix="build it once in plain PyTorch to see the full error") from None


def _autocast_for(target: Target, low: torch.dtype | None,
                  router: AttentionRouter | None) -> CudaAutocast | _CpuAutocast | None:
    """The CUDA target casts under mixed precision and routes SDPA always; the CPU target
    follows CPU autocast's policy under mixed precision."""
    if target.kind == "cuda":
        return CudaAutocast(low, router)
    return _CpuAutocast(low) if low is not None else None


def _run_two_steps(prep: _Prepared, options: TraceOptions, recorder: Recorder,
                   autocast: Any) -> None:
    """Step 0 (lazy optimizer state), then the steady step 1, whose forward and backward
    are replayed from step 0 unless ``options.replay_steady_step`` is off."""
    traced_micro = min(options.accumulation_steps, 2)
    first: StepMarks | None = None
    for step in (0, 1):
        recorder.begin_step(step)
        forward_at = recorder.events
        pending: list[tuple[int, int | None]] = []
        if first is not None and options.replay_steady_step:
            pending = recorder.replay(first.forward, first.optimizer, step=1)
            with recorder.paused():  # the replayed backward made these gradients
                for p in prep.params:
                    p.grad = torch.zeros_like(p)
        else:
            for micro in range(traced_micro):
                recorder.begin_micro(micro)
                _micro_step(prep, options, recorder, autocast)
                recorder.label([p.grad for p in prep.params if p.grad is not None],
                               "gradients")
            recorder.begin_micro(0)
        optimizer_at = recorder.events
        _optimizer_step(prep, options, recorder)
        zero_grad_at = recorder.events
        recorder.enter_phase("zero_grad")
        prep.optimizer.zero_grad(set_to_none=True)
        marks = StepMarks(forward_at, optimizer_at, zero_grad_at, recorder.events)
        if first is not None and pending:
            recorder.settle(pending, first=first, steady=marks)
        if first is None and options.cuda:  # torch.optim's step counters stay on the CPU
            recorder.mark_host(host_step_counters(prep.optimizer))
        first = first or marks


def _to_trace(prep: _Prepared, options: TraceOptions, target: Target, recorder: Recorder,
              router: AttentionRouter | None) -> Trace:
    samples, tokens = _samples_and_tokens(prep.batch)
    warnings = []
    if recorder.stand_in_reads:
        warnings.append(f"the optimizer read {recorder.stand_in_reads} value(s) from tensors "
                        "(.item()); on fake tensors 1 stood in for each (they scale the "
                        "update; no shape depends on them)")
    if prep.compiled is not None:
        warnings.extend(compile_notes(prep.compiled, prep.compiled.breaks,
                                      options.compile_mode))
    if router is not None and router.choices.get("math"):
        warnings.append(f"attention ran the math kernel {router.choices['math']} time(s) per "
                        "step: it materialises the S x S scores (fp32 or unsupported head dim "
                        "or mask)")
    warnings.extend(prep.notes)
    optimizer = options.optimizer
    parallel = options.parallel
    return Trace(
        target=target, precision=options.precision.name,
        optimizer=optimizer if isinstance(optimizer, str) else getattr(
            optimizer, "__name__", "custom"),
        attention=options.attention, grad_checkpointing=options.grad_checkpointing,
        accumulation_steps=options.accumulation_steps,
        traced_micro_steps=min(options.accumulation_steps, 2),
        ops=tuple(recorder.ops), storages=recorder.storages(), n_events=recorder.events,
        param_count=sum(p.numel() for p in prep.model.parameters()),
        trainable_param_count=sum(p.numel() for p in prep.params),
        trainable_param_tensors=len(prep.params),
        samples_per_micro_batch=samples, tokens_per_micro_batch=tokens,
        warnings=tuple(warnings), compiled=prep.compiled is not None,
        compile_mode=options.compile_mode if prep.compiled is not None else "default",
        world_size=1 if parallel is None else parallel.world_size,
        strategy=None if parallel is None else parallel.strategy,
    )


def _optimizer_step(prep: _Prepared, options: TraceOptions, recorder: Recorder) -> None:
    """What a training loop does once per optimizer step: GradScaler's unscale (fp16),
    gradient clipping, the optimizer step (skipped by GradScaler only after reading
    found_inf on the host: a sync), the scale update."""
    grads = [p.grad for p in prep.params if p.grad is not None]
    if prep.scaler_state is not None:
        recorder.enter_phase("scaler")
        scale, _, found_inf = prep.scaler_state
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, scale.double().reciprocal().float())
    if options.max_grad_norm is not None:
        recorder.enter_phase("clip_grad")
        torch.nn.utils.clip_grad_norm_(prep.params, options.max_grad_norm,
                                       foreach=options.foreach)
    if prep.scaler_state is not None:
        recorder.enter_phase("scaler")
        prep.scaler_state[2].item()  # GradScaler.step: found_inf read on the host
    recorder.enter_phase("optimizer")
    prep.optimizer.step()
    recorder.label(optimizer_state_tensors(prep.optimizer), "optimizer_state")
    if prep.scaler_state is not None:
        recorder.enter_phase("scaler")
        scale, growth, found_inf = prep.scaler_state
        torch._amp_update_scale_(scale, growth, found_inf, SCALER_GROWTH, SCALER_BACKOFF,
                                 SCALER_INTERVAL)


def check_scalar_loss(loss: Any) -> torch.Tensor:
    """The loss, or an error when loss_fn did not return a one-element tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TilefitError("loss_fn must return a scalar tensor",
                           expected="a tensor with one element",
                           given=type(loss).__name__ if not isinstance(loss, torch.Tensor)
                           else f"a tensor of shape {tuple(loss.shape)}",
                           fix="reduce the loss, e.g. loss.mean()")
    return loss


def _micro_step(prep: _Prepared, options: TraceOptions, recorder: Recorder,
                autocast: Any) -> None:
    recorder.enter_phase("forward")
    if prep.compiled is not None:  # its casts are in the graph: no autocast around it
        autocast = None
    if autocast is not None:
        autocast.begin_forward()
    loss = check_scalar_loss(prep.compiled.loss() if prep.compiled is not None
                             else options.loss_fn(prep.model, prep.batch))
    if options.accumulation_steps > 1:
        loss = loss / options.accumulation_steps
    if prep.scaler_state is not None:
        loss = loss * prep.scaler_state[0]
    if autocast is not None:
        autocast.end_forward()
    recorder.enter_phase("backward")
    loss.backward()
    if autocast is not None:
        autocast.end_backward()
    if options.loss_sync:
        _check_loss(loss.detach(), recorder)
    del loss


def _check_loss(loss: torch.Tensor, recorder: Recorder) -> None:
    """What the HF Trainer does after each micro-batch's backward with its default
    logging_nan_inf_filter=True: ``torch.isnan(loss) or torch.isinf(loss)`` (each a read on
    the host, so the host waits for the GPU), then adds the loss to its running total."""
    recorder.enter_phase("loss_check")
    if torch.isnan(loss) or torch.isinf(loss):
        return
    loss.add(0.0)  # the running total's add (tr_loss += tr_loss_step), out of place here


class _CpuAutocast:
    """torch.autocast("cpu"): a CPU target follows CPU autocast's own policy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._ctx: Any = None

    def __enter__(self) -> _CpuAutocast:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def begin_forward(self) -> None:
        self._ctx = torch.autocast("cpu", dtype=self.dtype)
        self._ctx.__enter__()

    def end_forward(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def end_backward(self) -> None:
        pass
