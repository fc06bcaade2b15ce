"""A quantized base in the user's own script (issue 42): from_pretrained with a
BitsAndBytesConfig under the simulated GPU, checked against bitsandbytes' real load on this
CPU and against tilefit's estimate of the same QLoRA step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tilefit
from tilefit import Recipe
from tilefit.recipe_parts import Lora
from tilefit.simulation.script import run_script

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

SCRIPTS = Path(__file__).parent / "scripts"
GPU = "a100-80gb"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama saved with real weights, its config naming bf16 (as Llama's do)."""
    where = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(**TINY, dtype="bfloat16")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(where)
    return where


def _bnb(**kwargs: Any) -> Any:
    return transformers.BitsAndBytesConfig(load_in_4bit=True, **kwargs)


def _weights(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    """Each parameter's shape and dtype, and a 4-bit weight's settings and quantization
    state (each tensor's shape and dtype): what a load leaves in memory."""
    from tilefit.compat.bitsandbytes import quant_state_tensors

    out: dict[str, tuple[Any, ...]] = {}
    for name, p in model.named_parameters():
        state = getattr(p, "quant_state", None)
        extra: tuple[Any, ...] = ()
        if state is not None:
            holder = torch.nn.Module()
            holder.w = torch.nn.Parameter(p.detach(), requires_grad=False)
            holder.w.quant_state = state
            extra = (state.quant_type, state.blocksize, state.dtype, state.nested,
                     [(tuple(t.shape), t.dtype) for t in quant_state_tensors(holder)])
        out[name] = (tuple(p.shape), p.dtype, *extra)
    return out


def test_a_users_bitsandbytes_config_loads_as_bitsandbytes_loads_it(tiny_llama: Path) -> None:
    """fp4 without double quantization, computing in fp16, no dtype given (transformers'
    "auto": the config's bf16): every weight and quantization state as the real load on
    this CPU makes it, and the step's resident parameters are those bytes."""
    config = _bnb(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False,
                  bnb_4bit_compute_dtype=torch.float16)
    real = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, quantization_config=config, device_map="cpu")
    with tilefit.simulate(gpu=GPU, steps=2) as sim:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_llama, quantization_config=config)
        loaded = _weights(model)
        modules = {n: (type(m).__name__, getattr(m, "compute_dtype", None))
                   for n, m in model.named_modules()}
        opt = torch.optim.AdamW(model.lm_head.parameters())
        for _ in range(2):
            ids = torch.randint(0, 256, (2, 16), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    assert loaded == _weights(real)
    assert modules == {n: (type(m).__name__, getattr(m, "compute_dtype", None))
                       for n, m in real.named_modules()}
    assert modules["model.layers.0.self_attn.q_proj"] == ("Linear4bit", torch.float16)
    assert loaded["model.layers.0.self_attn.q_proj.weight"][2:5] == ("fp4", 64, torch.bfloat16)
    assert loaded["model.embed_tokens.weight"][1] == torch.bfloat16  # "auto": the config's
    # the resident weights: each tensor the real load holds, rounded up to the caching
    # allocator's 512-byte blocks
    from tilefit.compat.bitsandbytes import quant_state_tensors

    held = [*real.parameters(), *real.buffers(), *quant_state_tensors(real)]
    assert sim.result.memory_breakdown["parameters"] == sum(
        -(-t.numel() * t.element_size() // 512) * 512 for t in held)


@pytest.mark.parametrize(("argv", "settings"), [
    ((), {"quantize": "nf4"}),
    (("bnb-defaults",), {"quantize": "fp4", "double_quant": False,
                         "quant_compute_dtype": "fp32", "prepare_kbit": False}),
], ids=["qlora", "bnb-defaults"])
def test_a_qlora_script_is_the_estimate_of_the_same_step(
        tiny_llama: Path, argv: tuple[str, ...], settings: dict[str, Any]) -> None:
    """One truth for QLoRA: the script's step and tilefit's Recipe of the same model, batch
    and base. QLoRA's settings (nf4, double quantization, bf16 compute, the base loaded in
    bf16, prepare_model_for_kbit_training, LoRA r=16 on q_proj and v_proj), and
    BitsAndBytesConfig's own defaults (fp4, no double quantization, fp32 compute, the base
    loaded in fp32, no preparation) said with the Recipe's quantization fields."""
    from tilefit.models import load_workload

    sim = run_script(str(SCRIPTS / "qlora_loop.py"), [str(tiny_llama), *argv], gpu=GPU,
                     steps=3)
    recipe = Recipe(batch_size=2, precision="bf16-mixed", optimizer="adamw",
                    lora=Lora(rank=16, alpha=32, targets=("q_proj", "v_proj")), **settings)
    est = tilefit.estimate(load_workload(str(tiny_llama / "config.json"), seq_len=64),
                           recipe=recipe, gpu=GPU)
    run = sim.result
    assert sim.found.precision == "bf16-mixed"
    assert run.flops == est.flops
    assert (run.param_count, run.trainable_param_count) == (
        est.param_count, est.trainable_param_count)
    for category in ("parameters", "gradients", "optimizer_state"):
        assert run.memory_breakdown[category] == est.memory_breakdown[category], category
    assert run.step_time_s == pytest.approx(est.step_time_s, rel=0.01)


def test_from_pretrained_without_a_dtype_takes_the_configs(tiny_llama: Path) -> None:
    """transformers 5's from_pretrained loads in the config's dtype by default ("auto"):
    under the simulation too, and a dtype given wins."""
    real = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    with tilefit.simulate(gpu=GPU, steps=1) as sim:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).cuda()
        fp32 = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32")
        opt = torch.optim.SGD(model.parameters())
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="cuda")).logits.sum().backward()
        opt.step()
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in real.parameters()} == {
        torch.bfloat16}
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert sim.found.precision == "bf16-true"


def test_an_8bit_base_on_a_gpu_is_refused_with_the_way_out(tiny_llama: Path) -> None:
    from tilefit.errors import TilefitError

    with pytest.raises(TilefitError, match="load_in_8bit") as err, tilefit.simulate(gpu=GPU):
        transformers.AutoModelForCausalLM.from_pretrained(
            tiny_llama, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True))
    assert "load_in_4bit=True" in (err.value.fix or "")
