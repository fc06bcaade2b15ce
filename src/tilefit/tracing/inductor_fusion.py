"""Which ops of a compiled graph Inductor would fuse into one kernel, and what each kernel
moves: a simple, documented stand-in for Inductor's scheduler
(docs/references.md, section 19). Pure and torch-free: ``tilefit.tracing.compiled``
describes a graph's nodes, this module groups them.

The rule. Inductor generates code for pointwise ops, reductions and views and fuses them
into kernels; it calls ATen (an "extern" kernel) for GEMMs, convolutions, attention and any
op it has no lowering for, and a fused kernel never spans one of those. Here a fused kernel
is a maximal run of consecutive non-extern nodes in graph order between extern nodes; a node
whose inputs Inductor realizes in memory (pooling, scatter) starts a new one, and a node
whose output it builds in a buffer of its own (scatter, index_put) ends one. It
reads each value produced outside it (a graph input or another kernel's output) once, and
writes each value of its own that something outside it uses (a later kernel, an extern op,
the graph's outputs: the activations saved for backward among them). Values used only inside
it stay in registers: they are never allocated. A run of views alone launches nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tilefit.tracing.records import FusedKernel

GRAPH_OUTPUT = -1  # a user id standing for the graph's output node


@dataclass(frozen=True)
class GraphNode:
    """One op node of a graph. Values are named by the index of the node that produces
    them; graph inputs by negative ids (-1 - their position)."""

    index: int
    op: str  # the aten overload, e.g. "aten.mul.Tensor"
    extern: bool  # a GEMM, convolution, attention or fallback kernel: never fused
    view: bool  # an alias of its first input (a view, getitem of a tuple): moves nothing
    inputs: tuple[tuple[int, int], ...]  # (value id, bytes of the tensor read)
    out_bytes: int  # bytes of the tensor(s) it returns
    # indices of the nodes using its value; GRAPH_OUTPUT for the graph's outputs (a user is
    # never a graph input, so the id -1 is not ambiguous here)
    users: tuple[int, ...]
    # Inductor realizes this op's inputs in memory (pooling reads windows of them; its
    # needs_realized_inputs): a fused kernel ends before it
    realizes_inputs: bool = False
    # Inductor builds this op's output in a buffer of its own (a scatter or index_put writes
    # into a copy of its input): a fused kernel ends after it
    realizes_output: bool = False
    numel: int = 0  # elements of its (first) output
    # elements reduced into each output element: > 1 for a reduction (sum, mean, amax...),
    # which Inductor always realizes in a buffer of its own (tilefit.tracing.schedule)
    reduced: int = 1


@dataclass(frozen=True)
class NodePlan:
    """What Inductor does with one node: runs it in a fused kernel (``kernel`` set on the
    kernel's first node only; ``fused`` on all its nodes) or as an extern kernel, and
    whether its value is allocated."""

    fused: bool
    kernel: FusedKernel | None
    materialized: bool


def base_value(nodes: dict[int, GraphNode], value: int, nbytes: int = 0) -> tuple[int, int]:
    """The value a view aliases, followed through chains of views, and the bytes reading
    the view moves: no more than its base holds (a broadcast reads its base once)."""
    while value >= 0 and nodes[value].view and nodes[value].inputs:
        value, base_bytes = nodes[value].inputs[0]
        nbytes = min(nbytes, base_bytes)
    return value, nbytes


def _needed_outside(nodes: dict[int, GraphNode], index: int, group: set[int]) -> bool:
    """Whether a value is used outside the group, directly or through views of it."""
    stack, seen = [index], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in nodes[n].users:
            if user == GRAPH_OUTPUT or user not in group:
                return True
            if nodes[user].view:
                stack.append(user)
    return False


def _kernel(kernel_id: int, members: list[GraphNode], nodes: dict[int, GraphNode]
            ) -> tuple[FusedKernel | None, set[int]]:
    """The fused kernel of one run of nodes (None for views alone) and the members whose
    values it writes out."""
    group = {m.index for m in members}
    compute = [m for m in members if not m.view]
    if not compute:
        return None, set()
    read: dict[int, int] = {}
    for m in compute:
        for value, nbytes in m.inputs:
            base, moved = base_value(nodes, value, nbytes)
            if base not in group:
                read[value] = max(read.get(value, 0), moved)
    written = {m.index for m in compute if _needed_outside(nodes, m.index, group)}
    write_bytes = sum(nodes[i].out_bytes for i in written)
    return FusedKernel(id=kernel_id, ops=len(compute), read_bytes=sum(read.values()),
                       write_bytes=write_bytes,
                       alloc_bytes=tuple(nodes[i].out_bytes for i in sorted(written))), written


def plan_kernels(graph: Sequence[GraphNode], first_kernel_id: int = 0) -> dict[int, NodePlan]:
    """The plan of every node of a graph (by index), fused kernels numbered from
    ``first_kernel_id``."""
    nodes = {n.index: n for n in graph}
    plans: dict[int, NodePlan] = {}
    run: list[GraphNode] = []
    next_id = first_kernel_id

    def close() -> None:
        nonlocal next_id
        if not run:
            return
        kernel, written = _kernel(next_id, run, nodes)
        if kernel is not None:
            next_id += 1
        lead = next((m.index for m in run if not m.view), None)
        for m in run:
            plans[m.index] = NodePlan(fused=True, kernel=kernel if m.index == lead else None,
                                      materialized=m.view or m.index in written)
        run.clear()

    for node in graph:
        if node.extern:
            close()
            plans[node.index] = NodePlan(fused=False, kernel=None, materialized=True)
            continue
        if node.realizes_inputs and not node.view:
            close()
        run.append(node)
        if node.realizes_output and not node.view:
            close()
    close()
    return plans
