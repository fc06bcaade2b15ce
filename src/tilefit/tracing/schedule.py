"""The order Inductor's scheduler runs a compiled graph's nodes in: a simple, documented
stand-in for its horizontal fusion and the topological sort after it
(docs/references.md, section 19). Pure and torch-free, like tilefit.tracing.inductor_fusion, whose
GraphNode and NodePlan it reads.

Inductor fuses "horizontally" two scheduler nodes that do not depend on each other when they
read a buffer in common (at least ``config.score_fusion_memory_threshold`` bytes), loop over
the same sizes (same elements out, same elements reduced into each) and lie at most 64
scheduler nodes apart (``Scheduler.are_long_distant_nodes``); the C++ backend caps such a
kernel at 16 nodes (``config.cpp.max_horizontal_fusion_size``). A fused node then runs at the
place of its earliest member: the scheduler sorts nodes by their earliest original position
and emits each after all it depends on, depth first (``Scheduler.topological_sort_schedule``)
-- so everything a later member needs is pulled ahead of it, and what came after the earliest
member but is not needed waits until after the fused kernel, keeping its inputs alive. This is
what happens to activation-checkpointed layers: their recomputations all read the region's
input, so e.g. the RMSNorm weight-gradient reductions of several norms fuse, and the weight
gradient GEMMs between them wait, holding their MLP-sized inputs.

Here a scheduler node is an extern node, a node whose value the fusion plan writes out, or a
reduction (Inductor always realizes one); the others are inlined into their users and read
what their own inputs read. The candidates are tried in order of shared bytes, then distance;
a pair fuses when its groups still meet the conditions and no path joins them (through any
node: a fusion must not create a cycle).
"""

from __future__ import annotations

from collections.abc import Sequence

from tilefit.tracing.inductor_fusion import GRAPH_OUTPUT, GraphNode, base_value

SHARED_MIN_BYTES = 10  # torch._inductor.config.score_fusion_memory_threshold
MAX_DISTANCE = 64  # Scheduler.are_long_distant_nodes
MAX_GROUP = 16  # torch._inductor.config.cpp.max_horizontal_fusion_size
PAIR_ATTEMPTS = 64  # config.max_fusion_buffer_group_pairwise_attempts


# pointwise ops Inductor's C++ backend realizes when their value has several users, rather
# than recompute them in each (StorageBox.should_realize_on_reuse: "heavy" ops on the CPU)
_HEAVY = ("aten.exp.", "aten.sigmoid.")


def _realized(nodes: dict[int, GraphNode], node: GraphNode) -> bool:
    """Whether Inductor keeps a node's value in a buffer of its own (a scheduler node): an
    extern kernel or a reduction; a value an extern kernel, a windowed op or the graph's
    outputs read (through views); a heavy op read twice or more; a concatenation."""
    if node.view:
        return False
    if node.extern or node.reduced > 1 or node.realizes_output or node.op.startswith("aten.cat"):
        return True
    if node.op.startswith(_HEAVY) and len(node.users) > 1:
        return True
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user == GRAPH_OUTPUT:
            return True
        if user in seen:
            continue
        seen.add(user)
        u = nodes[user]
        if u.view:
            stack.extend(u.users)
        elif u.extern or u.realizes_inputs:
            return True
    return False


def _scheduled(graph: Sequence[GraphNode]) -> tuple[list[int], dict[int, int]]:
    """The graph's scheduler nodes in graph order, and each one's position among Inductor's
    scheduler nodes (a concatenation is a buffer per input and one for the whole, a
    multi-output extern kernel one more per output it returns)."""
    nodes = {n.index: n for n in graph}
    order, position, at = [], {}, 0
    for n in graph:
        if not _realized(nodes, n):
            continue
        order.append(n.index)
        at += len(n.inputs) if n.op.startswith("aten.cat") else 0
        position[n.index] = at
        at += 1 + (sum(1 for u in n.users if u != GRAPH_OUTPUT and nodes[u].view)
                   if (n.extern and n.op.endswith("backward.default")) or "rng_state" in n.op
                   else 0)
    return order, position


def _sources(nodes: dict[int, GraphNode], index: int, stop: set[int],
             input_bytes: dict[int, int]) -> dict[int, int]:
    """The values a node reads, followed back through views and the nodes not in ``stop``
    to graph inputs and nodes in ``stop``: value id -> its bytes."""
    out: dict[int, int] = {}
    stack, seen = [v for v, _ in nodes[index].inputs], set()
    while stack:
        base, _ = base_value(nodes, stack.pop())
        if base in seen:
            continue
        seen.add(base)
        if base < 0:
            out[base] = input_bytes.get(base, 0)
        elif base in stop:
            out[base] = nodes[base].out_bytes
        else:
            stack.extend(v for v, _ in nodes[base].inputs)
    return out


class _Groups:
    """Scheduler nodes merged by horizontal fusion (a union-find), with what the checks
    need: members, earliest and latest positions, and the node-level dependency edges."""

    def __init__(self, order: list[int], position: dict[int, int],
                 deps: dict[int, set[int]]) -> None:
        self.position = position
        self.parent = {n: n for n in order}
        self.members = {n: [n] for n in order}
        self.deps = deps
        self.users: dict[int, set[int]] = {n: set() for n in order}
        for n, ds in deps.items():
            for d in ds:
                self.users[d].add(n)

    def find(self, n: int) -> int:
        while self.parent[n] != n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def distance(self, a: int, b: int) -> int:
        pa = [self.position[m] for m in self.members[a]]
        pb = [self.position[m] for m in self.members[b]]
        return max(abs(min(pa) - max(pb)), abs(min(pb) - max(pa)))

    def reaches(self, a: int, b: int) -> bool:
        """Whether a path leads from group ``a`` to group ``b`` (through fused groups)."""
        stack, seen = list(self.members[a]), {a}
        while stack:
            for user in self.users[stack.pop()]:
                g = self.find(user)
                if g == b:
                    return True
                if g not in seen:
                    seen.add(g)
                    stack.extend(self.members[g])
        return False

    def try_fuse(self, x: int, y: int) -> bool:
        a, b = self.find(x), self.find(y)
        if a == b or len(self.members[a]) + len(self.members[b]) > MAX_GROUP or \
                self.distance(a, b) > MAX_DISTANCE or self.reaches(a, b) or self.reaches(b, a):
            return False
        if self.position[min(self.members[b], key=self.position.__getitem__)] < \
                self.position[min(self.members[a], key=self.position.__getitem__)]:
            a, b = b, a
        self.parent[b] = a
        self.members[a] = self.members[a] + self.members.pop(b)
        return True


def _candidates(nodes: dict[int, GraphNode], order: list[int], position: dict[int, int],
                reads: dict[int, dict[int, int]]) -> list[tuple[int, int]]:
    """Pairs of fusable-looking scheduler nodes sharing a buffer, best first."""
    readers: dict[int, list[int]] = {}
    for n in order:
        if not nodes[n].extern:
            for buf in reads[n]:
                readers.setdefault(buf, []).append(n)
    scored: dict[tuple[int, int], tuple[int, int]] = {}
    for group in readers.values():
        for i, x in enumerate(group):
            for y in group[i + 1:i + 1 + PAIR_ATTEMPTS]:
                if (x, y) in scored or (nodes[x].numel, nodes[x].reduced) != \
                        (nodes[y].numel, nodes[y].reduced):
                    continue
                shared = sum(reads[x][b] for b in reads[x].keys() & reads[y].keys())
                if shared >= SHARED_MIN_BYTES:
                    scored[(x, y)] = (shared, abs(position[y] - position[x]))
    return sorted(scored, key=lambda p: (-scored[p][0], scored[p][1]))


def graph_input_bytes(graph: Sequence[GraphNode]) -> dict[int, int]:
    """The bytes of each graph input a node reads (by its negative id)."""
    out: dict[int, int] = {}
    for n in graph:
        for value, nbytes in n.inputs:
            if value < 0:
                out[value] = max(out.get(value, 0), nbytes)
    return out


def fused_groups(graph: Sequence[GraphNode]) -> list[list[int]]:
    """The horizontally fused groups of scheduler nodes (two members or more), each in graph
    order."""
    nodes = {n.index: n for n in graph}
    order, position = _scheduled(graph)
    input_bytes = graph_input_bytes(graph)
    # what a node reads, as Inductor's kernels read it: a value not realized is recomputed
    # inline from its own inputs by each kernel that reads it (the residual stream of a
    # recomputed layer is read by every kernel after it)
    scheduled = set(order)
    reads = {n: _sources(nodes, n, scheduled, input_bytes) for n in order}
    deps = {n: {v for v in reads[n] if v >= 0} for n in order}
    groups = _Groups(order, position, deps)
    for x, y in _candidates(nodes, order, position, reads):
        groups.try_fuse(x, y)
    return [sorted(m) for m in groups.members.values() if len(m) > 1]


def schedule_order(graph: Sequence[GraphNode]) -> list[int]:
    """Every node's index in the order Inductor's scheduler runs them: each fused group at
    its earliest member's place, after all its members need, depth first."""
    nodes = {n.index: n for n in graph}
    unit = {n.index: (n.index,) for n in graph}
    for members in fused_groups(graph):
        for m in members:
            unit[m] = tuple(members)

    def needs(members: tuple[int, ...]) -> list[int]:
        return [v for m in members for v, _ in nodes[m].inputs if v >= 0 and v not in members]

    out: list[int] = []
    done: set[tuple[int, ...]] = set()
    for n in graph:
        if unit[n.index] in done:
            continue
        done.add(unit[n.index])
        stack = [(unit[n.index], iter(needs(unit[n.index])))]
        while stack:  # depth first, without recursion (graphs have thousands of nodes)
            members, pending = stack[-1]
            nxt = next((unit[v] for v in pending if unit[v] not in done), None)
            if nxt is None:
                stack.pop()
                out.extend(members)
                continue
            done.add(nxt)
            stack.append((nxt, iter(needs(nxt))))
    return out


def _lifetimes(order: Sequence[GraphNode], nodes: dict[int, GraphNode]
               ) -> tuple[dict[int, int], set[int]]:
    """Each value's last use (its step in ``order``, through its views) and the values the
    graph returns (never freed)."""
    last: dict[int, int] = {}
    outputs: set[int] = set()
    for step, n in enumerate(order):
        for value, _ in n.inputs:
            base, _ = base_value(nodes, value)
            last[base] = max(last.get(base, -1), step)
        if GRAPH_OUTPUT in n.users:
            outputs.add(base_value(nodes, n.index)[0])
    return last, outputs


def _estimate(order: Sequence[GraphNode], sizes: dict[int, int], last: dict[int, int],
              outputs: set[int]) -> list[int]:
    """Inductor's estimate of the live bytes at each step (memory.estimate_peak_memory),
    kernel by kernel: a run of consecutive generated-code nodes is one kernel, which holds
    all it allocates and all it reads at once (the estimate knows nothing of a kernel
    writing in place into an input that dies there); the graph's freeable inputs live from
    the start; a buffer is freed after the kernel of its last use unless returned."""
    freed: dict[int, int] = {}
    for value, step in last.items():
        if value not in outputs:
            freed[step] = freed.get(step, 0) + sizes.get(value, 0)
    live = sum(size for value, size in sizes.items() if value < 0)
    out: list[int] = []
    start = 0
    for step, n in enumerate(order):
        if n.extern or step + 1 == len(order) or order[step + 1].extern:
            kernel = order[start:step + 1]
            live += sum(sizes.get(k.index, 0) for k in kernel)
            out.extend([live] * len(kernel))
            live -= sum(freed.get(k, 0) for k in range(start, step + 1))
            start = step + 1
    return out


def _reuse_target(n: GraphNode, sizes: dict[int, int]) -> bool:
    """A node whose output Inductor may place in a freed buffer: a generated kernel's, or a
    GEMM's (an ATen kernel called with ``out=``)."""
    return n.index in sizes and (not n.extern or "mm." in n.op)


def reuse_holds(order: Sequence[GraphNode], materialized: set[int],
                input_bytes: dict[int, int]) -> dict[int, int]:
    """Inductor's buffer reuse (its wrapper's memory planning, ``AllocateLine.plan``): a
    buffer freed after its last use is kept for the next allocation of the same size, when
    that is the next scheduler node or when keeping it does not lift Inductor's own
    estimate of the graph's live bytes anywhere between above that estimate's peak. The
    estimate counts a kernel's output beside its inputs even where the kernel writes in
    place (a backward's first kernel, the cross-entropy gradient, over the saved logits),
    so the peak it allows is often well above what is live later, and freed buffers are
    then held far ahead. Returns value -> the node whose allocation takes its buffer
    (``order``: the graph's nodes as they run; ``materialized``: the values allocated,
    tilefit.tracing.inductor_fusion's plan; ``input_bytes``: the graph inputs the estimate counts,
    compat.compile.inductor_freeable_input)."""
    nodes = {n.index: n for n in order}
    sizes = dict(input_bytes)
    sizes.update({i: nodes[i].out_bytes for i in materialized if i in nodes
                  and not nodes[i].view})
    last, outputs = _lifetimes(order, nodes)
    est = _estimate(order, sizes, last, outputs)
    peak = max(est, default=0)
    pool: dict[int, list[tuple[int, int]]] = {}
    holds: dict[int, int] = {}
    frees: dict[int, list[int]] = {}
    for value, step in last.items():
        if value >= 0 and value in sizes and value not in outputs and not (
                nodes[value].extern and not _reuse_target(nodes[value], sizes)):
            frees.setdefault(step, []).append(value)
    for step, n in enumerate(order):
        size = sizes.get(n.index, 0)
        if _reuse_target(n, sizes) and pool.get(size):
            freed_at, value = pool[size].pop()
            between = est[freed_at + 1:step]
            if not any(sizes.get(o.index, 0) for o in order[freed_at + 1:step]) or \
                    size + max(between) <= peak:
                holds[value] = n.index
                for k in range(freed_at + 1, step):
                    est[k] += size
            else:
                pool[size].append((freed_at, value))
        for value in frees.get(step, ()):
            pool.setdefault(sizes[value], []).append((step, value))
    return holds
