"""The training step as torch.compile (Inductor, default mode) runs it, on fake tensors.

``capture_step`` hands the step's loss computation (``loss_fn(model, batch)``) to
AOTAutograd as Dynamo's Inductor backend does (tilefit.compat.compile.aot_capture):
the joint forward+backward graph is traced with Inductor's decompositions and split by
Inductor's partition function (its joint-graph passes and the min-cut rematerialization
partitioner), which decides what the forward saves for the backward and what the backward
recomputes (docs/references.md, section 19). The forward and backward graphs then run, node
by node, under the trace's Recorder inside AOTAutograd's own runtime (an autograd.Function:
its saved tensors live from the forward to the backward, each graph frees a value at its last
use), so the memory timeline is the compiled step's. Each node carries Inductor's plan for
it (tilefit.tracing.inductor_fusion): fused into a kernel or run as an extern ATen kernel, and
whether its value is ever allocated.

The whole loss computation is one graph, as torch.compile(fullgraph=True) would capture it:
graph breaks are not predicted (``graph_breaks`` lists Dynamo's). Module hooks tag each
node with the module that made it while the forward is traced. The optimizer step stays
eager.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from tilefit.compat.compile import (
    COMPILE_MIN_TORCH,
    aot_capture,
    boxed_graph_run,
    compile_support_problem,
    dynamo_graph_breaks,
    flatten_batch,
    functionalized_op,
    inductor_decompositions,
    inductor_fallback,
    inductor_freeable_input,
    inductor_partition_fn,
    inductor_realizes_inputs,
    mark_boxed,
    rng_wrapped_call,
    tied_parameter_aliases,
    tied_while_traced,
    unflatten_batch,
    without_first_call_checks,
)
from tilefit.compat.modules import node_module, record_module_paths
from tilefit.errors import TilefitError
from tilefit.tracing.inductor_fusion import GRAPH_OUTPUT, GraphNode, NodePlan, plan_kernels
from tilefit.tracing.schedule import graph_input_bytes, reuse_holds, schedule_order
from tilefit.tracing.shapes import classify
from tilefit.vocab import EXTERN_KINDS


def check_compile_supported() -> None:
    """An error naming the torch version needed when this torch cannot predict compile."""
    problem = compile_support_problem()
    if problem is None:
        return
    need = ".".join(map(str, COMPILE_MIN_TORCH))
    raise TilefitError(
        f"predicting torch.compile needs torch >= {need} with Inductor: {problem}",
        expected=f"torch >= {need} (AOTAutograd's capture, Inductor's partitioner and "
        "decompositions)", given=f"torch {torch.__version__}",
        fix=f"pip install 'torch>={need}', or pass Recipe(compile=None)")


class LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module of the batch's tensors returning ``(loss,)``
    (or the tensors ``loss_fn`` returns, where it returns a tuple): the shape AOTAutograd's
    capture takes; a tied weight is one parameter of it."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 leaves: list[Any], spec: Any,
                 context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn
        self._context = context
        self._leaves, self._spec = leaves, spec
        self._tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self._ties = tied_parameter_aliases(model)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Each parameter once, tied ones too, as Dynamo lifts them: AOTAutograd asks with
        remove_duplicate=False; the tied slots are pointed at the traced stand-in in
        forward (compat.compile.tied_while_traced)."""
        return super().named_parameters(prefix, recurse, remove_duplicate=True)

    def tensors(self) -> list[torch.Tensor]:
        return [self._leaves[i] for i in self._tensor_at]

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for i, t in zip(self._tensor_at, tensors, strict=True):
            leaves[i] = t
        with self._context(), record_module_paths(self.model), tied_while_traced(self._ties):
            out = self._loss_fn(self.model, unflatten_batch(leaves, self._spec))
        return tuple(out) if isinstance(out, tuple) else (out,)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    return 0


# Ops whose inputs Inductor realizes in memory beyond its needs_realized_inputs: pooling
# reads windows of its input (its lowering realizes it; a pointwise producer would be
# recomputed for every window). Ops that write into a copy of their first input (Inductor's
# scatter lowering: a buffer initialised from it, then a scatter kernel), so their output is
# a buffer of its own; their inputs are read inline.
_WINDOWED = re.compile(r"(aten|prims)\.(_low_memory_max_pool|max_pool|avg_pool|adaptive_)")
_SCATTER = re.compile(r"aten\.(scatter|index_put|_unsafe_index_put|_unsafe_masked_index_put|"
                      r"index_add|index_reduce|embedding_dense_backward|_embedding_bag)")


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, tuple | list):
        return next((_numel(v) for v in value if isinstance(v, torch.Tensor)), 0)
    return 0


def _reduced(node: fx.Node) -> int:
    """Elements a reduction (an op tagged torch.Tag.reduction) reduces into each output
    element; 1 for any other op."""
    if torch.Tag.reduction not in getattr(node.target, "tags", ()):
        return 1
    out = _numel(node.meta.get("val"))
    biggest = max((_numel(a.meta.get("val")) for a in node.all_input_nodes), default=0)
    return max(1, biggest // out) if out else 1


def describe_graph(gm: fx.GraphModule) -> tuple[list[GraphNode], dict[str, int]]:
    """The op nodes of a graph as tilefit.tracing.inductor_fusion reads them, and each node's index
    by name."""
    ids: dict[fx.Node, int] = {}
    placeholders = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders += 1
            ids[node] = -placeholders
        elif node.op == "call_function":
            ids[node] = len(ids) - placeholders
    out: list[GraphNode] = []
    for node, index in ids.items():
        if index < 0:
            continue
        target = node.target
        view = target is operator.getitem or classify(target) == "view"
        extern = not view and (classify(target) in EXTERN_KINDS or inductor_fallback(target))
        inputs = tuple((ids[a], _nbytes(a.meta.get("val"))) for a in node.all_input_nodes
                       if a in ids)
        users = tuple(GRAPH_OUTPUT if u.op == "output" else ids[u] for u in node.users
                      if u.op == "output" or u in ids)
        out.append(GraphNode(index=index, op=str(target), extern=extern, view=view,
                             inputs=inputs, out_bytes=_nbytes(node.meta.get("val")),
                             users=users, realizes_inputs=not view and (
                                 inductor_realizes_inputs(target)
                                 or bool(_WINDOWED.match(str(target)))),
                             realizes_output=bool(_SCATTER.match(str(target))),
                             numel=_numel(node.meta.get("val")), reduced=_reduced(node)))
    return out, {n.name: i for n, i in ids.items() if i >= 0}


# A layout copy Inductor makes at the start of a graph: an extern copy, allocated.
_COPY = NodePlan(fused=False, kernel=None, materialized=True)


def channels_last_inputs(gm: fx.GraphModule) -> set[int]:
    """The graph inputs Inductor copies to channels-last on the CPU: with oneDNN, a graph
    with convolutions runs them channels-last (its layout optimization, decide_layout_opt),
    so each 4-d convolution input or weight that arrives as a graph input in another layout
    is copied once, and the copy is what the backward keeps
    (docs/references.md, section 19)."""
    position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or classify(node.target) != "conv" or \
                "backward" in str(node.target):
            continue
        for arg in node.args[:2]:
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if arg in position and isinstance(val, torch.Tensor) and val.dim() == 4 \
                    and not val.is_contiguous(memory_format=torch.channels_last):
                out.add(position[arg])
    return out


def _addmm_match(add: fx.Node, cpu: bool) -> tuple[fx.Node, fx.Node] | None:
    """(the GEMM, the other addend) when Inductor's post-grad pass turns ``add`` into one
    addmm: an add of an mm whose only user it is and of a tensor of the same dtype that
    broadcasts to the mm's shape; on a GPU not when only pointwise ops read the sum (they
    would fuse the bias add instead: should_prefer_unfused_addmm)."""
    if add.target is not torch.ops.aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    for mm, other in (add.args, add.args[::-1]):
        if not (isinstance(mm, fx.Node) and isinstance(other, fx.Node)) or \
                mm.target is not torch.ops.aten.mm.default or len(mm.users) != 1:
            continue
        got, want = other.meta.get("val"), mm.meta.get("val")
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or \
                got.dtype != want.dtype or \
                torch.broadcast_shapes(got.shape, want.shape) != want.shape:
            continue
        if not cpu and add.users and all(
                torch.Tag.pointwise in getattr(u.target, "tags", ()) for u in add.users):
            continue
        return mm, other
    return None


def fuse_addmm(gm: fx.GraphModule, cpu: bool) -> int:
    """Inductor's post-grad ``addmm`` pattern (torch/_inductor/fx_passes/post_grad.py):
    ``add(mm(a, b), c)`` becomes ``addmm(c, a, b)`` at the add's place, so the GEMM runs
    where the sum is needed and its inputs live until then (a tied embedding's gradient:
    the output layer's weight gradient waits for the embedding's, at the end of the
    backward, holding the logits' gradient). Returns how many adds it replaced."""
    done = 0
    for add in list(gm.graph.nodes):
        match = _addmm_match(add, cpu) if add.op == "call_function" else None
        if match is None:
            continue
        mm, other = match
        with gm.graph.inserting_before(add):
            fused = gm.graph.call_function(torch.ops.aten.addmm.default, (other, *mm.args))
        fused.meta = dict(add.meta)
        add.replace_all_uses_with(fused)
        gm.graph.erase_node(add)
        gm.graph.erase_node(mm)
        done += 1
    return done


class _PlannedInterpreter(fx.Interpreter):
    """Runs a graph node by node, each inside the recorder's ``compiled_node`` context."""

    def __init__(self, gm: fx.GraphModule, plans: dict[str, NodePlan], recorder: Any,
                 holds: dict[str, str] | None = None) -> None:
        super().__init__(gm)
        self._plans = plans
        self._recorder = recorder
        # values kept past their last use until a later node's allocation takes their
        # buffer (Inductor's buffer reuse: tilefit.tracing.schedule.reuse_holds)
        self._holds = holds or {}
        self._release: dict[str, list[str]] = {}
        for value, taker in self._holds.items():
            self._release.setdefault(taker, []).append(value)
        self._held: dict[str, Any] = {}

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        wrapped = rng_wrapped_call(target, args, kwargs)
        if wrapped is None:
            return super().call_function(target, args, kwargs)
        op, op_args, op_kwargs, returns_state = wrapped
        out = op(*op_args, **op_kwargs)
        # the generator's state, saved for the backward's replay: a few bytes, not traced
        return (torch.empty(0, dtype=torch.uint8), out) if returns_state else out

    def run_node(self, n: fx.Node) -> Any:
        for name in self._release.pop(n.name, ()):
            self._held.pop(name, None)  # its buffer becomes this node's output
        plan = self._plans.get(n.name)
        if plan is None:
            out = super().run_node(n)
        else:
            with self._recorder.compiled_node(plan, node_module(n)):
                out = super().run_node(n)
        if n.name in self._holds:
            self._held[n.name] = out
        return out


@dataclass
class GraphCompiler:
    """The fw_compiler / bw_compiler AOTAutograd calls: plan each graph's kernels and return
    a boxed function that runs it under the recorder."""

    recorder: Any
    cpu: bool  # the target is the CPU (Inductor's C++ backend with oneDNN)
    kernels: int = 0
    fallbacks: set[str] = field(default_factory=set)

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        fuse_addmm(gm, self.cpu)
        nodes, index = describe_graph(gm)
        by_index = plan_kernels(nodes, first_kernel_id=self.kernels)
        order = schedule_order(nodes)
        run_in_order(gm, order, index)
        holds = _reuse_holds(gm, nodes, order, by_index, index)
        self.kernels += sum(1 for p in by_index.values() if p.kernel is not None)
        self.fallbacks.update(fallback_ops(gm))
        plans = {name: by_index[i] for name, i in index.items()}
        recorder = self.recorder
        relayout = channels_last_inputs(gm) if self.cpu else set()

        def run(args: list[Any]) -> Any:
            for i in relayout:  # copied to channels-last as the graph starts: a copy of
                with recorder.compiled_node(_COPY):  # the same bytes (the graph's views
                    args[i] = args[i].clone()  # were traced in the original layout)
            return boxed_graph_run(_PlannedInterpreter(gm, plans, recorder, holds), args)

        return mark_boxed(run)


def _reuse_holds(gm: fx.GraphModule, nodes: list[GraphNode], order: list[int],
                 plans: dict[int, NodePlan], index: dict[str, int]) -> dict[str, str]:
    """reuse_holds by node name: value -> the node whose allocation takes its buffer."""
    by_index = {n.index: n for n in nodes}
    name = {i: n for n, i in index.items()}
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    # graph inputs have ids -1, -2, ...: input i is id -1 - i
    counted = {v: nbytes for v, nbytes in graph_input_bytes(nodes).items()
               if inductor_freeable_input(inputs[-1 - v])}
    holds = reuse_holds([by_index[i] for i in order],
                        {i for i, p in plans.items() if p.materialized}, counted)
    return {name[v]: name[k] for v, k in holds.items()}


def run_in_order(gm: fx.GraphModule, order: list[int], index: dict[str, int]) -> None:
    """Move the graph's op nodes into ``order`` (node indices as describe_graph numbers
    them: tilefit.tracing.schedule's order), so that each value is freed after its last use
    in the order Inductor's generated code runs."""
    by_index = {index[n.name]: n for n in gm.graph.nodes if n.name in index}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for i in order:
        output.prepend(by_index[i])


def fallback_ops(gm: fx.GraphModule) -> set[str]:
    """The graph's ops Inductor runs as ATen kernels that are not GEMMs, convolutions or
    attention (ops it has no lowering for): extern kernels the estimate lists."""
    out = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = functionalized_op(node.target, node.args)
        kind = classify(target)
        if kind != "view" and kind not in EXTERN_KINDS and inductor_fallback(target):
            out.add(str(target))
    return out


@dataclass
class CompiledStep:
    """The captured loss computation: call ``loss()`` to run the compiled forward (its
    backward runs at ``loss.backward()``)."""

    fn: Callable[..., Any]
    inputs: list[torch.Tensor]
    compiler: GraphCompiler
    breaks: list[str] | None = None  # Dynamo's graph breaks, when looked for
    checkpointed: bool = False  # activation checkpointing, as Dynamo's tagged regions

    def loss(self) -> torch.Tensor:
        with without_first_call_checks():  # what the steady calls run, no more
            return self.fn(*self.inputs)[0]  # type: ignore[no-any-return]

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """Ops Inductor cannot fuse beyond GEMMs, convolutions and attention."""
        return tuple(sorted(self.compiler.fallbacks))


def capture_step(model: nn.Module, batch: Any,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 recorder: Any, *, cpu: bool,
                 forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
                 checkpointed: bool = False) -> CompiledStep:
    """Capture and partition ``loss_fn(model, batch)`` (call under the trace's fake mode,
    outside the recorder: tracing records nothing); ``cpu``: the target is the CPU;
    ``forward_context``: entered around each trace of the forward (the target's
    autocast); ``checkpointed``: the model's checkpointed layers run through
    ``compat.compile.checkpoint_region_tagger`` (the partitioner recomputes them)."""
    check_compile_supported()
    leaves, spec = flatten_batch(batch)
    module = LossModule(model, loss_fn, leaves, spec, forward_context)
    compiler = GraphCompiler(recorder, cpu)
    fn = aot_capture(module, module.tensors(), fw_compiler=compiler, bw_compiler=compiler,
                     partition_fn=inductor_partition_fn(),
                     decompositions=inductor_decompositions(), node_meta=checkpointed)
    return CompiledStep(fn, module.tensors(), compiler, checkpointed=checkpointed)


def graph_breaks(model: nn.Module, batch: Any,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> list[str]:
    """Where Dynamo would break the loss computation into several graphs (one line each):
    what the one-graph prediction does not model. Costs a Dynamo trace of the step."""
    return dynamo_graph_breaks(lambda b: loss_fn(model, b), batch)


def compile_notes(step: CompiledStep, breaks: list[str] | None = None,
                  mode: str = "default") -> list[str]:
    """What a compile=True trace leaves out, for the estimate's warnings; ``breaks``: the
    graph breaks Dynamo reported (None: not looked for); ``mode``: a vocab.CompileMode."""
    if breaks is None:
        graphs = "graph breaks are not looked for (Compile(graph_breaks=True) runs " \
            "Dynamo over the step to list them)"
    elif breaks:
        graphs = f"Dynamo breaks it ({len(breaks)} graph break(s)), which is not " \
            "predicted (the saved activations and kernels differ): " + "; ".join(breaks)
    else:
        graphs = "Dynamo reports no graph break"
    notes = [
        "torch.compile: the loss computation is predicted as one graph (fullgraph=True); "
        f"{graphs}. Not predicted either: Inductor's autotuning (max-autotune), compile "
        "time; fused kernels, their order and Inductor's buffer reuse follow simple rules "
        "standing in for its scheduler (docs/references.md, section 19); the optimizer "
        "step runs eager",
    ]
    if mode == "reduce-overhead":
        notes.append(
            "torch.compile mode='reduce-overhead': each graph is replayed as one CUDA graph "
            "(one replay of host time per graph, docs/references.md, section 22), the "
            "optimizer step, zero_grad and loss reads stay eager; the graphs' memory is a "
            "private pool the eager code cannot reuse. Not predicted: re-recordings (a new "
            "shape, a graph output still alive at the next replay, as gradients accumulated "
            "over micro-batches may be), Dynamo's guard checks, the warm-up and recording "
            "steps")
    if step.checkpointed:
        notes.append(
            "torch.compile with activation checkpointing: each checkpointed layer is a region "
            "the partitioner recomputes in the backward, as Dynamo's tag_activation_checkpoint "
            "makes it. Checked on this CPU against real compiled steps: peak within 5% on 3 "
            "of 4 checkpointed workloads, 12.6% under on the fourth, where Inductor's "
            "fusion of kernels 63 nodes apart reorders the backward "
            "(docs/references.md, section 19); Hugging Face models graph-break on "
            "transformers' use_cache warning unless config.use_cache=False "
            "(Compile(graph_breaks=True) lists it)")
    if step.fallbacks:
        notes.append("torch.compile: ops Inductor cannot fuse, costed as extern kernels "
                     "(ATen's or their library's own, as in eager): "
                     + ", ".join(step.fallbacks))
    return notes
