"""The private PyTorch APIs tilefit uses, wrapped in one place.

Tested on torch 2.4-2.13 APIs: FakeTensorMode and its exceptions, the flop formula registry
of torch.utils.flop_counter, and ModuleTracker (public since 2.4 in torch.utils).
"""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = [
    "FAKE_ERRORS",
    "DataDependentOutputException",
    "FakeTensor",
    "FakeTensorMode",
    "ModulePath",
    "flop_formula",
    "new_fake_mode",
]

# Exceptions a fake-tensor run raises for code that needs real values or real kernels.
FAKE_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


class ModulePath:
    """Which modules are running, whether autograd's backward is running, and whether a
    checkpointed forward is being recomputed inside it.

    Uses torch.distributed._tools.mod_tracker.ModTracker (what PyTorch's MemTracker uses): it
    keeps no tensors alive. torch.utils.module_tracker.ModuleTracker, the fallback for builds
    without torch.distributed, keeps recomputed activations alive through its grad hooks
    when checkpointing (measured: +14% peak on a checkpointed Llama-like step).
    """

    def __init__(self) -> None:
        self.recompute_depth = 0
        # nn.Identity modules by name: their output is their input, so ModTracker's backward
        # hooks on the one tensor can leave them "running" for the rest of the backward
        self.passthrough: set[str] = set()
        self.last_entered = ""  # the last module whose forward started (for error messages)
        try:
            from torch.distributed._tools.mod_tracker import ModTracker
        except ImportError:  # pragma: no cover - builds without torch.distributed
            from torch.utils.module_tracker import ModuleTracker

            self._tracker: Any = ModuleTracker()
        else:
            self._tracker = ModTracker()
        self._handles: list[Any] = []

    def _pre_fw(self, mod: Any, inputs: Any) -> None:
        known = getattr(self._tracker, "get_known_fqn", None)
        self.last_entered = (known(mod) if known is not None else None) or type(mod).__name__
        if isinstance(mod, torch.nn.Identity):
            self.passthrough.add(self.last_entered)
        if self.is_bw:
            self.recompute_depth += 1

    def _post_fw(self, mod: Any, inputs: Any, outputs: Any) -> None:
        if self.is_bw and self.recompute_depth > 0:
            self.recompute_depth -= 1

    @property
    def parents(self) -> set[str]:
        return set(self._tracker.parents) - self.passthrough

    @property
    def is_bw(self) -> bool:
        # inside autograd's engine (the graph task id is -1 outside backward)
        return torch._C._current_graph_task_id() != -1

    @property
    def recomputing(self) -> bool:
        return self.recompute_depth > 0

    def __enter__(self) -> ModulePath:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._tracker.__enter__()
        # global module hooks (public API), registered after the tracker's so that its names
        # are known: they count forwards that run inside backward (checkpoint recompute)
        self._handles = [register_module_forward_pre_hook(self._pre_fw),
                         register_module_forward_hook(self._post_fw, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._tracker.__exit__(*exc)


def new_fake_mode() -> FakeTensorMode:
    # allow_non_fake_inputs lets module-level constants (real CPU tensors a model keeps as
    # plain attributes) mix with fake tensors, as they would on a device.
    return FakeTensorMode(allow_non_fake_inputs=True)


def flop_formula(func: Any) -> Callable[..., int] | None:
    """torch.utils.flop_counter's formula for an aten overload, or None."""
    packet = getattr(func, "overloadpacket", func)
    return flop_registry.get(packet)


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an aten op writes in place (``Tensor(a!)`` in its schema), by position
    or keyword: what an in-place op that returns nothing (``_foreach_add_``,
    ``_fused_adamw_``) still writes."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is not None:
            out.append(value)
    return out


def write_only_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an op writes without reading: its schema's ``out`` arguments
    (``fsdp.split_with_sizes_copy(..., out=[...])``), less any tensor also passed as an input
    it reads (``torch.addmm(c, a, b, out=c)`` reads ``c``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    outs: list[Any] = []
    read_ids: set[int] = set()
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is None:
            continue
        leaves = list(value) if isinstance(value, (list, tuple)) else [value]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if arg.is_out:
            outs.extend(tensors)
        else:
            read_ids.update(id(t) for t in tensors)
    return [t for t in outs if id(t) not in read_ids]


def holds_fake(x: object) -> bool:
    """Whether ``x`` is AOTAutograd's functionalization wrapper (a FunctionalTensor) around a
    fake tensor (torch._subclasses.fake_tensor.is_fake looks inside); a bare FakeTensor is
    the caller's own isinstance check. Only a FunctionalTensor is looked into: Dynamo,
    listing a model's graph breaks, sees no FunctionalTensor and never reaches is_fake, a
    function it refuses to trace."""
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, FunctionalTensor) and bool(is_fake(x))


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (Tensor._is_view)."""
    return bool(t._is_view())


# ---- torch.compile: AOTAutograd's capture, Inductor's partitioner and fusion rules ---------
# What predicting torch.compile needs (tilefit.tracing.compiled): aot_module_simplified (the
# forward+backward capture Dynamo's aot_autograd backend uses), Inductor's decomposition table
# and its partition function (Inductor's joint-graph passes, then AOTAutograd's min-cut
# rematerialization partitioner), and Inductor's lowering table (which ops it fuses and which
# it falls back to ATen for). All private; imported lazily (Inductor takes seconds to import).
COMPILE_MIN_TORCH = (2, 11)


def flatten_batch(batch: Any) -> tuple[list[Any], Any]:
    """A batch's leaves and the spec to rebuild it (torch.utils._pytree.tree_flatten)."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten(batch)


def unflatten_batch(leaves: list[Any], spec: Any) -> Any:
    """The batch ``flatten_batch`` took apart, with these leaves (tree_unflatten)."""
    from torch.utils._pytree import tree_unflatten

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
    with config.patch(**eager_bw), lazy, no_text, meta:
        return aot_module_simplified(module, args,  # type: ignore[arg-type]
                                     fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                     partition_fn=partition_fn, decompositions=decompositions)


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
        for name, param in mod._parameters.items():
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
    saved = [(mod, name, mod._parameters[name]) for mod, name, _, _ in aliases]
    for mod, name, owner, owner_name in aliases:
        mod._parameters[name] = owner._parameters[owner_name]
    try:
        yield
    finally:
        for mod, name, param in saved:
            mod._parameters[name] = param


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


def run_mutating_ops_in_place(mode_type: type[TorchDispatchMode]) -> None:
    """Let a dispatch mode run a compiled graph's functionalized mutating custom ops.

    AOTAutograd writes a custom op that mutates an input (``mutates_args``, such as the
    fused cross-entropy's ``tilefit::ce_grad_``) as the higher-order op
    ``auto_functionalized`` or ``auto_functionalized_v2``, which has no rule for a
    user's dispatch mode. Under ``mode_type`` it now calls the op on its inputs in place,
    cloning nothing, as Inductor's re-inplacing pass runs it when the mutated input has no
    other use (torch._inductor.fx_passes.reinplace), with the mode active so the op is
    recorded. Registered once per mode type; a torch without one of the two ops skips it.
    """
    try:
        from torch._higher_order_ops import auto_functionalize as af
    except ImportError:  # pragma: no cover - torch without functionalized custom ops
        return
    # (the higher-order op, its dense implementation, the keyword naming what it clones)
    versions = (("auto_functionalized", "auto_functionalized_dense", "_only_clone_these_tensors"),
                ("auto_functionalized_v2", "auto_functionalized_v2_dense",
                 "_only_clone_these_bases"))
    for hop_name, dense_name, clone_kw in versions:
        hop, dense = getattr(af, hop_name, None), getattr(af, dense_name, None)
        if hop is not None and dense is not None and mode_type not in hop.python_key_table:
            hop.py_impl(mode_type)(_in_place_kernel(dense, clone_kw))


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
def record_module_paths(root: torch.nn.Module) -> Iterator[None]:
    """While AOTAutograd traces ``root``'s forward, tag each graph node with the module
    that made it (``nn_module_stack`` in its meta, as Dynamo's graphs carry; AOTAutograd
    copies it to the backward nodes as ``fwd_nn_module_stack``). Uses FX's node-meta
    propagation (torch.fx.traceback.current_meta), public but not backward compatible."""
    import torch.fx.traceback as fx_traceback
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    names = {id(m): name for name, m in root.named_modules() if name}
    stack: list[Any] = []

    def pre(mod: Any, args: Any) -> None:
        meta = fx_traceback.current_meta
        stack.append(meta.get("nn_module_stack"))
        name = names.get(id(mod))
        if name is not None:
            meta["nn_module_stack"] = {name: (name, type(mod))}

    def post(mod: Any, args: Any, out: Any) -> None:
        if stack:
            previous = stack.pop()
            if previous is None:
                fx_traceback.current_meta.pop("nn_module_stack", None)
            else:
                fx_traceback.current_meta["nn_module_stack"] = previous

    handles = [register_module_forward_pre_hook(pre),
               register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def node_module(node: Any) -> str:
    """The module path a graph node was tagged with (record_module_paths), "" if none."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


# ---- torch.distributed: the fake process group, DTensor, storage resizes -------------------
def distributed_available() -> bool:
    """Whether this torch build has torch.distributed (macOS and Windows wheels may not)."""
    import torch.distributed as dist

    return bool(dist.is_available())


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The default process group as PyTorch's fake backend at ``world_size``, as rank 0: the
    collectives are dispatched (so they are recorded) but move no data
    (torch.testing._internal.distributed.fake_pg, private; checked on torch 2.13)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def process_group_initialized() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


_DTENSOR: list[type] = []  # DTensor's class, once a multi-GPU trace has asked for it


def enable_dtensor() -> None:
    """Let ``local_tensor`` unwrap DTensors (imported only for multi-GPU traces)."""
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank holds of a DTensor (its private ``_local_tensor``: ``to_local()``
    would dispatch a view), or ``t`` itself."""
    if _DTENSOR and isinstance(t, _DTENSOR[0]):
        return t._local_tensor  # type: ignore[attr-defined, no-any-return]
    return t


def process_group_size(arg: Any) -> int | None:
    """The size of the process group a c10d op receives (a ProcessGroup boxed in a script
    object, unboxed by the private ``ProcessGroup.unbox``), None for other arguments."""
    import torch.distributed as dist

    group = arg
    if isinstance(arg, torch.ScriptObject):
        try:
            group = dist.ProcessGroup.unbox(arg)
        except (RuntimeError, TypeError, AttributeError):  # a ReduceOp or a Work
            return None
    if not isinstance(group, dist.ProcessGroup):
        return None
    return int(group.size())


@contextlib.contextmanager
def storage_resizes(callback: Callable[[Any, int], None]) -> Iterator[None]:
    """Call ``callback(storage, new_nbytes)`` after every ``UntypedStorage.resize_``: FSDP2
    allocates and frees its unsharded parameters that way, outside the dispatcher (PyTorch's
    MemTracker patches the same method)."""
    original = torch.UntypedStorage.resize_

    def resize_(st: Any, size: int) -> Any:
        out = original(st, size)
        callback(st, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


_INTEGER_DTYPES = (torch.int32, torch.int64)


class _RealIntegerAllocations(TorchDispatchMode):
    """Integer tensors created from nothing (no tensor arguments) are real CPU tensors: the
    host-side bookkeeping C++ code reads back (DDP's bucket indices), not model data."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = [*args, *kwargs.values()]
        if kwargs.get("dtype") in _INTEGER_DTYPES and not any(
                isinstance(a, torch.Tensor) for a in leaves):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _BucketRebuild:
    """DDP's C++ reducer, whose one bucket rebuild runs with real integer bookkeeping."""

    def __init__(self, reducer: Any, around: Callable[[], Any]) -> None:
        self._reducer = reducer
        self._around = around

    def _rebuild_buckets(self) -> bool:
        with self._around(), _RealIntegerAllocations():
            return bool(self._reducer._rebuild_buckets())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def rebuild_ddp_buckets_on_fake_tensors(ddp: Any, around: Callable[[], Any]) -> None:
    """DDP (torch >= 2.12) starts with all gradients in one bucket and rebuilds its buckets
    once, in the forward after the first backward, in the order the gradients became ready
    (the first at most 1 MiB, the others 25 MiB). The rebuild broadcasts the bucket indices
    in an integer tensor and reads them back, which a fake tensor cannot: those integer
    tensors are made real (the fake process group moves nothing, so rank 0 reads its own
    indices, as it would). ``around()``: a context the rebuild runs in (the recorder's
    category for the new buckets). Wraps DDP's private ``reducer``; call after
    ``register_comm_hook``, which needs the C++ object."""
    ddp.reducer = _BucketRebuild(ddp.reducer, around)
