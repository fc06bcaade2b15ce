"""The estimate: costs that a second method reproduces, and the CLI around it."""

from __future__ import annotations

import json

import pytest
import torch
from tests.conftest import invoke_cli
from torch import nn

from tilefit.estimator import estimate
from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device
from tilefit.recipe import Recipe


def _linear_step(b: int = 256, din: int = 4096, dout: int = 4096):
    def build():
        return nn.Linear(din, dout, bias=False)

    return build, torch.empty(b, din, device="meta")


def _sum(model, batch):
    return model(batch).sum()


def test_a_linear_layers_gemms_cost_what_the_gemm_model_says():
    # One bias-free linear layer: forward mm (M=T, N=out, K=in), activation grad (T, in, out)
    # — not needed for an input without grad — and weight grad (out, in, T).
    dev = get_device("a100-80gb")
    build, batch = _linear_step()
    e = estimate(build, batch, loss_fn=_sum, recipe=Recipe(precision="bf16-mixed", optimizer="sgd"),
                 gpu=dev)
    gemm_ops = [c for c in e.ops if c.record.kind == "gemm"]
    fwd = analyze_gemm(256, 4096, 4096, "bf16", dev).predicted_time_s
    wgrad = analyze_gemm(4096, 4096, 256, "bf16", dev).predicted_time_s
    got = sorted(c.time_s for c in gemm_ops)
    assert len(gemm_ops) == 2
    assert got == pytest.approx(sorted([fwd, wgrad]), rel=1e-9)


def test_step_time_is_the_hosts_and_the_devices_timelines_and_mfu_is_below_one():
    from tilefit.estimator.steptime import SYNC_OPS, host_time_s

    build, batch = _linear_step()
    e = estimate(build, batch, loss_fn=_sum,
                 recipe=Recipe(precision="bf16-mixed", optimizer="adamw"), gpu="h100")
    host = e.device.host
    # a second method: the host issues op after op, the device runs each once issued
    issued = done = 0.0
    for c in e.ops:
        issued += host_time_s(c.record, host, e.device)
        done = max(done, issued) + c.time_s
        if c.record.op in SYNC_OPS and not c.record.on_host:
            issued = max(issued, done)
    assert e.step_time_s == pytest.approx(max(issued, done))
    assert e.device_time_s == pytest.approx(sum(c.time_s * c.repeats for c in e.ops))
    assert e.step_time_s >= max(e.device_time_s, e.host_time_s)
    assert 0 < e.mfu < 1
    assert e.flops == 2 * (2 * 256 * 4096 * 4096)  # forward + weight grad, 2*M*N*K each
    assert e.samples_per_s == pytest.approx(256 / e.step_time_s)


def test_accumulation_repeats_the_micro_step_not_the_optimizer():
    build, batch = _linear_step(b=64)
    one = estimate(build, batch, loss_fn=_sum,
                   recipe=Recipe(precision="bf16-mixed", optimizer="adamw"), gpu="a100-80gb")
    four = estimate(build, batch, loss_fn=_sum,
                    recipe=Recipe(precision="bf16-mixed", optimizer="adamw", accumulation_steps=4),
                    gpu="a100-80gb")
    opt_one = one.time_by_phase_s["optimizer"]
    micro = one.device_time_s - opt_one - one.time_by_phase_s.get("zero_grad", 0)
    # three more micro-batches; the later ones accumulate into existing gradients (an add)
    assert four.device_time_s > one.device_time_s + 2.9 * micro
    assert four.samples_per_step == 4 * 64
    assert four.time_by_phase_s["optimizer"] == pytest.approx(opt_one)


def test_memory_fits_against_the_device_with_overhead():
    # 7B-like: one 4096x4096 layer stands for nothing big; check the arithmetic of fits
    build, batch = _linear_step()
    e = estimate(build, batch, loss_fn=_sum, recipe=Recipe(precision="bf16-mixed"), gpu="rtx-4090")
    assert e.total_memory_bytes == e.peak_memory_bytes + e.overhead_bytes
    assert e.fits == (e.total_memory_bytes <= 24 * 2**30)
    # 4096^2 fp32 weights + grads + 2 AdamW moments = 16 B/param
    assert e.peak_memory_bytes >= 16 * 4096 * 4096


def test_estimate_cli_json():
    # in this process: what the command writes (the fresh interpreter's own output is
    # checked by the bad-input case below and tests/test_moe.py's third-party lines)
    r = invoke_cli("estimate", "gpt2", "--batch", "2", "--seq", "64", "--gpu", "a100-80gb",
                   "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    for key in ("step_time_s", "peak_memory_bytes", "memory_breakdown", "overhead_bytes", "mfu",
                "tokens_per_s", "flops", "modules"):
        assert key in data
    assert data["gpu"] == "a100-80gb"
    assert data["tokens_per_step"] == 2 * 64
    assert set(data["memory_breakdown"]) == {"parameters", "gradients", "optimizer_state",
                                             "activations", "temporaries", "inputs"}
    op_keys = {"op", "phase", "module", "input_shapes", "output_shapes", "dtype", "flops",
               "bytes", "time_s"}
    assert data["ops"] and all(op_keys <= set(op) for op in data["ops"])
    # the per-op times add up to the device's busy time (each op as often as it runs); the
    # step also waits for the host where it issues slower than the GPU runs
    total = sum(op["time_s"] * op["repeats"] for op in data["ops"])
    assert abs(total - data["device_time_s"]) <= 1e-9 * data["device_time_s"]
    assert data["step_time_s"] >= max(data["device_time_s"], data["host_time_s"])
    assert 0 <= data["host_bound_fraction"] < 1
    # a Hugging Face model trains as the Trainer runs it by default: clipped at 1.0, with
    # AdamW(fused=True) (optim="adamw_torch_fused" with torch >= 2.8)
    assert data["recipe"]["optimizer"] == "adamw-fused"
    assert data["recipe"]["max_grad_norm"] == 1.0
    phases = {op["phase"] for op in data["ops"]}
    assert "clip_grad" in phases
    assert [op["op"] for op in data["ops"] if op["phase"] == "optimizer"].count(
        "aten._fused_adamw_.default") == 1


@pytest.mark.parametrize("args,needle,fresh", [
    (("estimate", "gtp2"), "did you mean", True),
    (("estimate", "gpt2", "--seq", "4096"), "1024", False),
    (("estimate", "gpt2", "--gpu", "auto"), "--gpu", False),
    (("estimate", "gpt2", "--gpu", "v100", "--precision", "bf16-mixed"), "fp16-mixed", False),
    (("estimate", "gpt2", "--batch", "0"), "batch", False),
])
def test_estimate_cli_bad_input_exits_2_with_the_fix(cli, args, needle, fresh):
    # one case through the real entry point in a fresh interpreter; the others in this
    # process (the same app, ~8 s of imports less each)
    r = cli(*args, timeout_s=120) if fresh else invoke_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


# ---- kernel families of the memory-bound ops (tilefit.estimator.cost) ---------------------
# A100 80GB: 2039 GB/s at bandwidth_efficiency 0.90 = 1835.1 GB/s, and a 4 us launch floor.
# An op that moves 1_835_100_000 bytes takes 1 ms at the copy's bandwidth, 1/f ms at a share
# f of it, plus the launch.
_A100_COPY_BYTES_PER_MS = 1_835_100_000
# One distinct share per family, so that a wrong mapping shows as a wrong time.
_SHARES = {"elementwise": 0.8, "reduction": 0.625, "normalization": 0.5, "batch_norm": 0.9,
           "softmax": 0.4,
           "embedding_backward": 0.25, "indexing": 0.2, "copy": 1.0, "foreach": 0.32}


@pytest.mark.parametrize(("op", "family", "expected_ms"), [
    ("aten.gelu_backward.default", "elementwise", 1 / 0.8 + 0.004),  # 1.254 ms
    ("aten.sum.dim_IntList", "reduction", 1 / 0.625 + 0.004),  # 1.604 ms
    ("aten.native_layer_norm_backward.default", "normalization", 1 / 0.5 + 0.004),  # 2.004
    ("aten._log_softmax.default", "softmax", 1 / 0.4 + 0.004),  # 2.504 ms
    ("aten.nll_loss_backward.default", "softmax", 1 / 0.4 + 0.004),  # the cross-entropy
    ("aten.embedding_dense_backward.default", "embedding_backward", 1 / 0.25 + 0.004),  # 4.004
    ("aten.gather.default", "indexing", 1 / 0.2 + 0.004),  # 5.004 ms
    ("aten._to_copy.default", "copy", 1 / 1.0 + 0.004),  # 1.004 ms: a cast is a copy
    ("aten._foreach_addcdiv_.ScalarList", "foreach", 1 / 0.32 + 0.004),  # 3.129 ms
])
def test_a_memory_bound_op_runs_at_its_familys_share_of_the_copy_bandwidth(
        op: str, family: str, expected_ms: float) -> None:
    from tilefit.estimator.cost import (
        DEFAULT_EFFICIENCY,
        CostContext,
        KernelEfficiency,
        op_family,
        op_time_s,
    )
    from tilefit.tracing.records import OpRecord

    assert op_family(op) == family
    dev = get_device("a100-80gb")
    rec = OpRecord(op, "backward", "m", ((1,),), ((1,),), "float16", 0,
                   _A100_COPY_BYTES_PER_MS, "memory", 1, 0)
    shares = KernelEfficiency(bandwidth=_SHARES)
    assert op_time_s(rec, dev, CostContext("fp32", shares)) == pytest.approx(expected_ms * 1e-3)
    # the shipped shares: the same arithmetic with the family's default
    default = 1 / DEFAULT_EFFICIENCY.bandwidth[family] + 0.004
    assert op_time_s(rec, dev, CostContext("fp32")) == pytest.approx(default * 1e-3)


def test_every_memory_op_of_a_traced_step_has_a_family_and_views_cost_nothing() -> None:
    from tilefit.estimator.cost import KERNEL_FAMILIES, op_family

    build, batch = _linear_step(b=8, din=64, dout=64)
    e = estimate(build, batch, loss_fn=_sum,
                 recipe=Recipe(precision="bf16-mixed", optimizer="adamw"), gpu="a100-80gb")
    memory = [c.record for c in e.ops if c.record.kind == "memory"]
    assert memory and all(op_family(r.op) in KERNEL_FAMILIES for r in memory)
    assert {op_family(r.op) for r in memory} >= {"copy", "foreach"}  # autocast casts, AdamW
    assert all(c.time_s == 0 for c in e.ops if c.record.kind == "view")


def test_kernel_efficiencies_are_checked() -> None:
    from tilefit.estimator.cost import FAMILY_EFFICIENCY, KernelEfficiency

    with pytest.raises(ValueError, match="each of"):
        KernelEfficiency(bandwidth={"elementwise": 1.0})
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        KernelEfficiency(bandwidth={**FAMILY_EFFICIENCY, "softmax": 1.5})


def _flash_forward(b: int, heads: int, seq: int, d: int):  # type: ignore[no-untyped-def]
    """A fp16 flash-attention forward's record (non-causal, as many KV heads as query heads)
    and its FLOPs, 4 * b * heads * seq^2 * d; its bytes: q, k, v and the output."""
    from tilefit.tracing.records import OpRecord

    info = {"backend": "flash", "direction": "forward", "causal": False, "b": b, "hq": heads,
            "hkv": heads, "sq": seq, "sk": seq, "d": d, "dtype": "float16"}
    flops = 4 * b * heads * seq * seq * d
    rec = OpRecord("aten._scaled_dot_product_flash_attention.default", "forward", "attn",
                   (), (), "float16", flops, 4 * b * heads * seq * d * 2, "attention", 1, 0,
                   attention=info)
    return rec, flops


def test_flash_attention_on_hopper_runs_at_flashattention2s_share_of_the_peak() -> None:
    # H100 SXM fp16: 989 TFLOP/s dense x the H100's GEMM main-loop efficiency 0.870 x flash
    # forward 0.73 / 0.916 (FlashAttention-2's 73% of the A100's peak over the A100's GEMM
    # efficiency) x the Hopper factor 0.48 (FlashAttention-2 at 35% of the H100's peak):
    # 329.2 TFLOP/s. A forward of b=8, 16 heads, 4096 tokens, d=128: 4*8*16*4096^2*128 =
    # 1.0995e12 FLOPs -> 3.340 ms, plus one launch of 4 us (its 0.27 GB at 3.0 TB/s take
    # 0.09 ms: math-bound).
    from tilefit.estimator.cost import CostContext, op_time_s

    rec, flops = _flash_forward(8, 16, 4096, 128)
    assert flops == 4 * 8 * 16 * 4096 * 4096 * 128
    rate = 989e12 * 0.870 * (0.73 / 0.916) * 0.48
    assert op_time_s(rec, get_device("h100-sxm"), CostContext("fp32")) == pytest.approx(
        flops / rate + 4e-6)


def test_flash_attention_on_blackwell_runs_at_the_corpus_fitted_share() -> None:
    # B200 fp16: 2250 TFLOP/s x the B200's GEMM main-loop efficiency 0.885 x flash forward
    # 0.73 / 0.916 x the Blackwell factor 0.196 fitted on FlashAttention-2's B200 records
    # (benchmarks/bench_gpu_corpus.py): 311.0 TFLOP/s. The corpus's 32 x 512 configuration,
    # 32 heads of 64: 4*32*32*512^2*64 = 6.872e10 FLOPs -> 221.0 us, plus one 4 us launch;
    # the issue measured 308.4 TFLOP/s.
    from tilefit.estimator.cost import CostContext, op_time_s

    rec, flops = _flash_forward(32, 32, 512, 64)
    assert flops == 4 * 32 * 32 * 512 * 512 * 64
    t = op_time_s(rec, get_device("b200"), CostContext("fp32"))
    assert t == pytest.approx(flops / (2250e12 * 0.885 * (0.73 / 0.916) * 0.196) + 4e-6)
    assert flops / t / 1e12 == pytest.approx(308.4, rel=0.06)


def test_the_gpu_host_issues_ops_at_the_corpus_fitted_multiples_of_the_cpu_measurement() -> None:
    # CPU measurement (docs/references.md, section 14): forward 11.8, backward 4.3 us per op;
    # eager CUDA steps of the corpus: 1.464x and 3.678x -> 17.3 and 15.8 us; the optimizer's
    # 14.6 us and the 3.0 us launch unchanged
    from tilefit.hardware.host import CPU_MEASURED_HOST, DEFAULT_HOST

    assert CPU_MEASURED_HOST.forward_op_s == pytest.approx(11.8e-6)
    assert DEFAULT_HOST.forward_op_s == pytest.approx(11.8e-6 * 1.464, rel=1e-9)  # 17.3 us
    assert DEFAULT_HOST.backward_op_s == pytest.approx(4.3e-6 * 3.678, rel=1e-9)  # 15.8 us
    assert DEFAULT_HOST.optimizer_op_s == CPU_MEASURED_HOST.optimizer_op_s == 14.6e-6
    assert DEFAULT_HOST.launch_s == 3.0e-6
    assert get_device("a100-80gb").host == DEFAULT_HOST


def test_family_share_applies_on_gpus_not_on_cpus() -> None:
    # A softmax forward over 2^27 fp16 elements moves 2 x 2^28 bytes. With the softmax
    # family at half the copy's bandwidth, an A100 40GB runs it at 1555 GB/s x 0.9 (the copy)
    # x 0.5; a CPU at its probe's bandwidth alone (the shares describe CUDA kernels).
    import dataclasses

    from tilefit.estimator.cost import FAMILY_EFFICIENCY, CostContext, KernelEfficiency, op_time_s
    from tilefit.tracing.records import OpRecord

    nbytes = 2 * 2**28
    rec = OpRecord("aten._softmax.default", "forward", "attn", (), (), "float16", 0, nbytes,
                   "memory", 1, 0)
    ctx = CostContext("fp32", KernelEfficiency(bandwidth={**FAMILY_EFFICIENCY, "softmax": 0.5}))
    a100 = get_device("a100-40gb")
    assert op_time_s(rec, a100, ctx) == pytest.approx(nbytes / (1555e9 * 0.9 * 0.5) + 4e-6)
    cpu = dataclasses.replace(a100, kind="cpu")
    assert op_time_s(rec, cpu, ctx) == pytest.approx(nbytes / (1555e9 * 0.9) + 4e-6)
