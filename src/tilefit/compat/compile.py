"""torch.compile: Dynamo, AOTAutograd's capture, Inductor's partitioner and fusion rules.

What predicting torch.compile needs (tilefit.tracing.compiled): aot_module_simplified (the
forward+backward capture Dynamo's aot_autograd backend uses), Inductor's decomposition table
and its partition function (Inductor's joint-graph passes, then AOTAutograd's min-cut
rematerialization partitioner), and Inductor's lowering table (which ops it fuses and which
it falls back to ATen for). All private; imported lazily (Inductor takes seconds to import).
"""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat.fake import TorchDispatchMode, tree_flatten, tree_unflatten
from tilefit.compat.modules import parameter_slots

COMPILE_MIN_TORCH = (2, 11)


def flatten_batch(batch: Any) -> tuple[list[Any], Any]:
    """A batch's leaves and the spec to rebuild it (torch.utils._pytree.tree_flatten)."""
    return tree_flatten(batch)


def unflatten_batch(leaves: list[Any], spec: Any) -> Any:
    """The batch ``flatten_batch`` took apart, with these leaves (tree_unflatten)."""
    return tree_unflatten(leaves, spec)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def compile_support_problem() -> str | None:
    """Why this torch cannot predict torch.compile (None when it can)."""
    if torch_version() < COMPILE_MIN_TORCH:
        return f"torch {torch.__version__} is older than {COMPILE_MIN_TORCH[0]}." \
               f"{COMPILE_MIN_TORCH[1]}"
    try:
        from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401
        from torch._functorch.partitioners import (  # noqa: F401
            min_cut_rematerialization_partition,
        )
        from torch._inductor import lowering  # noqa: F401
        from torch._inductor.decomposition import select_decomp_table  # noqa: F401
    except ImportError as exc:  # a build without Inductor (or a renamed API)
        return f"torch {torch.__version__} lacks {exc.name or exc}"
    return None


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions Inductor applies before partitioning (select_decomp_table)."""
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def inductor_partition_fn() -> Callable[..., Any]:
    """Inductor's partition function: its joint-graph passes, then the min-cut
    rematerialization partitioner with compiler="inductor"."""
    import functools

    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    fn = getattr(compile_fx, "partition_fn", None) or functools.partial(
        min_cut_rematerialization_partition, compiler="inductor")

    def partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        # Inductor's joint-graph passes read the fake mode from V, as compile_fx sets it
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return fn(gm, joint_inputs, **kwargs)

    return partition


def checkpoint_region_tagger() -> Callable[..., Any]:
    """A stand-in for torch.utils.checkpoint as torch.compile sees it: Dynamo turns each
    checkpointed call into the ``tag_activation_checkpoint`` higher-order op, whose nodes
    carry ``recompute=PREFER_RECOMPUTE`` and an ``ac_graph_id``, and the min-cut
    partitioner recomputes them in the backward instead of saving them
    (torch/_higher_order_ops/wrap.py, ``TagActivationCheckpoint.tag_nodes``). Called as
    ``tagger(fn, *args)`` inside an AOTAutograd capture under ``preserve_node_meta``, it
    runs ``fn`` with that metadata current, so every node traced from it is tagged the same
    way (torch.fx.proxy copies ``recompute`` and ``ac_graph_id`` from the current meta)."""
    import itertools

    from torch.fx import traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy

    ids = itertools.count(1)

    def tagged(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        saved = fx_traceback.current_meta
        fx_traceback.current_meta = {**saved, "recompute": CheckpointPolicy.PREFER_RECOMPUTE,
                                     "ac_graph_id": next(ids)}
        try:
            return fn(*args, **kwargs)
        finally:
            fx_traceback.current_meta = saved

    return tagged


def rng_wrapped_call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[Any, tuple[Any, ...], dict[str, Any], bool] | None:
    """The op inside the partitioner's RNG wrappers, which make a recomputed random op
    (dropout in a checkpointed layer) draw the same numbers as the forward did
    (torch/_functorch/partitioners.py, ``functionalize_rng_ops``):
    ``run_and_save_rng_state(op, *args)`` returns (state, op(*args)), ``run_with_rng_state(
    state, op, *args)`` and ``graphsafe_run_with_rng_state(op, *args, rng_state=...)``
    return op(*args). Returns (op, its args, its kwargs, whether a state is returned too),
    or None for any other target."""
    from torch._prims import rng_prims

    if target is rng_prims.run_and_save_rng_state:
        return args[0], tuple(args[1:]), kwargs, True
    if target is rng_prims.run_with_rng_state:
        return args[1], tuple(args[2:]), kwargs, False
    graphsafe = getattr(rng_prims, "graphsafe_run_with_rng_state", None)
    if graphsafe is not None and target is graphsafe:
        rest = {k: v for k, v in kwargs.items() if k != "rng_state"}
        return args[0], tuple(args[1:]), rest, False
    return None


def aot_capture(module: torch.nn.Module, args: list[Any], *,
                fw_compiler: Callable[..., Any], bw_compiler: Callable[..., Any],
                partition_fn: Callable[..., Any],
                decompositions: dict[Any, Callable[..., Any]],
                node_meta: bool = False) -> Callable[..., Any]:
    """AOTAutograd's capture of ``module(*args)`` (a tuple-returning module of flat tensor
    arguments): traces the joint forward+backward graph, partitions it with
    ``partition_fn`` and hands the forward and backward graphs to the compilers. Returns the
    runtime function (an autograd.Function underneath) that calls what they returned.
    ``node_meta``: trace under ``preserve_node_meta``, as Dynamo does, so that the
    activation-checkpoint tags of ``checkpoint_region_tagger`` reach the joint graph."""
    from torch._functorch import config
    from torch._functorch.aot_autograd import aot_module_simplified

    # the backward graph is handed to bw_compiler now, not lazily at the first backward
    eager_bw = {"force_non_lazy_backward_lowering": True} \
        if hasattr(config, "force_non_lazy_backward_lowering") else {}
    try:  # graphs generate their Python code when first called, not after every pass
        from torch.fx._lazy_graph_module import _use_lazy_graph_module

        lazy: Any = _use_lazy_graph_module(True)
    except ImportError:
        lazy = contextlib.nullcontext()
    # AOTAutograd renders each graph as text for its logs whether or not logging is on
    # (AOTConfig.enable_log, True unless the caller is aot_function; aot_module_simplified
    # does not expose it): a third of a second for GPT-2, skipped while capturing
    no_text = unittest.mock.patch.object(torch.fx.GraphModule, "print_readable",
                                         lambda self, *a, **k: "")
    from torch.fx import traceback as fx_traceback

    meta = fx_traceback.preserve_node_meta() if node_meta else contextlib.nullcontext()
    with config.patch(**eager_bw), lazy, no_text, meta, compiling():
        return aot_module_simplified(module, args,  # type: ignore[arg-type]
                                     fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                     partition_fn=partition_fn, decompositions=decompositions)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` True, as model code sees it under torch.compile:
    Dynamo folds the call to True in the code it traces and holds the flag for the whole
    compile session, AOTAutograd's capture included (torch/_dynamo/convert_frame.py,
    ``_compile_session_context``). Code that branches on it (transformers' experts take a
    custom per-expert op there for non-bf16 weights) then takes the compiled branch. The
    flag itself (``torch.compiler._is_compiling_flag``, private) where the context manager
    is missing."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def without_first_call_checks() -> contextlib.AbstractContextManager[Any]:
    """AOTAutograd's runtime checks on a compiled function's first call only
    (``check_custom_op_aliasing``: a dispatch mode that reads ``.data`` of every Parameter
    argument of every op, one detach each): off, so the first traced step records what every
    call runs (the steady step is replayed from it)."""
    from torch._functorch import config

    if not hasattr(config, "check_custom_op_aliasing"):
        return contextlib.nullcontext()
    return config.patch(check_custom_op_aliasing=False)


def inductor_fallback(op: Any) -> bool:
    """Whether Inductor runs this aten overload as an ATen kernel of its own (a fallback, or
    no lowering at all) rather than generating code it can fuse."""
    from torch._inductor import lowering

    if op in lowering.fallbacks:
        return True
    packet = getattr(op, "overloadpacket", None)
    return op not in lowering.lowerings and packet not in lowering.lowerings


def inductor_realizes_inputs(op: Any) -> bool:
    """Whether Inductor realizes this op's inputs in memory before it runs (its lowering
    reads them as buffers: pooling, random numbers, scatter; needs_realized_inputs)."""
    from torch._inductor import lowering

    packet = getattr(op, "overloadpacket", None)
    return op in lowering.needs_realized_inputs or packet in lowering.needs_realized_inputs


TiedAlias = tuple[torch.nn.Module, str, torch.nn.Module, str]


def tied_parameter_aliases(module: torch.nn.Module) -> list[TiedAlias]:
    """(module, name, owner, owner's name) for each parameter slot holding a parameter
    another slot registered first (a tied embedding's output layer): Dynamo lifts such a
    parameter once, so its two uses add up to one gradient inside the graph, while
    aot_module_simplified lists it once per slot (named_parameters(remove_duplicate=False))
    and would give the graph two."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    out: list[TiedAlias] = []
    for mod in module.modules():
        for name, param in parameter_slots(mod).items():
            if param is None:
                continue
            owner = first.setdefault(id(param), (mod, name))
            if owner != (mod, name):
                out.append((mod, name, *owner))
    return out


@contextlib.contextmanager
def tied_while_traced(aliases: list[TiedAlias]) -> Iterator[None]:
    """Point each alias slot at what its owner's slot holds now (while AOTAutograd traces,
    the functional stand-in it swapped in for the parameter listed once), restoring the
    parameters after."""
    saved = [(mod, name, parameter_slots(mod)[name]) for mod, name, _, _ in aliases]
    for mod, name, owner, owner_name in aliases:
        parameter_slots(mod)[name] = parameter_slots(owner)[owner_name]
    try:
        yield
    finally:
        for mod, name, param in saved:
            parameter_slots(mod)[name] = param


def inductor_freeable_input(name: str) -> bool:
    """Whether Inductor's memory estimate counts a graph input by its placeholder's name
    (torch._inductor.utils.is_nonfreeable_buffers: AOTAutograd's parameters and inputs,
    RNG states and tangents are not; the activations a backward receives are)."""
    return not name.startswith(("primals_", "arg", "fwd_rng_state", "bwd_rng_state",
                                "tangents"))


def boxed_graph_run(interpreter: Any, args: list[Any]) -> Any:
    """Run an FX graph with ``interpreter`` (a torch.fx.Interpreter), taking the argument
    list as AOTAutograd's boxed calling convention passes it: the list is cleared so each
    input is freed at its last use, as a compiled graph frees it."""
    return interpreter.boxed_run(args)


def mark_boxed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a compiled function as taking AOTAutograd's boxed arguments (one list it may
    clear) rather than ``*args``, so that the runtime lets it free the saved activations."""
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn




@contextlib.contextmanager
def mutating_ops_in_place(mode_type: type[TorchDispatchMode]) -> Iterator[None]:
    """Let a dispatch mode run a compiled graph's functionalized mutating custom ops, while
    inside; torch's global higher-order-op tables are as before on exit.

    AOTAutograd writes a custom op that mutates an input (``mutates_args``, such as the
    fused cross-entropy's ``tilefit::ce_grad_``) as the higher-order op
    ``auto_functionalized`` or ``auto_functionalized_v2``, which has no rule for a
    user's dispatch mode. Under ``mode_type`` it now calls the op on its inputs in place,
    cloning nothing, as Inductor's re-inplacing pass runs it when the mutated input has no
    other use (torch._inductor.fx_passes.reinplace), with the mode active so the op is
    recorded. A rule already registered for ``mode_type`` (an enclosing trace's) is left
    in place and kept on exit; a torch without one of the two ops skips it.
    """
    added = []
    for hop, kernel in _in_place_rules():
        if mode_type not in hop.python_key_table:
            hop.py_impl(mode_type)(kernel)
            added.append(hop)
    try:
        yield
    finally:
        for hop in added:
            del hop.python_key_table[mode_type]
            cache = getattr(hop, "_dispatch_cache", None)
            if cache is not None:  # py_impl cleared it; its entries may name the rule
                cache.clear()


def _in_place_rules() -> list[tuple[Any, Callable[..., Any]]]:
    """(higher-order op, a mode's rule for it) for each ``auto_functionalized`` version."""
    try:
        from torch._higher_order_ops import auto_functionalize as af
    except ImportError:  # pragma: no cover - torch without functionalized custom ops
        return []
    # (the higher-order op, its dense implementation, the keyword naming what it clones)
    versions = (("auto_functionalized", "auto_functionalized_dense", "_only_clone_these_tensors"),
                ("auto_functionalized_v2", "auto_functionalized_v2_dense",
                 "_only_clone_these_bases"))
    out = []
    for hop_name, dense_name, clone_kw in versions:
        hop, dense = getattr(af, hop_name, None), getattr(af, dense_name, None)
        if hop is not None and dense is not None:
            out.append((hop, _in_place_kernel(dense, clone_kw)))
    return out


def registered_modes(hop_name: str) -> set[type]:
    """The mode types with a rule for the higher-order op ``hop_name`` of torch's
    auto_functionalize module (empty when torch lacks it): what a test compares before and
    after a trace."""
    try:
        from torch._higher_order_ops import auto_functionalize as af
    except ImportError:  # pragma: no cover - torch without functionalized custom ops
        return set()
    hop = getattr(af, hop_name, None)
    return set(hop.python_key_table) if hop is not None else set()


def _in_place_kernel(dense: Callable[..., Any], clone_kw: str) -> Callable[..., Any]:
    """A mode's rule for one ``auto_functionalized`` version: its dense implementation with
    nothing cloned, under the mode."""
    def run(mode: Any, _mutable_op: Any, **kwargs: Any) -> Any:
        kwargs[clone_kw] = ()
        with mode:
            return dense(_mutable_op, **kwargs)
    return run


def functionalized_op(target: Any, args: tuple[Any, ...]) -> Any:
    """The custom op a graph node's ``auto_functionalized``/``_v2`` call wraps (its first
    argument), or the node's own target for any other node."""
    name = getattr(target, "name", None)
    if callable(name) and name() in ("auto_functionalized", "auto_functionalized_v2"):
        return args[0]
    return target


def dynamo_graph_breaks(fn: Callable[..., Any], *args: Any) -> list[str]:
    """Dynamo's graph breaks in ``fn(*args)``: one line each, its reason and where (Dynamo
    traces ``fn`` without running a compiler; torch._dynamo.explain). Dynamo's caches are
    reset before and after."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        explained = torch._dynamo.explain(fn)(*args)
        counted = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    out = []
    for brk in explained.break_reasons:
        reason = " ".join(str(brk.reason).split())
        frame = brk.user_stack[-1] if brk.user_stack else None
        where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
        out.append(f"{reason[:160]}{where}")
    # breaks explain() counts but leaves out of break_reasons (an unsupported call Dynamo
    # runs eagerly: transformers' logger.warning_once, for one), by reason
    for reason, times in counted.items():
        summary, _, context = reason.partition("Developer debug context:")
        first = " ".join(summary.split())[:100]
        if not any(first[:60] in line for line in out):
            out.append(f"{first}: {' '.join(context.split())[:200]} ({times}x)")
    return out


@contextlib.contextmanager
def inside_optimized_module() -> Iterator[None]:
    """Dynamo's flag that torch.compile's OptimizedModule holds while its graphs run: module
    hooks that honour it (ModTracker's) skip the modules inside, whose code is in the graph."""
    from torch._dynamo.eval_frame import _set_in_optimized_module

    with _set_in_optimized_module():
        yield
