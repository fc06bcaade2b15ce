"""A user's own Hugging Face module as a Workload: its config, its head's task and its
batch's sequence length, so that every what-if that needs a re-trace (batch, sequence,
memory, config dimensions) can rebuild it, as it does a catalog name or a config.json."""

from __future__ import annotations

from typing import Any

from tilefit.compat.transformers import hugging_face_module
from tilefit.models.workload import Workload, hf_workload


def module_workload(model: Any, batch: Any) -> tuple[Workload, int] | None:
    """(the workload, the batch's sample count) of a Hugging Face module and its example
    batch (a dict of tensors, as its forward takes), or None when ``model`` is not one."""
    hf_model = hugging_face_module(model)
    if hf_model is None or not isinstance(batch, dict):
        return None
    first = batch.get("input_ids", batch.get("pixel_values"))
    if first is None or not hasattr(first, "shape"):
        return None
    config = hf_model.config.to_dict()
    config["architectures"] = [type(hf_model).__name__]  # the head: the workload's task
    name = str(config.get("_name_or_path") or type(hf_model).__name__)
    seq_len = int(first.shape[1]) if "input_ids" in batch else None
    return hf_workload(name, config, task=None, seq_len=seq_len), int(first.shape[0])
