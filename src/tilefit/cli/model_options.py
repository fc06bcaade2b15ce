"""The options of the commands that take a model: each declared once here; the ones that
describe a recipe are shared through cli/recipe_options.py."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import typer

from tilefit.errors import TilefitError
from tilefit.vocab import (
    ATTENTIONS,
    DEFAULT_STRATEGY,
    OPTIMIZER_NAMES,
    PRECISION_NAMES,
    STRATEGIES,
    ZERO_STRATEGIES,
    check_compile_mode,
    check_max_grad_norm,
)

if TYPE_CHECKING:
    from tilefit.hardware import Device
    from tilefit.recipe import Lora, Recipe

GPU_OPTION = typer.Option(
    "a100-80gb", "--gpu", help="Catalog name or alias (see `tilefit gpus`), a TOML spec file, "
    "auto (the live GPU), or cpu (this machine).")
BATCH_OPTION = typer.Option(8, "--batch", help="Micro-batch size (samples per forward).")
CHECKPOINTING_OPTION = typer.Option(False, "--grad-checkpointing",
                                    help="Recompute activations in backward.")
ACCUMULATION_OPTION = typer.Option(1, "--accumulation",
                                   help="Gradient accumulation steps per optimizer step.")
MODEL_ARG = typer.Argument(
    ..., help="A catalog name (`tilefit models`), a Hugging Face Hub id org/name (its "
    "config.json alone, through the Hugging Face cache; no weights), a path to a Hugging "
    "Face config.json, or package.module:function returning an nn.Module (with "
    "--input-shape).")
REVISION_OPTION = typer.Option(
    None, "--revision", help="With a Hub id: the branch, tag or commit hash whose config.json "
    "is read (default: main).")
SEQ_OPTION = typer.Option(None, "--seq", help="Tokens per sample (default: the model's own).")
PRECISION_OPTION = typer.Option(
    None, "--precision",
    help=", ".join(PRECISION_NAMES) + " (default: bf16-mixed where the GPU has bf16, else "
    "fp16-mixed; fp32 on the CPU).")
OPTIMIZER_OPTION = typer.Option(
    None, "--optimizer",
    help=", ".join(OPTIMIZER_NAMES) + " (adamw: torch.optim.AdamW as torch defaults it, foreach "
    "on a GPU; adamw-fused: AdamW(fused=True)). Default: adamw-fused for Hugging Face models "
    "(the Trainer's default optim with torch >= 2.8), adamw for module:function models.")
ATTENTION_OPTION = typer.Option("auto", "--attention", help=", ".join(ATTENTIONS) + ".")
MAX_GRAD_NORM_OPTION = typer.Option(
    None, "--max-grad-norm",
    help="Clip the gradients' total norm at this value before each optimizer step, or 'none'. "
    "Default: 1.0 for Hugging Face models (the Trainer's default), none for module:function "
    "models.")
INPUT_SHAPE_OPTION = typer.Option(
    None, "--input-shape", help="One sample's shape for module:function models, e.g. 3,224,224.")
GPUS_OPTION = typer.Option(
    1, "--gpus", help="Data-parallel GPUs (one rank each): trace rank 0 of the step with the "
    "engine of --strategy; --batch is each GPU's micro-batch.")
NODES_OPTION = typer.Option(
    None, "--nodes", help="Nodes the --gpus GPUs span, evenly (default: as many as the GPU's "
    "catalog node holds, 8 for data-center GPUs); collectives across nodes run at --network.")
NETWORK_OPTION = typer.Option(
    None, "--network", help="The network between nodes: ib-hdr, ib-ndr, ib-xdr, roce-100g, "
    "roce-200g, roce-400g, or a TOML file with gbit_per_s (each GPU's line rate; default: "
    "the GPU's DGX-class network).")
STRATEGY_OPTION = typer.Option(
    None, "--strategy", help=", ".join(STRATEGIES) + f" (default with --gpus > 1: "
    f"{DEFAULT_STRATEGY}, fully sharded); " + ", ".join(ZERO_STRATEGIES)
    + ": DeepSpeed ZeRO, modelled (not traced).")
TASK_OPTION = typer.Option(
    None, "--task", help="causal-lm, masked-lm, seq-cls, image-cls, seq2seq-lm, speech-seq2seq "
    "or ctc (default: the config's architecture, through transformers' auto mappings).")
TARGET_SEQ_OPTION = typer.Option(
    None, "--target-seq", help="Label tokens per sample of an encoder-decoder's decoder "
    "(default: --seq; Whisper: its max_target_positions) or a CTC transcript (default: the "
    "encoder's frames, the most CTC aligns).")
IMAGE_SIZE_OPTION = typer.Option(
    None, "--image-size", help="Pixels a side of an image model's input; the model is built for "
    "it (default: the config's image_size).")


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """'3,224,224', '3x224x224' or '3 224 224' -> (3, 224, 224): one sample's shape."""
    if text is None:
        return None
    parts = [p for p in re.split(r"[,x ]+", text.strip()) if p]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise TilefitError("--input-shape must be positive integers separated by commas",
                           expected="e.g. 3,224,224 (one sample, no batch dimension)",
                           given=repr(text), fix="write it like --input-shape 3,224,224")
    return dims


LOSS_SYNC_OPTION = typer.Option(
    None, "--loss-sync/--no-loss-sync",
    help="The training loop reads the loss on the host after each micro-batch, waiting for "
    "the GPU. Default: on for Hugging Face models (the Trainer's logging_nan_inf_filter=True), "
    "off for module:function models.")


FUSED_CE_OPTION = typer.Option(
    False, "--fused-ce/--no-fused-ce",
    help="A causal LM's loss as fused linear cross-entropy (Liger Kernel's; HF "
    "use_liger_kernel=True): the logits are never held whole.")


LORA_OPTION = typer.Option(
    False, "--lora", help="LoRA fine-tuning as peft runs it: rank-16 adapters (alpha 32) on "
    "every linear layer but the output head, the base frozen in the precision's 16-bit dtype "
    "(fp32 under --precision fp32), the adapters in fp32: what `tilefit plan --allow-peft` "
    "proposes. Hugging Face models; needs peft. --lora-rank, --lora-alpha, --lora-targets, "
    "--lora-dropout, --dora and --modules-to-save change the adapters (and imply --lora).")
LORA_RANK_OPTION = typer.Option(None, "--lora-rank", help="LoRA's rank (peft's r; default 16).")
LORA_ALPHA_OPTION = typer.Option(None, "--lora-alpha",
                                 help="LoRA's alpha (peft's lora_alpha; default 32).")
LORA_TARGETS_OPTION = typer.Option(
    None, "--lora-targets", help="The modules LoRA adapts (peft's target_modules): names "
    "separated by commas, e.g. q_proj,v_proj, or all-linear (the default: every linear layer "
    "but the output head).")
LORA_DROPOUT_OPTION = typer.Option(None, "--lora-dropout",
                                   help="Dropout on the adapters' input (peft's lora_dropout; "
                                   "default 0).")
DORA_OPTION = typer.Option(False, "--dora", help="DoRA (peft's use_dora): LoRA with a trained "
                           "magnitude per output feature.")
MODULES_TO_SAVE_OPTION = typer.Option(
    None, "--modules-to-save", help="Modules trained in full beside the adapters (peft's "
    "modules_to_save), names separated by commas, e.g. lm_head.")


def lora_of(on: bool, rank: int | None, alpha: float | None, targets: str | None,
            dropout: float | None, dora: bool, modules_to_save: str | None) -> Lora | None:
    """The Lora of --lora and its settings: any setting implies --lora; the ones not given
    keep Lora()'s defaults."""
    from tilefit.recipe import Lora

    given: dict[str, Any] = {k: v for k, v in (
        ("rank", rank), ("dropout", dropout), ("targets", targets),
        ("modules_to_save", modules_to_save)) if v is not None}
    if alpha is not None:  # 32, not 32.0, in the configs a plan pastes
        given["alpha"] = int(alpha) if float(alpha).is_integer() else alpha
    if dora:
        given["dora"] = True
    return Lora(**given) if on or given else None


QUANTIZE_OPTION = typer.Option(
    None, "--quantize", help="With --lora (QLoRA): the frozen base's linear layers but the "
    "output head quantized by bitsandbytes, as transformers' BitsAndBytesConfig loads them: "
    "nf4 or fp4 (Linear4bit, blocks of 64, double quantization, computing in the "
    "precision's 16-bit dtype), or int8 (Linear8bitLt; --gpu cpu only). Needs bitsandbytes.")

DOUBLE_QUANT_OPTION = typer.Option(
    None, "--double-quant/--no-double-quant", help="With --quantize nf4|fp4: the scales "
    "quantized again (BitsAndBytesConfig's bnb_4bit_use_double_quant; default on, as QLoRA).")
QUANT_COMPUTE_DTYPE_OPTION = typer.Option(
    None, "--quant-compute-dtype", help="With --quantize nf4|fp4: the dtype the 4-bit layers "
    "compute in (bnb_4bit_compute_dtype): bf16, fp16 or fp32; default the precision's 16-bit "
    "dtype.")
PREPARE_KBIT_OPTION = typer.Option(
    None, "--prepare-kbit/--no-prepare-kbit", help="With --quantize: whether peft's "
    "prepare_model_for_kbit_training runs (it casts what stays unquantized to fp32; default "
    "on). Without it those weights stay in the compute dtype.")
QUANT_SETTINGS = {"double_quant": "double-quant", "quant_compute_dtype": "quant-compute-dtype",
                  "prepare_kbit": "prepare-kbit"}


ROUTING_OPTION = typer.Option(
    None, "--routing", help="A mixture-of-experts model's tokens per expert, which the router "
    "decides from values a trace does not have: balanced (each expert tokens x top_k / "
    "experts) or skewed:F (the busiest expert a share F in (0, 1] of the routed tokens, the "
    "others the rest evenly). Default: balanced.")


ALLOC_CONF_OPTION = typer.Option(
    None, "--alloc-conf", help="PyTorch's CUDA caching allocator settings, as "
    "PYTORCH_CUDA_ALLOC_CONF takes them (e.g. expandable_segments:True, "
    "max_split_size_mb:512); default: the PYTORCH_CUDA_ALLOC_CONF of this environment.")


COMPILE_OPTION = typer.Option(
    False, "--compile", help="Predict the step as torch.compile (Inductor, default mode) runs "
    "it: the activations its partitioner saves, its fused kernels; the optimizer step stays "
    "eager.")


GRAPH_BREAKS_OPTION = typer.Option(False, "--graph-breaks", help="With --compile: run Dynamo "
                                   "over the step and list where it would break it into "
                                   "several graphs (seconds more).")
OFFLOAD_OPTION = typer.Option(False, "--offload", help="With --strategy zero1/zero2/zero3: "
                              "DeepSpeed's optimizer offloaded to the CPU (modelled).")


COMPILE_MODE_OPTION = typer.Option(
    "default", "--compile-mode", help="With --compile: torch.compile's mode, 'default' or "
    "'reduce-overhead' (the forward and backward replayed as CUDA graphs: one replay per "
    "graph on the host, their memory in a private pool; GPUs only).")


def max_grad_norm(text: str) -> float | None:
    """--max-grad-norm: a positive number, or 'none' (no clipping)."""
    if text.strip().lower() in ("none", "off", "no"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    check_max_grad_norm(value, given=repr(text))
    return value


def recipe(work: Any, *, compile_: bool = False, compile_mode: str = "default",
           graph_breaks: bool = False, gpus: int = 1, strategy: str | None = None,
           offload: bool = False, lora: bool | Lora | None = False, **flags: Any) -> Recipe:
    """The Recipe of the command line's flags: ``Recipe.for_model`` (the Trainer's loop for
    Hugging Face models, plain PyTorch's for module:function models) with the flags the
    user gave on top (None: not given). The same function Python users call, so the CLI and
    Python agree by construction."""
    from tilefit.recipe import Compile, Parallelism
    from tilefit.recipe import Recipe as Recipe_

    if graph_breaks and not compile_:
        raise TilefitError("--graph-breaks looks for torch.compile's graph breaks",
                           expected="--compile with --graph-breaks", given="no --compile",
                           fix="add --compile")
    check_compile_mode(compile_mode, compile_)
    given = {k: v for k, v in flags.items() if v is not None}
    loose = [f"--{'no-' if given[name] is False else ''}{flag}"
             for name, flag in QUANT_SETTINGS.items() if name in given]
    if loose and given.get("quantize") is None:
        raise TilefitError(f"{loose[0]} describes a quantized base",
                           expected=f"--quantize nf4 (or fp4) with {loose[0]}",
                           given=f"{loose[0]} without --quantize",
                           fix=f"add --quantize nf4 --lora, or drop {loose[0]}")
    if isinstance(given.get("max_grad_norm"), str):
        given["max_grad_norm"] = max_grad_norm(given["max_grad_norm"])
    return Recipe_.for_model(
        work, **given, lora=lora or None,
        compile=Compile(compile_mode, graph_breaks) if compile_ else None,
        parallel=Parallelism(world_size=gpus, strategy=strategy, offload=offload))


def load(model: str, seq: int | None, input_shape: str | None, task: str | None,  # type: ignore[no-untyped-def]
         target_seq: int | None = None, image_size: int | None = None,
         revision: str | None = None):
    """The Workload for the command line's model options."""
    from tilefit.models import load_workload

    return load_workload(model, seq_len=seq, input_shape=parse_shape(input_shape), task=task,
                         target_seq_len=target_seq, image_size=image_size, revision=revision)


def placed(device: Device, gpus: int, nodes: int | None, network: str | None) -> Device:
    """The device as one of --gpus GPUs over --nodes nodes joined by --network."""
    from tilefit.hardware.networks import get_network, on_nodes

    if (nodes is not None or network is not None) and gpus <= 1:
        raise TilefitError("--nodes and --network describe a job of several GPUs",
                           expected="--gpus N (N > 1) with them", given=f"--gpus {gpus}",
                           fix="add --gpus, e.g. --gpus 16 --nodes 2")
    return on_nodes(device, gpus, nodes, None if network is None else get_network(network))
