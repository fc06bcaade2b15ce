"""The options shared by the commands that take a model (estimate, audit, plan)."""

from __future__ import annotations

import os
import re

import typer

from tilefit.errors import TilefitError

GPU_OPTION = typer.Option(
    "a100-80gb", "--gpu", help="Catalog name or alias (see `tilefit gpus`), a TOML spec file, "
    "auto (the live GPU), or cpu (this machine).")
BATCH_OPTION = typer.Option(8, "--batch", help="Micro-batch size (samples per forward).")
CHECKPOINTING_OPTION = typer.Option(False, "--grad-checkpointing",
                                    help="Recompute activations in backward.")
ACCUMULATION_OPTION = typer.Option(1, "--accumulation",
                                   help="Gradient accumulation steps per optimizer step.")
MODEL_ARG = typer.Argument(
    ..., help="A catalog name (`tilefit models`), a path to a Hugging Face config.json, or "
    "package.module:function returning an nn.Module (with --input-shape).")
SEQ_OPTION = typer.Option(None, "--seq", help="Tokens per sample (default: the model's own).")
PRECISION_OPTION = typer.Option(
    None, "--precision",
    help="fp32, tf32, fp16-mixed, bf16-mixed or bf16 (default: bf16-mixed where the GPU has "
    "bf16, else fp16-mixed).")
OPTIMIZER_OPTION = typer.Option("adamw", "--optimizer",
                                help="sgd, adam, adamw, adafactor or adamw-8bit.")
ATTENTION_OPTION = typer.Option("auto", "--attention", help="auto, sdpa or eager.")
INPUT_SHAPE_OPTION = typer.Option(
    None, "--input-shape", help="One sample's shape for module:function models, e.g. 3,224,224.")
TASK_OPTION = typer.Option(
    None, "--task", help="causal-lm, masked-lm, seq-cls or image-cls (default: the model's).")


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """'3,224,224', '3x224x224' or '3 224 224' -> (3, 224, 224)."""
    if text is None:
        return None
    parts = [p for p in re.split(r"[,x ]+", text.strip()) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise TilefitError(
            "input shape not understood",
            expected="positive whole numbers separated by commas, without the batch dimension",
            given=repr(text),
            fix="write it like --input-shape 3,224,224",
        )
    return shape


def load(model: str, seq: int | None, input_shape: str | None, task: str | None):  # type: ignore[no-untyped-def]
    """The Workload for the command line's model options."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs ship with tilefit; never download
    from tilefit.models import load_workload

    return load_workload(model, seq_len=seq, input_shape=parse_shape(input_shape), task=task)
