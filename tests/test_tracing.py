"""The trace: memory against an independent measurement, FLOPs against the textbook formula,
and the target semantics (autocast, attention kernel, optimizer, checkpointing, rounding)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.recipe import Compile, Recipe
from tilefit.tracing import trace
from tilefit.vocab import MICRO_PHASES


def _gpt2(n_layer: int = 2, n_embd: int = 128, n_head: int = 4, vocab: int = 1000,
          positions: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                     n_positions=positions, loss_type="ForCausalLM")
    return lambda: GPT2LMHeadModel(cfg)


def _tokens(b: int, s: int, vocab: int = 1000) -> dict[str, torch.Tensor]:
    ids = torch.arange(b * s).reshape(b, s) % vocab
    return {"input_ids": ids, "labels": ids.clone()}


def _memtracker_peak(build, batch, loss_fn, make_opt, checkpointing: bool = False) -> int:
    """Peak live tensor bytes of two real CPU steps, by PyTorch's MemTracker."""
    from tilefit.bench.step import real_step_peak_bytes

    torch.manual_seed(0)
    model = build()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = make_opt(model.parameters())

    return real_step_peak_bytes(model, opt, batch, loss_fn)


def _ce(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _hf(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("opt_name,make_opt", [
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=False)),
    ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)),
])
def test_cpu_peak_matches_memtracker_on_real_tensors(opt_name, make_opt):
    def build():
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10))

    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    real = _memtracker_peak(build, batch, _ce, make_opt)
    pred = trace(build, batch, loss_fn=_ce, recipe=Recipe(precision="fp32", optimizer=make_opt),
                 gpu="cpu").peak(
        rounded=False)[0]
    assert abs(pred - real) <= 0.001 * real, (pred, real)


def test_checkpointed_llama_peak_matches_memtracker():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                      max_position_embeddings=128)

    def build():
        return LlamaForCausalLM(cfg)

    batch = _tokens(2, 32, 500)

    def make_opt(ps):
        return torch.optim.AdamW(ps, lr=1e-4, foreach=False)

    real = _memtracker_peak(build, batch, _hf, make_opt, checkpointing=True)
    tr = trace(build, batch,
               recipe=Recipe(precision="fp32", optimizer=make_opt, grad_checkpointing=True),
               gpu="cpu")
    assert abs(tr.peak(rounded=False)[0] - real) <= 0.001 * real
    assert any(o.phase == "recompute" for o in tr.ops)


def test_gpt2_flops_match_the_training_formula_and_all_gemms_are_bf16():
    # Training FLOPs = 3 x forward (backward = 2 x forward):
    # forward = 2 * tokens * (matmul weights) + 4 * B * S^2 * d * layers,
    # matmul weights = layers * 12 d^2 (qkv 3d^2, proj d^2, mlp 8d^2) + d * V (lm head).
    L, d, V, B, S = 2, 128, 1000, 2, 64
    tr = trace(_gpt2(L, d, 4, V), _tokens(B, S, V), recipe=Recipe(precision="bf16-mixed"),
               gpu="a100-80gb")
    steady = tr.ops_of_step(1)
    flops = sum(o.flops for o in steady)
    # 2*128*(2*12*128^2 + 128*1000) + 4*2*64^2*128*2 = 133,431,296 + 8,388,608; x3:
    expected = 3 * (2 * B * S * (L * 12 * d * d + d * V) + 4 * B * S * S * d * L)
    assert expected == 425_459_712
    assert abs(flops - expected) <= 0.01 * expected
    gemm_dtypes = {g.dtype for o in steady for g in o.gemms}
    assert gemm_dtypes == {"bf16"}


def _has_square_scores(tr, s: int) -> bool:
    return any(len(shape) >= 2 and shape[-1] == s and shape[-2] == s
               for o in tr.ops for shape in o.output_shapes)


def test_flash_attention_keeps_no_score_matrix_but_eager_does():
    S = 64
    flash = trace(_gpt2(), _tokens(2, S), recipe=Recipe(precision="bf16-mixed"), gpu="a100-80gb")
    backends = {o.attention["backend"] for o in flash.ops if o.attention}
    assert backends == {"flash"}
    assert not _has_square_scores(flash, S)

    def eager_build():
        m = _gpt2()()
        m.set_attn_implementation("eager")
        return m

    eager = trace(eager_build, _tokens(2, S), recipe=Recipe(precision="bf16-mixed"),
                  gpu="a100-80gb")
    assert _has_square_scores(eager, S)
    assert eager.peak()[0] > flash.peak()[0]


def test_attention_kernel_follows_the_target():
    S = 64
    # V100 (sm70) has no flash kernel: the memory-efficient one runs fp16
    v100 = trace(_gpt2(), _tokens(2, S), recipe=Recipe(precision="fp16-mixed"), gpu="v100")
    assert {o.attention["backend"] for o in v100.ops if o.attention} == {"efficient"}
    # head dim 25 (100 / 4) is not a multiple of 8: PyTorch falls back to the math kernel
    odd = trace(_gpt2(n_embd=100, n_head=4), _tokens(2, S), recipe=Recipe(precision="bf16-mixed"),
                gpu="a100-80gb")
    assert _has_square_scores(odd, S)
    assert any("math kernel" in w for w in odd.warnings)


def test_cuda_autocast_policy_keeps_softmax_norms_and_loss_in_fp32():
    tr = trace(_gpt2(), _tokens(2, 32), recipe=Recipe(precision="bf16-mixed"), gpu="h100")
    fwd = [o for o in tr.ops_of_step(1) if o.phase == "forward"]
    by_op: dict[str, set[str]] = {}
    for o in fwd:
        by_op.setdefault(o.op.split(".")[1], set()).add(o.dtype)
    assert by_op["native_layer_norm"] == {"float32"}
    assert by_op["_log_softmax"] == {"float32"}
    assert by_op["addmm"] == {"bfloat16"}


def test_cpu_target_follows_cpu_semantics():
    tr = trace(_gpt2(), _tokens(2, 32), recipe=Recipe(precision="fp32", optimizer="adamw"),
               gpu="cpu")
    # torch.optim runs the for-loop implementation on the CPU, foreach on CUDA
    assert not any("_foreach_" in o.op for o in tr.ops)
    gpu = trace(_gpt2(), _tokens(2, 32), recipe=Recipe(precision="fp32", optimizer="adamw"),
                gpu="a100-80gb")
    assert any("_foreach_" in o.op for o in gpu.ops)


def test_gpu_peak_rounds_every_block_to_512_bytes():
    def build():
        return nn.Linear(3, 5)  # weight 60 B, bias 20 B

    batch = torch.randn(2, 3)
    tr = trace(build, batch, loss_fn=lambda m, b: m(b).sum(),
               recipe=Recipe(precision="fp32", optimizer="sgd"), gpu="a100-80gb")
    assert all(s.nbytes < 512 for s in tr.storages)
    live0 = tr.live_bytes_timeline(rounded=True)[0]
    # before the first op: weight, bias and the input, each in its own 512-byte block
    assert live0 == 3 * 512
    assert tr.live_bytes_timeline(rounded=False)[0] == 60 + 20 + 24


def test_fp16_mixed_runs_the_grad_scaler_and_bf16_needs_ampere():
    tr = trace(_gpt2(), _tokens(2, 32), recipe=Recipe(precision="fp16-mixed"), gpu="v100")
    names = {o.op.split(".")[1] for o in tr.ops}
    assert {"_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"} <= names
    with pytest.raises(TilefitError, match="no bf16"):
        trace(_gpt2(), _tokens(2, 32), recipe=Recipe(precision="bf16-mixed"), gpu="v100")


def test_checkpointing_recomputes_and_cuts_activations():
    plain = trace(_gpt2(n_layer=4), _tokens(4, 64), recipe=Recipe(precision="bf16-mixed"),
                  gpu="a100-80gb")
    ckpt = trace(_gpt2(n_layer=4), _tokens(4, 64),
                 recipe=Recipe(precision="bf16-mixed", grad_checkpointing=True), gpu="a100-80gb")
    assert any(o.phase == "recompute" for o in ckpt.ops)
    assert not any(o.phase == "recompute" for o in plain.ops)
    a_plain = plain.breakdown_at(plain.peak()[1])["activations"]
    a_ckpt = ckpt.breakdown_at(ckpt.peak()[1])["activations"]
    assert a_ckpt < 0.6 * a_plain


def test_users_module_is_never_changed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace(model, (torch.randn(4, 8), torch.randint(0, 2, (4,))), loss_fn=_ce,
          recipe=Recipe(precision="bf16-true"), gpu="a100-80gb")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype
               for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert model.training  # untouched mode


def test_meta_model_and_batch_are_traced_without_memory():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    batch = torch.empty(16, 4096, device="meta")
    tr = trace(model, batch, loss_fn=lambda m, b: m(b).sum(), gpu="a100-80gb")
    # AdamW: weights + grads + 2 states = 4 x 4096 x 4097 x 4 bytes, at least
    assert tr.peak()[0] >= 4 * 4096 * 4097 * 4


def test_value_dependent_code_gets_a_clear_error():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            y = self.inner(x)
            if y.sum().item() > 0:  # needs a real value
                return y * 2
            return y

    with pytest.raises(TilefitError) as err:
        trace(Branchy(), torch.randn(2, 4), loss_fn=lambda m, b: m(b).sum(), gpu="cpu")
    msg = str(err.value)
    assert "_local_scalar_dense" in msg and "fake tensors" in msg and "fix:" in msg


def test_bad_arguments_are_explained():
    model = nn.Linear(2, 2)
    with pytest.raises(TilefitError, match="no loss_fn"):
        trace(model, torch.randn(1, 2), gpu="cpu")
    with pytest.raises(TilefitError, match="unknown precision"):
        trace(model, torch.randn(1, 2), loss_fn=lambda m, b: m(b).sum(),
              recipe=Recipe(precision="fp7"), gpu="cpu")
    with pytest.raises(TilefitError, match="unknown optimizer"):
        trace(model, torch.randn(1, 2), loss_fn=lambda m, b: m(b).sum(),
              recipe=Recipe(precision="fp32", optimizer="lion"), gpu="cpu")
    with pytest.raises(TilefitError, match="accumulation_steps"):
        trace(model, torch.randn(1, 2), loss_fn=lambda m, b: m(b).sum(),
              recipe=Recipe(precision="fp32", accumulation_steps=0), gpu="cpu")


def test_optimizer_state_sizes_per_parameter():
    def build():
        return nn.Linear(1024, 1024, bias=False)  # 1,048,576 parameters

    n = 1024 * 1024
    batch = torch.randn(8, 1024)

    def state_bytes(opt: str) -> int:
        tr = trace(build, batch, loss_fn=lambda m, b: m(b).sum(),
                   recipe=Recipe(precision="fp32", optimizer=opt), gpu="a100-80gb")
        return sum(s.nbytes for s in tr.storages if s.category == "optimizer_state")

    assert state_bytes("sgd") == 4 * n  # momentum buffer, fp32
    # two fp32 moments; the scalar step stays in host memory (torch.optim's _init_group:
    # on the parameter's device only when fused or capturable), fused AdamW's is on the GPU
    assert state_bytes("adamw") == 8 * n
    assert state_bytes("adamw-fused") == 8 * n + 4
    # 8-bit AdamW: two uint8 moments + one fp32 absmax per 256 values per moment
    assert state_bytes("adamw-8bit") == 2 * n + 2 * 4 * math.ceil(n / 256)
    # Adafactor (torch.optim.Adafactor): the second moment factored into a row and a column
    # vector, fp32: 4 * (1024 + 1024); its step is a CPU tensor. Its step reads
    # param.norm().item(), which the trace answers with a stand-in (no shape depends on it).
    assert state_bytes("adafactor") == 4 * (1024 + 1024)


def test_value_reads_in_the_forward_still_fail_but_the_optimizers_are_stood_in():
    tr = trace(lambda: nn.Linear(64, 64), torch.randn(4, 64), loss_fn=lambda m, b: m(b).sum(),
               recipe=Recipe(precision="fp32", optimizer="adafactor"), gpu="cpu")
    assert any("stood in" in w for w in tr.warnings)


@pytest.mark.parametrize(("gpu", "recipe"), [
    ("a100-80gb", Recipe(precision="bf16-mixed")),
    ("v100", Recipe(precision="fp16-mixed", accumulation_steps=3)),
    ("h100", Recipe(precision="bf16-mixed", grad_checkpointing=True)),
    ("cpu", Recipe(precision="fp32", optimizer="sgd")),
])
def test_replayed_steady_step_equals_running_it(gpu, recipe):
    build, batch = _gpt2(), _tokens(2, 32)
    fast = trace(build, batch, recipe=recipe, gpu=gpu)
    full = trace(build, batch, recipe=recipe, gpu=gpu, replay_steady_step=False)
    _assert_same_trace(fast, full)


def _assert_same_trace(fast, full) -> None:
    assert fast.live_bytes_timeline() == full.live_bytes_timeline()
    fields = ("op", "phase", "module", "step", "micro", "bytes", "flops", "alloc_bytes")
    assert [tuple(getattr(o, f) for f in fields) for o in fast.ops] == \
        [tuple(getattr(o, f) for f in fields) for o in full.ops]
    assert fast.breakdown_at(fast.peak()[1]) == full.breakdown_at(full.peak()[1])


@pytest.mark.parametrize(("gpu", "kwargs"), [
    ("h100", {"precision": "bf16-mixed", "max_grad_norm": 1.0, "loss_sync": True}),
    ("h100", {"precision": "bf16-mixed", "zero_grad_to_none": False}),
    ("a100-80gb", {"precision": "bf16-true", "compile": Compile()}),
])
def test_replayed_second_micro_batch_equals_running_it(gpu, kwargs, monkeypatch):
    """The second micro-batch is the first's ops again, except that autograd adds each new
    gradient into the kept one (add_ where the first micro-batch detached it, the new
    gradient freed after it): op for op and byte for byte what running it records."""
    from tilefit.tracing.recorder import Recorder

    replays: list[bool] = []
    replay = Recorder.replay_micro

    def spy(self, *args):
        replays.append(replay(self, *args))
        return replays[-1]

    monkeypatch.setattr(Recorder, "replay_micro", spy)
    build, batch = _gpt2(), _tokens(2, 32)
    recipe = Recipe(batch_size=2, accumulation_steps=2, **kwargs)
    fast = trace(build, batch, recipe=recipe, gpu=gpu)
    assert replays and all(replays)
    full = trace(build, batch, recipe=recipe, gpu=gpu, replay_steady_step=False)
    _assert_same_trace(fast, full)
    second = [o for o in fast.ops if o.step == 0 and o.micro == 1]
    first = [o for o in fast.ops if o.step == 0 and o.micro == 0 and o.phase in MICRO_PHASES]

    def count(ops: list, name: str) -> int:
        return sum(1 for o in ops if o.op == name and o.phase == "backward")

    params = sum(1 for _ in build().parameters())  # lm_head is tied to wte: one gradient
    assert len(second) == len(first)
    assert count(second, "aten.add_.Tensor") - count(first, "aten.add_.Tensor") == params
    assert count(first, "aten.detach.default") - count(second, "aten.detach.default") == params


class _CachesOnFirstCall(nn.Module):
    """Keeps a tensor made by its first forward: a second micro-batch makes none."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 8)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(1000, 32, device=x.device)
        return self.fc(x + self.cache[: x.shape[0]])


def test_a_step_that_leaves_a_tensor_behind_is_run_not_replayed() -> None:
    kwargs = {"loss_fn": lambda m, b: m(b).sum(), "gpu": "cpu",
              "recipe": Recipe(precision="fp32", optimizer="sgd", accumulation_steps=2)}
    fast = trace(_CachesOnFirstCall, torch.randn(4, 32), **kwargs)
    full = trace(_CachesOnFirstCall, torch.randn(4, 32), replay_steady_step=False, **kwargs)
    _assert_same_trace(fast, full)
    cache = [s for s in fast.storages if s.nbytes == 1000 * 32 * 4 and s.phase == "forward"]
    assert len(cache) == 1  # made once, by the first micro-batch, as running it does


def test_dropout_on_a_cuda_target_is_the_fused_kernel_with_a_bool_mask() -> None:
    """CUDA's dropout is native_dropout: the fp32 output (32 x 64 x 4 B = 8192 B) and a bool
    mask (32 x 64 x 1 B = 2048 B) that the backward keeps; the CPU decomposes it (bernoulli_,
    div_, mul) with a mask in the input's dtype."""
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))

    batch = torch.empty(32, 64, device="meta")
    loss = lambda m, b: m(b).sum()  # noqa: E731
    gpu = trace(build, batch, loss_fn=loss, recipe=Recipe(precision="fp32", optimizer="sgd"),
                gpu="a100-80gb")
    (fused,) = [o for o in gpu.ops_of_step(1) if o.op == "aten.native_dropout.default"]
    assert fused.alloc_bytes == (32 * 64 * 4, 32 * 64)
    assert any(o.op == "aten.native_dropout_backward.default" for o in gpu.ops_of_step(1))
    cpu = trace(build, batch, loss_fn=loss, recipe=Recipe(precision="fp32", optimizer="sgd"),
                gpu="cpu")
    ops = {o.op for o in cpu.ops_of_step(1)}
    assert "aten.native_dropout.default" not in ops and "aten.bernoulli_.float" in ops


class _ThroughIdentity(nn.Module):
    """fc1 -> an nn.Identity (peft's lora_dropout at p=0, HF's pass-through layers) -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.skip = nn.Identity()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.skip(self.fc1(x)))


def test_backward_ops_are_not_credited_to_an_identity_module() -> None:
    # An Identity's output is its input, so ModTracker's backward hooks on that one tensor
    # left it "running" for the rest of the backward: fc1's weight gradient (mm 32x8 @ 8x16,
    # 2*32*8*16 = 8192 FLOPs) was credited to "skip". Each backward GEMM belongs to its layer.
    tr = trace(_ThroughIdentity, torch.randn(8, 16), loss_fn=lambda m, x: m(x).sum(),
               recipe=Recipe(precision="fp32", optimizer="sgd"), gpu="cpu")
    last = max(o.step for o in tr.ops)  # the steady step (the first is traced too)
    bw = [o for o in tr.ops if o.phase == "backward" and o.kind == "gemm" and o.step == last]
    assert bw and not any(o.module.startswith("skip") for o in tr.ops)
    assert {o.module for o in bw} == {"fc1", "fc2"}
    assert sum(o.flops for o in bw if o.module == "fc1") == 2 * 32 * 8 * 16


def test_out_arguments_are_written_not_read() -> None:
    # compat.fake.write_only_args: an op's out= tensor is only written (add.out reads a and b:
    # 2 x 64 B, writes c: 64 B), unless the same tensor is also an input it reads
    # (addmm(c, a, b, out=c) reads c before accumulating into it).
    from tilefit.compat.fake import write_only_args
    from tilefit.tracing.traffic import traffic

    a, b, c = torch.ones(4, 4), torch.ones(4, 4), torch.empty(4, 4)
    add_out = torch.ops.aten.add.out
    assert write_only_args(add_out, (a, b), {"out": c}) == [c]
    assert traffic([a, b, c], [c], (), write_only_args(add_out, (a, b), {"out": c})) == 3 * 64
    addmm_out = torch.ops.aten.addmm.out
    assert write_only_args(addmm_out, (c, a, b), {"out": c}) == []
    assert write_only_args(torch.ops.aten.add.Tensor, (a, b), {}) == []
