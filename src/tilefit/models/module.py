"""A user's own Hugging Face module as a Workload: its config, its head's task and its
batch's sequence length, so that every what-if that needs a re-trace (batch, sequence,
memory, config dimensions) can rebuild it, as it does a catalog name or a config.json."""

from __future__ import annotations

from typing import Any

from tilefit.compat.transformers import hugging_face_module
from tilefit.models.sources import Workload, hf_workload
from tilefit.models.tasks import TARGET_TASKS, default_task


def module_workload(model: Any, batch: Any) -> tuple[Workload, int] | None:
    """(the workload, the batch's sample count) of a Hugging Face module and its example
    batch (a dict of tensors, as its forward takes), or None when ``model`` is not one."""
    hf_model = hugging_face_module(model)
    if hf_model is None or not isinstance(batch, dict):
        return None
    key = next((k for k in _INPUTS if hasattr(batch.get(k), "shape")), None)
    if key is None:
        return None
    first = batch[key]
    config = hf_model.config.to_dict()
    config["architectures"] = [type(hf_model).__name__]  # the head: the workload's task
    name = str(config.get("_name_or_path") or type(hf_model).__name__)
    seq_len = int(first.shape[1]) if key == "input_ids" else None
    audio = (int(first.shape[1]),) if key == "input_values" else None
    labels = batch.get("labels")  # a decoder's or a transcript's: their length
    target = int(labels.shape[1]) if getattr(labels, "ndim", 0) == 2 and \
        default_task(config) in TARGET_TASKS else None
    work = hf_workload(name, config, task=None, seq_len=seq_len, input_shape=audio,
                       target_seq_len=target)
    return work, int(first.shape[0])


# The main input of each task's head: token ids, pixels, log-mel features, raw audio.
_INPUTS = ("input_ids", "pixel_values", "input_features", "input_values")

