"""Quantized bases (Recipe.quantize) traced with bitsandbytes' own layers and its
optimizers: sizes counted by hand (bitsandbytes' formats: docs/references.md, section 33)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from tests.conftest import invoke_cli, run_cli

from tilefit import Recipe, trace
from tilefit.errors import TilefitError
from tilefit.planner import PlanSearch
from tilefit.recipe import Lora

# a Llama of 2 layers, hidden 64, vocab 128: 7 linear layers per block, q/o 64x64,
# k/v 32x64 (2 KV heads of 16), gate/up 128x64, down 64x128, an untied lm_head
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
          "tie_word_embeddings": False}
LINEARS = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)] * 2


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tilefit.models import load_workload

    path = tmp_path_factory.mktemp("qlora") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return load_workload(str(path), seq_len=32)


def nf4_weight_bytes(n: int, k: int, double_quant: bool = True) -> int:
    """One 4-bit weight as bitsandbytes stores it: two weights a byte, one absmax per block
    of 64 (uint8 with double quantization, plus one fp32 absmax per 256 of them, an fp32
    offset and the layer's own copy of the 256-value fp32 dynamic map; fp32 without), and
    the 16-value fp32 code of nf4."""
    blocks = math.ceil(n * k / 64)
    absmax = blocks + 4 * math.ceil(blocks / 256) + 4 + 256 * 4 if double_quant \
        else 4 * blocks
    return n * k // 2 + absmax + 16 * 4


def test_fake_quantization_has_bitsandbytes_sizes() -> None:
    import bitsandbytes as bnb
    import torch

    from tilefit.compat.bitsandbytes import fake_quantized, quant_state_tensors
    from tilefit.compat.fake import new_fake_mode

    mode = new_fake_mode()
    for n, k in ((128, 64), (4096, 4096)):
        for double in (True, False):
            with torch.device("meta"):
                layer = bnb.nn.Linear4bit(k, n, bias=False, compress_statistics=double,
                                          quant_type="nf4")
            w = fake_quantized(layer.weight, mode)
            assert (w.dtype, tuple(w.shape)) == (torch.uint8, (n * k // 2, 1))
            holder = torch.nn.Linear(1, 1)
            holder.weight = w
            total = w.nbytes + sum(t.nbytes for t in quant_state_tensors(holder))
            assert total == nf4_weight_bytes(n, k, double)


def test_qlora_trace_holds_the_packed_base(workload) -> None:  # type: ignore[no-untyped-def]
    recipe = Recipe(batch_size=2, precision="bf16-mixed", lora=Lora(), quantize="nf4",
                    optimizer="adamw")
    tr = trace(workload, recipe=recipe, gpu="a100-80gb")
    params = sum(s.nbytes for s in tr.storages if s.category == "parameters")
    quantized = sum(nf4_weight_bytes(n, k) for n, k in LINEARS)
    # prepare_model_for_kbit_training: embeddings, norms and lm_head in fp32; the adapters
    # fp32 (peft); the rotary embedding's inv_freq and original_inv_freq buffers, 8 fp32 each
    unquantized = 4 * (128 * 64 + 128 * 64 + 5 * 64)
    assert params == quantized + unquantized + 4 * tr.trainable_param_count + 64
    assert tr.param_count == sum(n * k for n, k in LINEARS) + unquantized // 4 \
        + tr.trainable_param_count
    kinds = {o.op.split(".")[1]: o.kind for o in tr.ops if o.op.startswith("bitsandbytes.")}
    assert kinds == {"gemm_4bit": "gemm", "dequantize_4bit": "memory",
                     "dequantize_blockwise": "memory"}
    gemm = next(o for o in tr.ops if o.op.startswith("bitsandbytes.gemm_4bit"))
    g = gemm.gemms[0]
    assert gemm.flops == 2 * g.m * g.n * g.k and g.m == 2 * 32 and g.dtype == "bf16"
    assert any("bnb_4bit_compute_dtype is fp32" in w for w in tr.warnings)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_qlora_cpu_peak_matches_a_real_cpu_run(tmp_path: Path, precision: str) -> None:
    """Issue 28: a Llama-like model loaded in nf4 by transformers' own from_pretrained
    (bitsandbytes' CPU backend quantizes it), peft's LoRA on it, two real training steps on
    this CPU measured by PyTorch's MemTracker, against tilefit's CPU prediction. On the CPU,
    bitsandbytes' gemm_4bit runs its default kernel (dequantize_blockwise and
    dequantize_4bit on the CPU, then F.linear); the backward dequantizes the weight again
    (dequantize_4bit) and multiplies with aten's matmul."""
    import torch

    from tilefit.bench.qlora import quant_state_tensors, real_qlora_model
    from tilefit.bench.step import memtracker_peak_bytes
    from tilefit.models import load_workload

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    model = real_qlora_model(CONFIG, tmp_path, dtype)

    def make_opt(params):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)

    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    ids = torch.arange(2 * 32).reshape(2, 32) % 128
    batch = {"input_ids": ids, "labels": ids.clone()}

    def step(phase) -> None:  # type: ignore[no-untyped-def]
        phase("forward")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    real = memtracker_peak_bytes(model, opt, (batch, quant_state_tensors(model)), step)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    work = load_workload(str(tmp_path / "config.json"), seq_len=32)
    predicted = trace(work, recipe=Recipe(batch_size=2, precision=precision, lora=Lora(),
                                          quantize="nf4", optimizer=make_opt), gpu="cpu")
    peak = predicted.peak(rounded=False)[0]
    assert abs(peak - real) <= 0.02 * real, (peak, real)


def test_dequantize_before_the_gemm_costs_its_bytes() -> None:
    from tilefit.estimator.cost import dequantize_time_s, memory_time_s
    from tilefit.hardware import get_device
    from tilefit.tracing.records import GemmShape, OpRecord

    def op(m: int) -> OpRecord:
        return OpRecord(op="bitsandbytes.gemm_4bit.default", phase="forward", module="",
                        input_shapes=(), output_shapes=(), dtype="bfloat16", flops=0, bytes=0,
                        kind="gemm", step=1, micro=0,
                        gemms=(GemmShape(1, m, 4096, 4096, "bf16"),))

    gpu = get_device("a100-80gb")
    assert dequantize_time_s(op(4), gpu) == 0.0  # M <= 4: bitsandbytes' fused kernel
    weights = 4096 * 4096
    for m in (1024, 4096):  # a weight of 4M values or more: dequantized past M = 512
        assert dequantize_time_s(op(m), gpu) == pytest.approx(
            memory_time_s(weights // 2 + 4 * weights // 64 + 2 * weights, gpu))


def test_bitsandbytes_own_kernel_choice() -> None:
    """bitsandbytes 0.50.2's gemm_4bit dispatch (backends/cuda/ops.py), read by hand: its
    fused kernel up to M = 4 rows, dequantize-then-F.linear past 1536 rows, for fp32 from 8
    rows, for weights of 4M values or more past 512, for any K off the block, and per GPU
    for small weights; the CPU always dequantizes."""
    import torch

    from tilefit.compat.bnb_dispatch import gemm_4bit_dequantizes

    h100, a100 = (132, 9, 0), (108, 8, 0)
    bf16 = torch.bfloat16
    for gpu in (h100, a100):
        assert not gemm_4bit_dequantizes(4, 4096, 4096, bf16, 64, gpu)
        assert gemm_4bit_dequantizes(1537, 64, 64, bf16, 64, gpu)
        assert gemm_4bit_dequantizes(8, 4096, 4096, torch.float32, 64, gpu)
        assert gemm_4bit_dequantizes(513, 4096, 4096, bf16, 64, gpu)
        assert gemm_4bit_dequantizes(16, 64, 96, bf16, 64, gpu)  # K = 96, blocks of 64
    # a small weight with a short K (N = 4096, K = 512, 64 column blocks, more than a third
    # of the SMs): "Calibrated on A100: custom wins to M=1536 (low wave), M=512 (high wave).
    # Calibrated on H100/H200: ... M=320 (high wave)"
    for gpu, last in ((a100, 512), (h100, 320)):
        assert not gemm_4bit_dequantizes(last, 4096, 512, bf16, 64, gpu)
        assert gemm_4bit_dequantizes(last + 1, 4096, 512, bf16, 64, gpu)
    assert gemm_4bit_dequantizes(1, 64, 64, bf16, 64, None)


@pytest.mark.parametrize(("gpu", "batch", "dequantizes"),
                         [("a100-80gb", 64, True), ("a100-80gb", 1, False), ("cpu", 1, True)])
def test_the_dense_weight_is_booked_inside_the_gemm(tmp_path: Path, gpu: str, batch: int,
                                                    dequantizes: bool) -> None:
    """Where gemm_4bit dequantizes first (64 x 32 = 2048 rows > 1536 on CUDA; always on the
    CPU), the op holds the dense weight and, with double quantization, the fp32 absmax while
    its F.linear runs: booked as temporaries alive with its output only. At 4 rows of
    ``seq_len=4`` on an A100 its fused kernel runs: nothing booked."""
    from tilefit.models import load_workload

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    work = load_workload(str(tmp_path / "config.json"), seq_len=32 if batch > 1 else 4)
    precision = "fp32" if gpu == "cpu" else "bf16-mixed"
    tr = trace(work, recipe=Recipe(batch_size=batch, precision=precision, lora=Lora(),
                                   quantize="nf4", optimizer="adamw"), gpu=gpu)
    width = 4 if gpu == "cpu" else 2
    forward = [(i, o) for i, o in enumerate(tr.ops)
               if o.op.startswith("bitsandbytes.gemm_4bit") and o.step == 1]
    assert len(forward) == len(LINEARS)
    booked = {}
    for s in tr.storages:
        if s.category == "temporaries" and s.free_at == s.alloc_at + 1:
            booked.setdefault(s.alloc_at, []).append(s.nbytes)
    for i, op in forward:
        g = op.gemms[0]
        absmax = 4 * math.ceil(g.n * g.k / 64)
        expected = [absmax, g.n * g.k * width] if gpu == "cpu" else \
            [absmax, absmax, g.n * g.k * width]
        assert sorted(booked.get(i, [])) == (sorted(expected) if dequantizes else []), op


def test_adamw_8bit_is_bitsandbytes_own(workload) -> None:  # type: ignore[no-untyped-def]
    def state(opt: str) -> int:
        tr = trace(workload, recipe=Recipe(batch_size=1, precision="bf16-mixed",
                                           optimizer=opt), gpu="a100-80gb")
        return sum(s.nbytes for s in tr.storages if s.category == "optimizer_state")

    # min_8bit_size = 4096: tensors of fewer values keep two fp32 moments
    sizes = [128 * 64, 128 * 64] + [n * k for n, k in LINEARS] + [64] * 5
    eight = sum(2 * s + 2 * 4 * math.ceil(s / 256) for s in sizes if s >= 4096)
    thirty_two = sum(2 * 4 * s for s in sizes if s < 4096)
    assert state("adamw-8bit") == eight + thirty_two == 234496
    assert state("paged-adamw-8bit") == 234496  # same buffers, paged on CUDA
    assert state("paged-adamw") == 2 * 4 * sum(sizes)


def test_paged_optimizers_say_what_paging_means(workload) -> None:  # type: ignore[no-untyped-def]
    tr = trace(workload, recipe=Recipe(batch_size=1, precision="bf16-mixed",
                                       optimizer="paged-adamw"), gpu="a100-80gb")
    assert any("evicts it to host memory" in w for w in tr.warnings)


def test_recipe_rules() -> None:
    with pytest.raises(TilefitError, match="frozen"):
        Recipe(quantize="nf4")
    with pytest.raises(TilefitError, match="did you mean nf4"):
        Recipe(quantize="nf44", lora=Lora())
    with pytest.raises(TilefitError, match="fp8"):
        Recipe(quantize="nf4", lora=Lora(), precision="fp8-mixed")
    assert Recipe(quantize="fp4", lora=Lora()).to_dict()["quantize"] == "fp4"


def test_qlora_under_ddp_all_reduces_the_adapters_gradients_only(workload) -> None:  # type: ignore[no-untyped-def]
    """Answer.AI's QLoRA "DDP mode": every GPU holds the whole 4-bit base; DDP buckets only
    parameters that take a gradient, so its one bucket is the fp32 adapters' gradients
    (bf16-mixed: peft keeps adapters in fp32), all-reduced once a step."""
    from tilefit.recipe import Parallelism

    recipe = Recipe(batch_size=2, precision="bf16-mixed", lora=Lora(), quantize="nf4",
                    optimizer="adamw", parallel=Parallelism(2, "ddp"))
    tr = trace(workload, recipe=recipe, gpu="a100-80gb")
    # Lora(): rank 16 on the 7 linear layers of each block: r x (in + out) each
    assert tr.trainable_param_count == 16 * sum(n + k for n, k in LINEARS)
    grads = 4 * tr.trainable_param_count
    reduced = [o.collective for o in tr.ops_of_step(1)
               if o.collective is not None and o.collective.name == "all_reduce"]
    assert [(c.nbytes, c.group_size) for c in reduced] == [(grads, 2)]
    with pytest.raises(TilefitError, match=r"Parallelism\(strategy='ddp'\)"):
        Recipe(lora=Lora(), quantize="nf4", parallel=Parallelism(2, "fsdp2"))
    with pytest.raises(TilefitError, match=r"Parallelism\(strategy='ddp'\)"):
        Recipe(lora=Lora(), quantize="nf4", parallel=Parallelism(2))  # fsdp2 by default


def test_a_compiled_qlora_step_lifts_the_quant_state_and_copies_no_weight(workload) -> None:  # type: ignore[no-untyped-def]
    """torch.compile over bitsandbytes' Linear4bit (one graph with bitsandbytes >= 0.46 and
    PyTorch >= 2.8): the capture takes each layer's QuantState tensors as inputs, so the
    compiled step holds the same packed base as the eager one, to the byte; its
    dequantize kernels run as extern kernels of the graphs, forward and backward; the model
    is left as it was. (A real compiled QLoRA step on this CPU against the prediction:
    benchmarks/bench_qlora_compile_cpu.py.)"""

    def base_bytes(tr) -> int:  # type: ignore[no-untyped-def]
        return sum(s.nbytes for s in tr.storages if s.category == "parameters")

    def recipe(compile_: bool) -> Recipe:
        return Recipe(batch_size=2, precision="bf16-mixed", lora=Lora(), quantize="nf4",
                      optimizer="adamw", compile=compile_)

    eager = trace(workload, recipe=recipe(False), gpu="a100-80gb")
    compiled = trace(workload, recipe=recipe(True), gpu="a100-80gb")
    assert compiled.compiled and base_bytes(compiled) == base_bytes(eager)
    assert base_bytes(compiled) == sum(nf4_weight_bytes(n, k) for n, k in LINEARS) + 4 * (
        128 * 64 + 128 * 64 + 5 * 64) + 4 * compiled.trainable_param_count + 64
    dequant = {(o.phase, o.op) for o in compiled.ops_of_step(1)
               if o.op.startswith("bitsandbytes.") and o.compiled and not o.fused}
    assert ("backward", "bitsandbytes.dequantize_4bit.default") in dequant
    assert any(phase == "forward" for phase, _ in dequant)
    with pytest.raises(TilefitError, match="int8 base is not predicted under torch"):
        Recipe(lora=Lora(), quantize="int8", compile=True)


def test_a_4bit_layer_with_a_bias_compiles(tmp_path: Path) -> None:
    """Qwen2's q/k/v projections have biases, which peft's kbit preparation casts to fp32 and
    Linear4bit.forward casts back to the compute dtype in place on its first call (a swap of
    .data the capture cannot trace): the model is built as after that call, so the compiled
    step captures; the biases are bf16, as from the second step of a real run on."""
    from tilefit.models import load_workload
    from tilefit.models.quantize import build_quantized_model

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "model_type": "qwen2",
                                  "architectures": ["Qwen2ForCausalLM"]}))
    work = load_workload(str(config), seq_len=32)
    recipe = Recipe(batch_size=2, precision="bf16-mixed", lora=Lora(), quantize="nf4",
                    optimizer="adamw", compile=True)
    import torch

    model = build_quantized_model(work, "sdpa", recipe)
    biases = {n: p.dtype for n, p in model.named_parameters() if n.endswith("base_layer.bias")}
    assert len(biases) == 2 * 3 and set(biases.values()) == {torch.bfloat16}  # q, k, v
    assert trace(work, recipe=recipe, gpu="a100-80gb").compiled


def test_qlora_on_a_mixture_of_experts_traces_on_a_gpu_target(tmp_path: Path) -> None:
    """Mixtral's experts are 3D parameters: bitsandbytes leaves them unquantized, peft's kbit
    preparation makes them fp32, and peft's LoRA on them folds its delta inside
    torch.autocast(W.device.type, enabled=False), which on the GPU keeps the fold in fp32
    (a parametrization may not change the dtype). On fake tensors that device is the CPU:
    the emulated CUDA autocast follows the context (tests/test_autocast_off.py), so the
    step traces as it runs on a GPU."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "model_type": "mixtral",
                                  "architectures": ["MixtralForCausalLM"],
                                  "num_local_experts": 4, "num_experts_per_tok": 2}))
    from tilefit.models import load_workload

    work = load_workload(str(config), seq_len=32)
    tr = trace(work, recipe=Recipe(batch_size=2, precision="bf16-mixed", lora=Lora(),
                                   quantize="nf4", optimizer="adamw"), gpu="a100-80gb")
    assert tr.trainable_param_count > 0
    assert any(o.op.startswith("bitsandbytes.") for o in tr.ops)


def test_lifting_the_quant_state_leaves_the_model_as_it_was() -> None:
    import bitsandbytes as bnb
    import torch

    from tilefit.compat.bitsandbytes import LIFTED_PREFIX, quant_states_lifted

    plain = torch.nn.Linear(4, 4)
    with quant_states_lifted(plain):
        assert dict(plain.named_buffers()) == {}
    recover = bnb.nn.modules.fix_4bit_weight_quant_state_from_module
    model = torch.nn.Sequential(plain)
    holder = torch.nn.Linear(64, 32, bias=False)
    _, state = bnb.functional.quantize_4bit(torch.randn(32, 64), compress_statistics=True,
                                            quant_type="nf4")
    holder.weight.quant_state = state
    model.append(holder)
    with quant_states_lifted(model):
        lifted = dict(holder.named_buffers())
        # absmax, code, offset and the nested state's absmax and code: the same tensors
        assert [id(t) for t in lifted.values()] == [id(state.absmax), id(state.code),
                                                    id(state.offset), id(state.state2.absmax),
                                                    id(state.state2.code)]
        assert bnb.nn.modules.fix_4bit_weight_quant_state_from_module is not recover
    assert not [n for n, _ in model.named_buffers() if LIFTED_PREFIX in n]
    assert bnb.nn.modules.fix_4bit_weight_quant_state_from_module is recover
    assert holder.weight.quant_state is state


def test_int8_on_a_gpu_says_why(workload) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TilefitError, match="MatMul8bitLt on CUDA"):
        trace(workload, recipe=Recipe(batch_size=1, lora=Lora(), quantize="int8"),
              gpu="a100-80gb")


def test_without_bitsandbytes_the_error_names_the_install(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tilefit.compat.bitsandbytes import require_bitsandbytes

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(TilefitError, match=r"tilefit\[quant\]"):
        require_bitsandbytes("--quantize nf4")


def test_cli_quantize(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    ok = run_cli("estimate", str(path), "--seq", "32", "--batch", "1", "--lora",
                 "--quantize", "nf4", "--json", "--no-ops", timeout_s=300)
    assert ok.returncode == 0, ok.stderr
    assert "Failed to load" not in ok.stderr
    # the refusal in this process: the fresh interpreter's import lines are checked above
    bad = invoke_cli("estimate", str(path), "--quantize", "nf4")
    assert bad.returncode == 2 and "--lora" in bad.stderr + bad.stdout
    # the table's title says which adapters on which base it read from the flags
    said = invoke_cli("estimate", str(path), "--seq", "32", "--batch", "1", "--lora",
                      "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--quantize", "nf4",
                      "--gpus", "2", "--strategy", "ddp", "--no-ops")
    assert said.returncode == 0, said.stderr
    assert "LoRA r=8 alpha=32 on q_proj,v_proj of a frozen nf4 base" in " ".join(
        said.stdout.split())


def _qlora_row(checkpointing: bool = True):  # type: ignore[no-untyped-def]
    from tilefit.planner.rows import PlanRow

    recipe = Recipe(batch_size=4, accumulation_steps=8, precision="bf16-mixed",
                    optimizer="adamw-fused", grad_checkpointing=checkpointing,
                    attention="sdpa", lora=Lora(), quantize="nf4", max_grad_norm=1.0)
    return PlanRow(recipe=recipe, predicted_peak_memory_bytes=1, predicted_step_time_s=1.0,
                   samples_per_s=32.0, tokens_per_s=None, mfu=0.1, budget_bytes=2)


def test_a_qlora_plan_pastes_its_bitsandbytes_config() -> None:
    import torch
    import transformers

    from tilefit.planner.configs import single_gpu_configs

    cfg = single_gpu_configs(_qlora_row(), "causal-lm")
    assert cfg["bitsandbytes_config"] == {
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16"}
    config = transformers.BitsAndBytesConfig(**cfg["bitsandbytes_config"])  # it loads
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.load_in_4bit
    assert cfg["peft_lora_config"]["r"] == 16
    code = cfg["hf_python"]
    for line in ("quantization_config=bnb_config", "prepare_model_for_kbit_training(model, "
                 "use_gradient_checkpointing=True", "get_peft_model(model, LoraConfig(",
                 "bnb_4bit_quant_type='nf4'", "TrainingArguments("):
        assert line in code, code
    compile(code, "hf_python", "exec")  # valid Python to paste
    # the plain loop and the LightningModule load the same quantized base (the loop places
    # it as it loads: bitsandbytes quantizes while placing), never a 16-bit one
    for name in ("pytorch_loop", "lightning_python"):
        code = cfg[name]
        assert "quantization_config=bnb_config" in code and "(name, dtype=" not in code
        compile(code, name, "exec")
    assert 'device_map={"": device}' in cfg["pytorch_loop"]
    assert "model.to(device)" not in cfg["pytorch_loop"]


def test_qlora_rows_say_what_they_cost() -> None:
    from tilefit.planner.search import changes_of

    (qlora, *_rest) = changes_of(_qlora_row().recipe, "adamw-fused", offload=False)
    assert "QLoRA" in qlora and "Dettmers et al. 2023" in qlora and "4-bit NF4" in qlora
    assert "matched 16-bit LoRA and full fine-tuning" in qlora
    assert _qlora_row().recipe_label() == "bf16-mixed adamw-fused ckpt lora nf4"
    assert _qlora_row().to_dict()["quantize"] == "nf4"
    from tilefit.report.plan import short_label

    assert short_label(_qlora_row()) == "bf16 ckpt qlora"  # the table tells it from LoRA


def test_plan_searches_qlora_when_allowed(workload) -> None:  # type: ignore[no-untyped-def]
    from tilefit.hardware import get_device
    from tilefit.planner import notes, space
    from tilefit.planner.api import PlanSearch
    from tilefit.planner.run import _state

    gpu = get_device("rtx-4090")
    specs = space.qlora_recipes(gpu, "adamw")
    assert [(s.quantize, s.lora, s.grad_checkpointing, s.precision) for s in specs] == [
        ("nf4", Lora(), False, "bf16-mixed"), ("nf4", Lora(), True, "bf16-mixed")]
    p = _state(workload, gpu, 4, Recipe(), PlanSearch(allow_quantize=True))
    p.add(specs[0])  # traced at micro-batches 1 and 4, batch 2 from their line
    rows = [r for r in p.rows if r.recipe.quantize == "nf4"]
    assert [r.micro_batch for r in rows] == [1, 2, 4] and all(r.fits for r in rows)
    assert all("QLoRA" in r.changes[0] for r in rows)
    assert "PlanSearch(allow_lora=True, allow_quantize=True)" in notes.PEFT_FACTORY


def test_cli_audit_of_a_qlora_step(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    from typer.testing import CliRunner

    from tilefit.cli.app import app
    from tilefit.tracing.workload_traces import shared_traces

    args = ["audit", str(path), "--seq", "32", "--batch", "2", "--lora", "--quantize", "nf4"]
    # one scope: the terminal report's audit takes the JSON audit's traces of the same steps
    # (a trace depends only on its model, recipe and GPU: tests/test_shared_traces.py)
    with shared_traces():
        ok = CliRunner().invoke(app, [*args, "--json"])
        text = CliRunner().invoke(app, args)
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["recipe"]["quantize"] == "nf4" and data["recipe"]["lora"]["rank"] == 16
    # the audited step is the quantized one, its adapters r * (in + out) on the 14 layers
    assert any(w.startswith("nf4 base: bitsandbytes' Linear4bit")
               for w in data["estimate"]["warnings"])
    assert data["estimate"]["trainable_param_count"] == 16 * sum(n + k for n, k in LINEARS)
    # the terminal report's title says what it audited
    assert text.exit_code == 0, text.output
    assert "LoRA r=16 alpha=32 on all linear layers of a frozen nf4 base" in " ".join(
        text.output.split())


def test_where_lora_does_not_fit_the_plan_traces_qlora_for_its_note(tmp_path: Path) -> None:
    """A GPU too small for LoRA's 16-bit base but not for a 4-bit one: the nothing-fits
    note traces QLoRA and names the flags that plan it; the audit's way forward says the
    same. Checked against direct estimates of both recipes and the base counted by hand."""
    import dataclasses

    from tilefit.advise.way_forward import _adapters_hint
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.planner import plan
    from tilefit.planner.run import budget_of

    config = dict(CONFIG, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                  num_key_value_heads=8)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    work = load_workload(str(path), seq_len=32)
    a100 = get_device("a100-80gb")
    gpu = dataclasses.replace(a100, memory_bytes=budget_of(a100, 1.0)[1] + 48 * 2**20)
    budget = budget_of(gpu, 1.0)[0]
    # LoRA's frozen base in 16 bits: 2 layers of 4 x 1024^2 + 3 x 1024 x 4096 weights
    base16 = 2 * 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096)
    assert base16 > budget
    # global batch 1: one micro-batch, each recipe traced once
    p = plan(work, gpu=gpu, global_batch=1, search=PlanSearch(memory_fraction=1.0))
    note = next(n for n in p.notes if "QLoRA" in n)
    assert "nf4, micro-batch 1: adapters on a 4-bit base" in note
    assert "PlanSearch(allow_lora=True, allow_quantize=True) plans it" in note
    assert _adapters_hint(p) == note  # what the audit's way forward says
    lora = Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="sdpa",
                  grad_checkpointing=True, lora=Lora(), batch_size=1)
    assert estimate_workload(work, lora, gpu).peak_memory_bytes > base16
    qlora = dataclasses.replace(lora, quantize="nf4")
    assert estimate_workload(work, qlora, gpu).peak_memory_bytes <= budget
