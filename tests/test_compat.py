"""tilefit.compat: private torch APIs live there and nowhere else, and each wrapper does what
it says on the installed torch, transformers and torchao."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tilefit.compat import compile as cc
from tilefit.compat.amp import unscale_grads_, update_scale_
from tilefit.compat.distributed import distributed_available, new_mem_tracker
from tilefit.compat.fake import (
    FakeTensor,
    fake_mode_active,
    flop_formula,
    holds_fake,
    is_view,
    new_fake_mode,
    storage_key,
    tree_leaves,
    tree_map,
    written_args,
)
from tilefit.compat.modules import ModulePath, buffer_slots, parameter_slots
from tilefit.errors import TilefitError
from tilefit.recipe import Recipe

SRC = Path(__file__).resolve().parent.parent / "src" / "tilefit"


# ---- the boundary ---------------------------------------------------------------------------
def _private(dotted: str) -> bool:
    """A dotted name under torch with a component that starts with an underscore (a dunder
    such as ``torch.__version__`` is public)."""
    parts = dotted.split(".")
    return parts[0] == "torch" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    """``torch.utils._pytree.tree_map`` for that attribute chain, None for other nodes."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(names)])


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of each private torch import or attribute, one per line."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            hits += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Attribute):
            hits.append((node.lineno, _dotted(node) or ""))
    kept: dict[int, str] = {}  # a chain's outer attributes repeat its private prefix
    for line, name in sorted(hits, key=lambda h: len(h[1])):
        if _private(name):
            kept.setdefault(line, name)
    return sorted(kept.items())


def test_private_torch_apis_are_used_only_in_compat() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if "compat" in path.relative_to(SRC).parts[:1]:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        offenders += [f"{path.relative_to(SRC.parent.parent)}:{line}: {name}"
                      for line, name in _private_uses(tree)]
    assert not offenders, "wrap these in tilefit.compat:\n" + "\n".join(offenders)


def test_the_boundary_check_finds_each_form() -> None:
    code = ("import torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
            "from torch._subclasses import fake_tensor\nfrom torch.utils import _pytree\n"
            "x = torch._C._current_graph_task_id()\ny = torch.utils.checkpoint.checkpoint\n"
            "z = obj._private\nv = torch.__version__\n")
    assert _private_uses(ast.parse(code)) == [
        (1, "torch._dynamo"), (2, "torch.utils._pytree.tree_map"),
        (3, "torch._subclasses.fake_tensor"), (4, "torch.utils._pytree"), (5, "torch._C")]


# ---- fake tensors, dispatch, modules, amp ---------------------------------------------------
def test_fake_mode_and_tensor_helpers() -> None:
    mode = new_fake_mode()
    assert not fake_mode_active()
    with mode:
        assert fake_mode_active()
        t = torch.empty(4, 6)
    assert isinstance(t, FakeTensor) and not fake_mode_active()
    assert not holds_fake(t) and not holds_fake(torch.ones(1))  # a bare FakeTensor: isinstance
    base = torch.ones(4, 6)
    view = base[1]
    assert is_view(view) and not is_view(base)
    assert storage_key(view.untyped_storage()) == storage_key(base.untyped_storage())
    assert storage_key(torch.ones(1).untyped_storage()) != storage_key(base.untyped_storage())
    # mm: 2 * m * k * n = 2 * 2 * 3 * 4
    mm = flop_formula(torch.ops.aten.mm.default)
    assert mm is not None and mm([2, 3], [3, 4]) == 48
    assert flop_formula(torch.ops.aten.relu.default) is None
    a, b = torch.ones(2), torch.ones(2)
    assert written_args(torch.ops.aten.add_.Tensor, (a, b), {}) == [a]
    assert written_args(torch.ops.aten.add.Tensor, (a, b), {}) == []
    tree = {"x": a, "y": (1, b)}
    assert tree_leaves(tree) == [a, 1, b]
    assert tree_map(lambda v: v * 2 if isinstance(v, int) else v, tree)["y"][0] == 2


def test_uncached_keeps_an_op_out_of_the_fake_cache_for_the_block() -> None:
    from tilefit.compat.fake import FakeTensorMode, uncached

    mm = torch.ops.aten.mm.default

    def entries() -> list[str]:  # the kinds of mm's cache entries
        return [type(v).__name__ for k, v in FakeTensorMode.cache.items() if k.key[0] is mm]

    validate = FakeTensorMode._validate_cache_key
    with new_fake_mode() as mode:
        a, b = mode.from_tensor(torch.randn(3, 4)), mode.from_tensor(torch.randn(4, 5))
        torch.mm(a, b)
        assert "_DispatchCacheValidEntry" in entries()
        with uncached(mm):
            assert entries() == []
            assert torch.mm(a, b).shape == (3, 5)  # dispatched afresh, marked uncacheable
            assert set(entries()) == {"_DispatchCacheBypassEntry"}
            assert torch.mm(a, b).shape == (3, 5)
        assert entries() == [] and FakeTensorMode._validate_cache_key is validate


def test_torchs_python_meta_kernel_is_read_off_the_op() -> None:
    from tilefit.compat.dispatch import python_meta_kernel

    meta = python_meta_kernel(torch.ops.aten.mkldnn_rnn_layer.default)
    assert meta is not None
    x, w = torch.empty(5, 3, 8, device="meta"), torch.empty(16, 8, device="meta")
    h = torch.empty(3, 4, device="meta")
    out = meta(x, w, torch.empty(16, 4, device="meta"), w[:, 0], w[:, 0], h, h, False, [], 2,
               4, 1, True, False, False, True)
    assert out[0].shape == (5, 3, 4) and out[3].shape == (0,)  # torch's: an empty workspace
    assert python_meta_kernel(torch.ops.aten._cudnn_rnn_backward.default) is None  # torch has none


def test_saved_tensors_hooks_are_seen_inside_a_checkpointed_forward_only() -> None:
    from torch.utils.checkpoint import checkpoint

    from tilefit.compat.fake import saved_tensors_hooks_active

    seen: list[bool] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(saved_tensors_hooks_active())
        return x.sin()

    assert not saved_tensors_hooks_active()
    x = torch.ones(3, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    block(x)
    # the checkpointed forward, its recompute (hooks of the recompute), then a plain call
    assert seen == [True, True, False]


def test_module_slots_replace_what_the_module_holds() -> None:
    bn = nn.BatchNorm1d(3)
    new_w = nn.Parameter(torch.zeros(3))
    parameter_slots(bn)["weight"] = new_w
    assert dict(bn.named_parameters())["weight"] is new_w
    buffer_slots(bn)["running_mean"] = None
    assert "running_mean" not in dict(bn.named_buffers())


def test_module_path_follows_forward_and_backward() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    path = ModulePath()
    seen: dict[str, Any] = {}
    model[0].register_forward_pre_hook(
        lambda *_: seen.update(current=path.current, bw=path.is_bw))
    x = torch.ones(1, 2, requires_grad=True)
    with path:
        out = model(x)
        # a hook on ReLU's output runs in the backward of the node ReLU's forward created
        out.register_hook(lambda g: seen.update(in_bw=path.is_bw, bw_current=path.current))
        out.sum().backward()
    assert seen["current"] == "Sequential.0" and seen["bw_current"] == "Sequential.1"
    assert seen["bw"] is False and seen["in_bw"] is True
    assert path.last_entered == "Sequential.1" and not path.recomputing


def test_grad_scaler_ops_unscale_and_update_by_hand() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found_inf = torch.zeros(1)
    unscale_grads_(grads, found_inf, torch.tensor([0.5]))
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0]
    assert found_inf.item() == 0.0
    unscale_grads_([torch.tensor([float("inf")])], found_inf, torch.tensor([0.5]))
    assert found_inf.item() == 1.0
    scale, growth = torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32)
    update_scale_(scale, growth, found_inf, 2.0, 0.5, 2000)  # non-finite: back off by half
    assert scale.item() == 2.0**15 and growth.item() == 0
    growth.fill_(1999)  # the 2000th finite step in a row: grow by 2, restart the count
    update_scale_(scale, growth, torch.zeros(1), 2.0, 0.5, 2000)
    assert scale.item() == 2.0**16 and growth.item() == 0


# ---- torch.compile ---------------------------------------------------------------------------
def test_checkpoint_tagger_tags_each_region_and_restores_the_meta() -> None:
    from torch.fx import traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy

    tagger = cc.checkpoint_region_tagger()
    saved = fx_traceback.current_meta
    metas = [tagger(lambda: dict(fx_traceback.current_meta)) for _ in range(2)]
    assert [m["ac_graph_id"] for m in metas] == [1, 2]
    assert all(m["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE for m in metas)
    assert fx_traceback.current_meta is saved


def test_rng_wrappers_and_functionalized_ops_are_unwrapped() -> None:
    from torch._prims import rng_prims

    op = torch.ops.aten.rand.default
    wrapped = cc.rng_wrapped_call(rng_prims.run_and_save_rng_state, (op, [2]), {})
    assert wrapped == (op, ([2],), {}, True)
    state = torch.zeros(1)
    assert cc.rng_wrapped_call(rng_prims.run_with_rng_state, (state, op, [2]), {}) == (
        op, ([2],), {}, False)
    assert cc.rng_wrapped_call(torch.ops.aten.mul.Tensor, (), {}) is None
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    inner = torch.ops.aten.add_.Tensor
    assert cc.functionalized_op(auto_functionalized, (inner,)) is inner
    assert cc.functionalized_op(torch.ops.aten.mul.Tensor, ()) is torch.ops.aten.mul.Tensor


def test_first_call_checks_are_off_inside_only() -> None:
    from torch._functorch import config

    if not hasattr(config, "check_custom_op_aliasing"):
        pytest.skip("this torch has no check_custom_op_aliasing")
    before = config.check_custom_op_aliasing
    with cc.without_first_call_checks():
        assert config.check_custom_op_aliasing is False
    assert config.check_custom_op_aliasing == before


def test_mutating_op_rule_is_registered_inside_and_undone_on_exit() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        pass

    names = ("auto_functionalized", "auto_functionalized_v2")
    before = {n: cc.registered_modes(n) for n in names}
    assert all(Mode not in modes for modes in before.values())
    with cc.mutating_ops_in_place(Mode):
        assert all(Mode in cc.registered_modes(n) for n in names)
        with cc.mutating_ops_in_place(Mode):  # nested: the outer registration is kept
            pass
        assert all(Mode in cc.registered_modes(n) for n in names)
    assert {n: cc.registered_modes(n) for n in names} == before


# ---- torch.distributed -----------------------------------------------------------------------
def test_mem_tracker_counts_a_live_tensor() -> None:
    assert distributed_available()
    tracker = new_mem_tracker()
    with tracker:
        kept = torch.empty(1024)  # 4 KiB
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak >= 4096 and kept.numel() == 1024



def test_mem_tracker_counts_a_frozen_parameter() -> None:
    # torch's MemTracker hooks every parameter of a module it enters; a frozen one (a LoRA
    # base) refuses a hook, so new_mem_tracker counts it without one
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model[0].requires_grad_(False)
    tracker = new_mem_tracker()
    tracker.track_external(model)
    with tracker:
        model(torch.ones(1, 16, requires_grad=True)).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    assert peak["Total"] >= 2 * (16 * 16 + 16) * 4 + (16 * 16 + 16) * 4  # weights + grads

# ---- transformers ----------------------------------------------------------------------------
def test_transformers_switches() -> None:
    from tilefit.compat.transformers import (
        enable_checkpointing,
        set_attention,
        use_checkpoint_function,
    )

    plain = nn.Linear(2, 2)
    set_attention(plain, "auto")  # the module's own choice: nothing to set
    with pytest.raises(TilefitError, match="needs a Hugging Face model"):
        set_attention(plain, "eager")
    with pytest.raises(TilefitError, match="gradient_checkpointing_enable"):
        enable_checkpointing(plain, None)

    class Configured(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"_attn_implementation": "sdpa"})()
            self.layer = nn.Linear(2, 2)
            self.layer.gradient_checkpointing = True
            self.layer._gradient_checkpointing_func = None

    model = Configured()
    set_attention(model, "eager")
    assert model.config._attn_implementation == "eager"
    use_checkpoint_function(model, print)
    assert model.layer._gradient_checkpointing_func is print


def test_gpu_mask_semantics_patches_and_restores() -> None:
    mu = pytest.importorskip("transformers.masking_utils")
    from tilefit.compat.transformers import gpu_mask_semantics
    from tilefit.quiet_imports import quiet_transformers

    original = getattr(mu, "_ignore_causal_mask_sdpa", None)
    if original is None:
        pytest.skip("this transformers has no _ignore_causal_mask_sdpa")
    with gpu_mask_semantics():
        # no padding mask, a full-length query: the GPU run passes is_causal=True
        assert mu._ignore_causal_mask_sdpa(None, 8, 8) is True
        with new_fake_mode():
            assert mu.find_packed_sequence_indices(torch.arange(8)[None]) is None
    assert mu._ignore_causal_mask_sdpa is original
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    with quiet_transformers():
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert hf_logging.get_verbosity() == level


# ---- torchao ---------------------------------------------------------------------------------
def test_torchao_wrappers() -> None:
    pytest.importorskip("torchao")
    from tilefit.compat import torchao as ao

    ao.torchao_float8()
    assert hasattr(ao.float8_linear_module(), "Float8Linear")
    t = torch.ones(2)
    tree = (t, [t])
    assert ao.float8_payload(t) is t and not ao.is_float8_tensor(t)
    assert not ao.holds_float8(tree) and ao.unwrap_float8(tree)[1][0] is t


def test_layer_norm_backward_gives_the_kernels_contiguous_input_gradient() -> None:
    """The CPU kernel (second method: run for real) allocates the input gradient contiguous
    whatever the output gradient's strides; the fake op, corrected, gives the same strides."""
    from tilefit.compat.fake import as_kernels_return, new_fake_mode

    op = torch.ops.aten.native_layer_norm_backward.default
    x = torch.randn(8, 64, 32)
    w, b = torch.randn(32), torch.randn(32)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [32], w, b, 1e-5)
    grad = torch.randn(8, 32, 64).transpose(1, 2)  # strides (2048, 1, 64)
    real = op(grad, x, [32], mean, rstd, w, b, [True, True, True])
    with new_fake_mode() as mode:
        args = [mode.from_tensor(t) for t in (grad, x)]
        stats = [mode.from_tensor(t) for t in (mean, rstd, w, b)]
        fake = op(args[0], args[1], [32], *stats, [True, True, True])
        fixed = as_kernels_return(op, fake)
    assert real[0].stride() == (2048, 32, 1)
    assert fixed[0].stride() == real[0].stride() and fixed[0].shape == real[0].shape
    assert [t.shape for t in fixed[1:]] == [t.shape for t in real[1:]]


class _NormThenTranspose(torch.nn.Module):
    """A layer norm whose output is used transposed (its gradient arrives non-contiguous),
    after a Linear whose backward reshapes the norm's input gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.mix = torch.nn.Parameter(torch.randn(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.fc(x))  # (4, 8, 16)
        return (y.transpose(1, 2) @ self.mix).sum()


def test_the_traced_backward_runs_the_ops_the_cpu_kernels_run() -> None:
    """Second method: the real CPU backward's ops, logged. Before the fix the trace copied the
    norm's input gradient (clone + _unsafe_view) where the CPU kernels view it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tilefit.tracing import trace

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    loss = _NormThenTranspose()(torch.randn(4, 8, 16))
    with Log() as log:
        loss.backward()
    tr = trace(_NormThenTranspose, torch.randn(4, 8, 16), loss_fn=lambda m, b: m(b),
               recipe=Recipe(precision="fp32", optimizer="sgd"), gpu="cpu")
    traced = [o.op for o in tr.ops if o.phase == "backward" and o.step == 1]
    assert "aten.clone.default" not in log.ops
    assert traced == log.ops


def test_compiling_sets_torchs_flag_for_the_capture_and_puts_it_back() -> None:
    """What model code sees under torch.compile (Dynamo folds is_compiling() to True): True
    inside, False after, also when the capture raises."""
    from tilefit.compat.compile import compiling

    assert not torch.compiler.is_compiling()
    with compiling():
        assert torch.compiler.is_compiling()
    with pytest.raises(ValueError), compiling():
        raise ValueError("a failed capture")
    assert not torch.compiler.is_compiling()


@torch.library.custom_op("tilefit_compat_tests::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_missing_fake_op_reads_torchs_own_errors() -> None:
    from tilefit.compat.fake import (
        FakeTensorMode,
        UnsupportedOperatorException,
        missing_fake_op,
    )

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(2))
        with pytest.raises(RuntimeError) as err:
            _twice(x)  # torch's own error for a custom op without a fake implementation
    assert missing_fake_op(err.value) == "tilefit_compat_tests::twice"
    unsupported = UnsupportedOperatorException(torch.ops.aten.add.Tensor)
    assert missing_fake_op(unsupported) == "aten.add.Tensor"
    assert missing_fake_op(RuntimeError("shape mismatch")) is None


def test_outside_dispatch_modes_pops_the_fake_mode_for_the_block() -> None:
    from tilefit.compat.fake import FakeTensor, new_fake_mode, outside_dispatch_modes

    with new_fake_mode():
        assert isinstance(torch.ones(1), FakeTensor)
        with outside_dispatch_modes():
            assert not isinstance(torch.ones(1), FakeTensor)  # a real tensor here
        assert isinstance(torch.ones(1), FakeTensor)  # and the mode back after


def test_inside_optimized_module_hides_the_modules_from_mod_tracker() -> None:
    from torch.distributed._tools.mod_tracker import ModTracker

    from tilefit.compat.compile import inside_optimized_module

    seen: list[set[str]] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(set(tracker.parents))
            return x

    outer = torch.nn.Sequential(Probe())
    with ModTracker() as tracker:
        outer(torch.ones(1))
        with inside_optimized_module():  # as torch.compile's OptimizedModule runs a graph
            outer(torch.ones(1))
    assert "Sequential.0" in seen[0] and "Sequential.0" not in seen[1]


def test_called_from_torch_distributed_reads_the_callers_module() -> None:
    from tilefit.compat.simulated_cuda import called_from_torch_distributed

    def ask() -> bool:
        return called_from_torch_distributed(2)  # the frame that called ask

    assert not ask()  # a test module's call
    namespace = {"__name__": "torch.distributed.tensor._api", "ask": ask}
    exec("answer = ask()", namespace)  # code whose module is torch.distributed's
    assert namespace["answer"] is True
