"""compile=True: the step as torch.compile (Inductor) runs it, checked by hand on a tiny MLP.

The MLP is Linear(8, 16) -> GELU -> Linear(16, 4) on a batch of 32, loss = mean(y ** 2), fp32
on the CPU target, SGD. AOTAutograd's min-cut partitioner (with Inductor's decompositions:
GELU is 0.5 x (1 + erf(x / sqrt 2))) saves for the backward the first Linear's output h
(32 x 16 x 4 B = 2048 B), the GELU's output g (2048 B), the second Linear's output y
(32 x 4 x 4 B = 512 B) and the loss (4 B); the input x and the transposed weight are not new
storage. Inductor fuses the GELU's five pointwise ops into one kernel, which reads h and
writes g (2048 B each), and pow + mean into one that reads y (512 B) and writes the loss
(4 B). Nothing here runs a real torch.compile.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.compat import compile as tc
from tilefit.compat.modules import node_module
from tilefit.errors import TilefitError
from tilefit.estimator import estimate, estimate_trace
from tilefit.estimator.compiled_cost import compiled_op_time_s, kernel_time_s
from tilefit.estimator.steptime import host_time_s
from tilefit.hardware import get_device
from tilefit.recipe import Compile, Recipe
from tilefit.tracing import compiled as compiled_mod
from tilefit.tracing import schedule as sched
from tilefit.tracing import trace
from tilefit.tracing.inductor_fusion import GRAPH_OUTPUT, GraphNode, plan_kernels
from tilefit.tracing.records import Trace

B, IN, HID, OUT, F32 = 32, 8, 16, 4, 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, OUT))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


@pytest.fixture(scope="module")
def compiled_trace() -> Trace:
    return trace(_mlp, torch.randn(B, IN), loss_fn=_loss,
                 recipe=Recipe(precision="fp32", optimizer="sgd", compile=True), gpu="cpu")


def _kernels(tr: Trace, phase: str) -> list[Any]:
    return [o.kernel for o in tr.ops_of_step(0) if o.kernel is not None and o.phase == phase]


def test_the_partitioner_saves_what_the_backward_needs(compiled_trace: Trace) -> None:
    tr = compiled_trace
    first_bw = next(i for i, o in enumerate(tr.ops) if o.phase == "backward")
    saved = sorted(s.nbytes for s in tr.storages if s.phase == "forward" and s.nbytes
                   and s.alloc_at < first_bw and (s.free_at is None or s.free_at > first_bw))
    h = g = B * HID * F32
    y = B * OUT * F32
    assert saved == sorted([h, g, y, F32])  # h, GELU(h), y and the loss


def test_gelu_is_one_kernel_that_reads_h_and_writes_its_output(compiled_trace: Trace) -> None:
    gelu, loss = _kernels(compiled_trace, "forward")
    assert (gelu.ops, gelu.read_bytes, gelu.write_bytes) == (5, B * HID * F32, B * HID * F32)
    assert (loss.ops, loss.read_bytes, loss.write_bytes) == (2, B * OUT * F32, F32)
    # the first backward kernel reads the scalar tangent (broadcast: 4 B) and y, and writes
    # the loss's gradient with respect to y
    grad_y = _kernels(compiled_trace, "backward")[0]
    assert (grad_y.read_bytes, grad_y.write_bytes) == (F32 + B * OUT * F32, B * OUT * F32)


def test_fused_values_allocate_nothing(compiled_trace: Trace) -> None:
    fwd = [o for o in compiled_trace.ops_of_step(0) if o.phase == "forward" and o.compiled]
    erf = next(o for o in fwd if o.op == "aten.erf.default")
    assert erf.fused and erf.alloc_bytes == () and erf.kernel is None
    gemms = [o for o in fwd if o.kind == "gemm"]
    assert len(gemms) == 2 and not any(o.fused for o in gemms)
    # each op keeps the module whose code made it (Sequential's children are "0", "1", "2")
    assert [o.module for o in gemms] == ["0", "2"] and erf.module == "1"


def test_a_kernel_costs_its_bytes_and_one_launch(compiled_trace: Trace) -> None:
    dev = get_device("a100-80gb")
    gelu = next(o for o in compiled_trace.ops_of_step(1) if o.kernel is not None)
    bandwidth = dev.bandwidth_bytes_per_s * dev.bandwidth_efficiency
    want = 2 * B * HID * F32 / bandwidth + dev.launch_overhead_s
    est = estimate_trace(compiled_trace, dev)
    assert math.isclose(kernel_time_s(gelu.kernel, dev, est_ctx()), want)
    # the other ops of the kernel cost nothing, on the device and on the host
    erf = next(o for o in compiled_trace.ops_of_step(1) if o.op == "aten.erf.default")
    assert compiled_op_time_s(erf, dev, est_ctx()) == 0.0
    assert host_time_s(erf, dev.host, dev) == 0.0
    assert host_time_s(gelu, dev.host, dev) == dev.host.launch_s  # one launch, no Python
    assert est.step_time_s > 0


def est_ctx() -> Any:
    from tilefit.estimator.cost import CostContext

    return CostContext(precision="fp32")


def test_eager_is_unchanged() -> None:
    tr = trace(_mlp, torch.randn(B, IN), loss_fn=_loss,
               recipe=Recipe(precision="fp32", optimizer="sgd"), gpu="cpu")
    assert not tr.compiled and not any(o.compiled or o.fused or o.kernel for o in tr.ops)
    a = estimate(_mlp, torch.randn(B, IN), loss_fn=_loss,
                 recipe=Recipe(precision="fp32", optimizer="sgd"), gpu="a100-80gb")
    b = estimate(_mlp, torch.randn(B, IN), loss_fn=_loss,
                 recipe=Recipe(precision="fp32", optimizer="sgd", compile=False), gpu="a100-80gb")
    assert (a.step_time_s, a.peak_memory_bytes) == (b.step_time_s, b.peak_memory_bytes)


def test_compiled_gpu_step_issues_kernels_not_ops() -> None:
    kw: dict[str, Any] = {"loss_fn": _loss, "gpu": "a100-80gb"}
    eager = estimate(_mlp, torch.randn(B, IN), recipe=Recipe(precision="fp32", optimizer="sgd"),
                     **kw)
    comp = estimate(_mlp, torch.randn(B, IN),
                    recipe=Recipe(precision="fp32", optimizer="sgd", compile=True), **kw)
    assert comp.host_time_s < eager.host_time_s  # no per-op Python issue cost
    assert any("graph breaks are not looked for" in w for w in comp.warnings)


# ---- the grouping rule, on hand-made graphs ----------------------------------------------
def _node(i: int, *, extern: bool = False, view: bool = False,
          inputs: tuple[tuple[int, int], ...] = (), out: int = 100,
          users: tuple[int, ...] = (), **kw: bool) -> GraphNode:
    return GraphNode(index=i, op=f"op{i}", extern=extern, view=view, inputs=inputs,
                     out_bytes=out, users=users, **kw)


def test_externs_split_runs_and_internal_values_stay_in_registers() -> None:
    # x(-1) -> a -> b -> mm(c) -> d -> out; b is used by the mm only
    graph = [_node(0, inputs=((-1, 100),), users=(1,)),
             _node(1, inputs=((0, 100),), users=(2,)),
             _node(2, extern=True, inputs=((1, 100),), users=(3,)),
             _node(3, inputs=((2, 100),), users=(GRAPH_OUTPUT,))]
    plans = plan_kernels(graph)
    k0, k1 = plans[0].kernel, plans[3].kernel
    assert (k0.ops, k0.read_bytes, k0.write_bytes) == (2, 100, 100)
    assert not plans[0].materialized and plans[1].materialized and plans[1].kernel is None
    assert not plans[2].fused and plans[2].materialized
    assert (k1.read_bytes, k1.write_bytes, k1.id) == (100, 100, 1)


def test_views_launch_nothing_and_realizing_ops_split_kernels() -> None:
    views = plan_kernels([_node(0, view=True, inputs=((-1, 100),), users=(GRAPH_OUTPUT,))])
    assert views[0].kernel is None and views[0].fused
    # a -> pool (realizes its input) -> out: two kernels, a's value allocated
    graph = [_node(0, inputs=((-1, 100),), users=(1,)),
             _node(1, inputs=((0, 100),), users=(GRAPH_OUTPUT,), realizes_inputs=True)]
    plans = plan_kernels(graph)
    assert plans[0].materialized and plans[0].kernel and plans[1].kernel
    # scatter builds its output in a buffer: the next op starts a new kernel
    graph = [_node(0, inputs=((-1, 100),), users=(1,), realizes_output=True),
             _node(1, inputs=((0, 100),), users=(GRAPH_OUTPUT,))]
    plans = plan_kernels(graph)
    assert plans[0].materialized and plans[1].kernel.read_bytes == 100


# ---- the private torch APIs, each exercised on the installed torch ---------------------------
def test_each_compat_wrapper_works_on_this_torch() -> None:
    assert tc.torch_version() >= tc.COMPILE_MIN_TORCH
    assert tc.compile_support_problem() is None
    assert torch.ops.aten.gelu.default in tc.inductor_decompositions()
    assert callable(tc.inductor_partition_fn())
    assert not tc.inductor_fallback(torch.ops.aten.mul.Tensor)
    assert tc.inductor_fallback(torch.ops.aten._cdist_forward.default)
    assert tc.inductor_realizes_inputs(torch.ops.aten.max_pool2d_with_indices.default)
    assert not tc.inductor_realizes_inputs(torch.ops.aten.mul.Tensor)
    # a backward's saved activations count in Inductor's memory estimate, its parameters,
    # inputs and tangents do not
    assert tc.inductor_freeable_input("add_9") and tc.inductor_freeable_input("mm_14")
    assert not any(tc.inductor_freeable_input(n) for n in ("primals_3", "tangents_1", "arg0_1"))
    fn = tc.mark_boxed(lambda args: args)
    assert fn._boxed_call  # type: ignore[attr-defined]
    gm = torch.fx.symbolic_trace(lambda a: a + 1)
    args = [torch.ones(2)]
    assert torch.equal(tc.boxed_graph_run(torch.fx.Interpreter(gm), args), torch.full((2,), 2.0))
    assert args == []  # the boxed convention: the inputs are handed over
    seen: list[str] = []

    def compiler(g: torch.fx.GraphModule, _: Any) -> Any:
        seen.append("graph")
        return g

    lin = nn.Linear(2, 2)
    tc.aot_capture(_Tuple(lin), [torch.ones(3, 2)], fw_compiler=compiler, bw_compiler=compiler,
                   partition_fn=tc.inductor_partition_fn(),
                   decompositions=tc.inductor_decompositions())
    assert seen == ["graph", "graph"]  # forward and backward, both now
    assert tc.dynamo_graph_breaks(lambda x: x + 1, torch.ones(2)) == []
    leaves, spec = tc.flatten_batch({"a": torch.ones(1), "b": (2, torch.zeros(1))})
    assert len(leaves) == 3 and set(tc.unflatten_batch(leaves, spec)) == {"a", "b"}
    node = next(iter(gm.graph.nodes))
    node.meta["nn_module_stack"] = {"h.0": ("h.0", nn.Linear)}
    assert node_module(node) == "h.0"  # record_module_paths: the MLP test above


class _Tuple(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.inner(x).sum(),)


# ---- bad input -----------------------------------------------------------------------------
def test_an_op_inductor_cannot_fuse_is_extern_and_listed() -> None:
    def build() -> nn.Module:
        return nn.Linear(IN, HID)

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(model(x)).real.mean()  # Inductor falls back to ATen's FFT

    tr = trace(build, torch.randn(B, IN), loss_fn=loss,
               recipe=Recipe(precision="fp32", optimizer="sgd", compile=True), gpu="cpu")
    fft = [o for o in tr.ops_of_step(1) if o.op == "aten._fft_r2c.default"]
    assert fft and fft[0].compiled and not fft[0].fused
    assert any("cannot fuse" in w and "aten._fft_r2c.default" in w for w in tr.warnings)


def test_a_torch_without_what_compile_needs_is_an_error(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(compiled_mod, "compile_support_problem",
                        lambda: "torch 2.3.0 is older than 2.11")
    with pytest.raises(TilefitError, match=r"torch >= 2\.11"):
        trace(_mlp, torch.randn(B, IN), loss_fn=_loss,
              recipe=Recipe(precision="fp32", compile=True), gpu="cpu")
    result = CliRunner().invoke(app, ["estimate", "gpt2", "--compile", "--seq", "32"])
    assert result.exit_code == 2
    assert "torch >= 2.11" in " ".join(result.output.split())


def test_graph_breaks_are_listed_when_asked_for() -> None:
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = model(x)
        print(end="")  # Dynamo cannot trace print: a graph break
        return y.pow(2).mean()

    tr = trace(_mlp, torch.randn(B, IN), loss_fn=loss,
               recipe=Recipe(precision="fp32", compile=Compile(graph_breaks=True)), gpu="cpu")
    assert "1 graph break(s)" in tr.warnings[0] and "print" in tr.warnings[0]


def test_a_logger_call_is_a_listed_graph_break() -> None:
    # transformers' warning_once that use_cache is incompatible with checkpointing is such a
    # call (there Dynamo counts the break but leaves it out of explain()'s break_reasons;
    # dynamo_graph_breaks lists the counted ones too)
    import logging

    log = logging.getLogger("tilefit.test")

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = model(x)
        log.warning("inside the loss")
        return y.pow(2).mean()

    tr = trace(_mlp, torch.randn(B, IN), loss_fn=loss,
               recipe=Recipe(precision="fp32", compile=Compile(graph_breaks=True)), gpu="cpu")
    assert "1 graph break(s)" in tr.warnings[0]
    assert "logging.Logger" in tr.warnings[0]


class _Block(nn.Module):
    """Linear(16, 16) -> GELU, checkpointed the way Hugging Face's layers are: through
    ``self._gradient_checkpointing_func`` once ``gradient_checkpointing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HID, HID)
        self.gradient_checkpointing = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing:
            return self._gradient_checkpointing_func(self.body, x)  # type: ignore[no-any-return]
        return self.body(x)


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None) -> None:
        kwargs = gradient_checkpointing_kwargs or {}
        for block in self.blocks:
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = (  # type: ignore[assignment]
                lambda fn, *a, **k: torch.utils.checkpoint.checkpoint(fn, *a, **k, **kwargs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _saved_for_backward(tr: Trace) -> list[int]:
    first_bw = next(i for i, o in enumerate(tr.ops) if o.phase == "backward")
    return sorted(s.nbytes for s in tr.storages if s.phase == "forward" and s.nbytes
                  and s.alloc_at < first_bw and (s.free_at is None or s.free_at > first_bw))


def test_checkpointed_regions_save_only_their_boundary() -> None:
    # two blocks z = W x + b, a = GELU(z) on x (32 x 16), loss = mean(a2 ** 2). Compiled
    # without checkpointing the forward saves z1, a1, z2 (32 x 16 x 4 B each; the loss, 4 B,
    # is alive too: the step holds it):
    # a2 = GELU(z2) is recomputed by the backward from z2, which GELU's derivative needs
    # anyway. With both blocks checkpointed every node inside them is recomputed, so the
    # forward saves only what crosses a region's boundary and is not a graph input: a1, the
    # first block's output and the second's input (x and the weights are inputs), beside the
    # loss
    x = torch.randn(B, HID)
    plain = trace(_TwoBlocks, x, loss_fn=_loss, recipe=Recipe(precision="fp32", compile=True),
                  gpu="cpu")
    ckpt = trace(_TwoBlocks, x, loss_fn=_loss,
                 recipe=Recipe(precision="fp32", grad_checkpointing=True, compile=True), gpu="cpu")
    act = B * HID * F32
    assert _saved_for_backward(plain) == [F32, act, act, act]
    assert _saved_for_backward(ckpt) == [F32, act]
    # the recomputation runs in the backward: each block's GEMM once more
    gemms = [o for o in ckpt.ops_of_step(0) if o.phase == "backward" and o.kind == "gemm"]
    plain_gemms = [o for o in plain.ops_of_step(0) if o.phase == "backward" and o.kind == "gemm"]
    assert len(gemms) == len(plain_gemms) + 2


# ---- Inductor's scheduler order and buffer reuse, on hand-made graphs --------------------------
def _sum(i: int, inputs: tuple[tuple[int, int], ...], users: tuple[int, ...]) -> GraphNode:
    return GraphNode(index=i, op=f"aten.sum.{i}", extern=False, view=False, inputs=inputs,
                     out_bytes=4, users=users, numel=1, reduced=100)


def _mm(i: int, inputs: tuple[tuple[int, int], ...], users: tuple[int, ...],
        out: int = 400) -> GraphNode:
    return GraphNode(index=i, op=f"aten.mm.{i}", extern=True, view=False, inputs=inputs,
                     out_bytes=out, users=users, numel=out // 4)


def test_independent_reductions_sharing_an_input_fuse_and_run_at_the_first() -> None:
    # sum0(x) ; mm1(x) -> mm2 ; mm3(x) ; sum4(x, mm2): sum0 and sum4 read x and reduce the
    # same sizes without depending on each other, so Inductor fuses them into one kernel at
    # sum0's place; mm2, which sum4 needs, runs before it, and mm3, needed by nothing in the
    # kernel, waits until after it
    x = (-1, 400)
    graph = [_sum(0, (x,), (GRAPH_OUTPUT,)), _mm(1, (x,), (2,)), _mm(2, ((1, 400),), (4,)),
             _mm(3, (x,), (GRAPH_OUTPUT,)), _sum(4, (x, (2, 400)), (GRAPH_OUTPUT,))]
    assert sched.fused_groups(graph) == [[0, 4]]
    assert sched.schedule_order(graph) == [1, 2, 0, 4, 3]
    # a path between them (sum4 reads sum0's value through mm2) forbids the fusion
    graph[0] = _sum(0, (x,), (1,))
    graph[1] = _mm(1, ((0, 4),), (2,))
    assert sched.fused_groups(graph) == []
    assert sched.schedule_order(graph) == [0, 1, 2, 3, 4]


def test_a_freed_buffer_is_held_for_the_next_of_its_size_below_the_estimated_peak() -> None:
    # mm0(x) 400 B -> mm1 100 B -> mm2 100 B -> mm3 400 B: mm0 dies at mm1 and mm3 is the
    # next allocation of its size. Holding it lifts the estimate at mm2 from 200 to 600 B.
    # Without x counted the estimated peak is 500 B (mm0 + mm1 at mm1, mm2 + mm3 at mm3): no
    # hold; with x counted (400 B, freed after mm0) it is 800 B at mm0, and mm3 takes
    # mm0's buffer
    x = (-1, 400)
    graph = [_mm(0, (x,), (1,)), _mm(1, ((0, 400),), (2,), out=100),
             _mm(2, ((1, 100),), (3,), out=100), _mm(3, ((2, 100),), (GRAPH_OUTPUT,))]
    assert sched.reuse_holds(graph, {0, 1, 2, 3}, {}) == {}
    assert sched.reuse_holds(graph, {0, 1, 2, 3}, {-1: 400}) == {0: 3}


def test_an_add_of_a_gemm_becomes_one_addmm_where_the_sum_is_needed() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b) + c

    gm = make_fx(f)(torch.randn(4, 3), torch.randn(3, 5), torch.randn(5))
    assert compiled_mod.fuse_addmm(gm, cpu=True) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.addmm.default]
    # on a GPU an add read only by pointwise ops stays apart (Inductor fuses it into them)
    gm = make_fx(lambda a, b, c: (torch.mm(a, b) + c).relu())(
        torch.randn(4, 3), torch.randn(3, 5), torch.randn(5))
    assert compiled_mod.fuse_addmm(gm, cpu=False) == 0


def test_a_tied_parameter_is_lifted_once() -> None:
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    aliases = tc.tied_parameter_aliases(model)
    assert [(m, n, o, on) for m, n, o, on in aliases] == [(head, "weight", emb, "weight")]
    stand_in = nn.Parameter(torch.zeros(10, 4))
    emb._parameters["weight"] = stand_in
    with tc.tied_while_traced(aliases):
        assert head.weight is stand_in
    assert head.weight is not stand_in


@torch.library.custom_op("tilefit_test::halve_", mutates_args=("x",))
def _halve_(x: torch.Tensor) -> None:
    x.mul_(0.5)


@_halve_.register_fake
def _(x: torch.Tensor) -> None:
    return None


class _Halving(nn.Module):
    """A linear layer on its input times a scale that a custom op halves in place (a user's
    mutating op, on a tensor autograd does not track)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones_like(x)
        torch.ops.tilefit_test.halve_(scale)
        return self.fc(x * scale)


def test_a_mutating_custom_op_runs_in_place_under_compile() -> None:
    # AOTAutograd wraps the op as auto_functionalized(_v2), which a dispatch mode cannot run
    # without a rule: the trace used to fail with NotImplementedError. It now records the op
    # once, writing the scale in place: no clone of it, as Inductor reinplaces. The rule is
    # registered for the trace only: torch's global table is as it was before, after it.
    before = {v: tc.registered_modes(v) for v in ("auto_functionalized", "auto_functionalized_v2")}
    tr = trace(_Halving, torch.randn(B, IN), loss_fn=_loss,
               recipe=Recipe(precision="fp32", optimizer="sgd", compile=True), gpu="cpu")
    assert {v: tc.registered_modes(v) for v in before} == before
    halves = [op for op in tr.ops if op.op.startswith("tilefit_test.halve_")]
    linears = [op for op in tr.ops if op.op == "aten.addmm.default" and op.phase == "forward"]
    assert len(halves) == len(linears) >= 1  # once per traced step, like the layer's GEMM
    assert all(op.phase == "forward" and op.compiled for op in halves)
    assert all(op.bytes == 2 * B * IN * 4 for op in halves)  # reads and writes the scale
    clones = [op for op in tr.ops if op.phase == "forward" and "clone" in op.op]
    assert clones == []
    # the extern-kernel note names the user's op, not the wrapper AOTAutograd put around it
    extern = next(w for w in tr.warnings if "cannot fuse" in w)
    assert extern.endswith("tilefit_test.halve_.default") and "auto_functionalized" not in extern


def test_fused_ce_with_compile_is_a_clear_error() -> None:
    from tilefit.recipe import Recipe

    with pytest.raises(TilefitError, match=r"not predicted under torch\.compile") as err:
        Recipe(batch_size=1, precision="bf16-mixed", fused_ce=True, compile=True)
    assert "Recipe(compile=None)" in err.value.fix and "Recipe(fused_ce=False)" in err.value.fix
    result = CliRunner().invoke(app, ["estimate", "gpt2", "--gpu", "a100-80gb", "--fused-ce",
                                      "--compile"])
    assert result.exit_code != 0 and "not predicted under torch.compile" in result.output
    # the command line's words: the flags that undo each
    assert "drop --compile" in result.output and "--no-fused-ce" in result.output
