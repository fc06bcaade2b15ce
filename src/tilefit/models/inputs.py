"""What each task's head reads: the shape of one sample, a synthetic batch, and the CTC loss.

Batches are deterministic (no RNG): token ids 0, 1, 2, ... (mod vocab, stepping over the pad
id), zeros for pixels, log-mel features and audio, every label position used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.models import tasks

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def image_shape(cfg: PretrainedConfig) -> tuple[int, int, int]:
    """(channels, height, width) of an image model's input, from its config's image_size (a
    vision-language config's vision tower's: CLIP's vision_config)."""
    if getattr(cfg, "image_size", None) is None and hasattr(cfg, "vision_config"):
        cfg = cfg.vision_config
    size = getattr(cfg, "image_size", None)
    if size is None:
        raise TilefitError(
            f"the {cfg.model_type} config has no image_size",
            expected="an image size for the synthetic images",
            given="no image_size in the config",
            fix="pass load_workload(..., image_size=224)")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return int(getattr(cfg, "num_channels", 3)), int(height), int(width)


def mel_shape(cfg: PretrainedConfig) -> tuple[int, int]:
    """(num_mel_bins, frames) of a speech seq2seq model's log-mel input: Whisper's encoder takes
    exactly 2 x max_source_positions frames (its second convolution has stride 2)."""
    return int(cfg.num_mel_bins), 2 * int(cfg.max_source_positions)


def ctc_frames(cfg: PretrainedConfig, samples: int) -> int:
    """The frames a CTC model's convolutional feature encoder makes of ``samples`` audio
    samples: each layer (conv_kernel k, conv_stride s) gives floor((n - k) / s) + 1, the
    formula of transformers' ``_get_feat_extract_output_lengths``."""
    frames = samples
    for kernel, stride in zip(cfg.conv_kernel, cfg.conv_stride, strict=True):
        frames = (frames - int(kernel)) // int(stride) + 1
    return frames


def default_audio_samples() -> int:
    return tasks.DEFAULT_AUDIO_SECONDS * tasks.AUDIO_SAMPLING_RATE


def _check_length(what: str, value: int, limit: int | None, keyword: str) -> None:
    """``value`` of load_workload's ``keyword`` (input_shape: its one dimension)."""
    def given(n: int) -> str:
        return f"load_workload(..., {keyword}={(n,) if keyword == 'input_shape' else n})"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TilefitError(f"{what} must be a positive whole number", expected="an integer >= 1",
                           given=repr(value), fix=f"pass e.g. {given(128)}")
    if limit is not None and value > limit:
        raise TilefitError(f"{what} is at most {limit} for this model", expected=f"<= {limit}",
                           given=str(value), fix=f"use {given(limit)} or less")


def check_image_size(image_size: int) -> None:
    _check_length("image_size (pixels a side)", image_size, None, "image_size")


def target_limit(cfg: PretrainedConfig) -> int | None:
    """The most decoder tokens: max_target_positions (Whisper), else the shared position table
    (BART, Marian), else none (T5's relative positions)."""
    from tilefit.models.hf import position_limit

    limit = getattr(cfg, "max_target_positions", None)
    return int(limit) if limit is not None else position_limit(cfg)


def resolve_target(cfg: PretrainedConfig, task: str, seq_len: int | None,
                   target_seq_len: int | None, input_shape: tuple[int, ...] | None
                   ) -> int | None:
    """The labels' length: as given, else the encoder's input length (seq2seq-lm), the
    decoder's limit (speech-seq2seq: Whisper's 448), or the encoder's frames (ctc: the most
    labels CTC can align, an upper bound on its loss's memory)."""
    if task not in tasks.TARGET_TASKS:
        if target_seq_len is not None:
            raise TilefitError(
                f"task {task} has no decoder or transcript labels",
                expected="load_workload(..., target_seq_len=...) only for seq2seq-lm, "
                "speech-seq2seq or ctc", given=f"target_seq_len={target_seq_len}",
                fix="pass load_workload(..., target_seq_len=None)")
        return None
    if task == "ctc":
        assert input_shape is not None
        frames = ctc_frames(cfg, input_shape[0])
        target = frames if target_seq_len is None else target_seq_len
        _check_length("target_seq_len (CTC labels, at most one per frame)", target, frames,
                      "target_seq_len")
        return target
    if target_seq_len is None:
        target_seq_len = seq_len if task == "seq2seq-lm" else target_limit(cfg)
    assert target_seq_len is not None
    _check_length("target_seq_len (decoder label tokens)", target_seq_len, target_limit(cfg),
                  "target_seq_len")
    return target_seq_len


def resolve_input_shape(name: str, cfg: PretrainedConfig, task: str,
                        input_shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """One sample's non-token input: (samples,) of audio for ctc (stored in the workload,
    default 20 s at 16 kHz); None for the others, whose shape is the config's (a given
    input_shape must match it)."""
    if task == "ctc":
        shape = (default_audio_samples(),) if input_shape is None else tuple(input_shape)
        if len(shape) != 1:
            raise TilefitError(f"{name} takes raw audio: one dimension, the samples",
                               expected="load_workload(..., input_shape=(320000,)): the "
                               "samples (20 s at 16 kHz)",
                               given=str(shape), fix="give the number of audio samples")
        _check_length("audio samples", shape[0], None, "input_shape")
        return shape
    own = {"image-cls": image_shape, "speech-seq2seq": mel_shape}.get(task)
    if input_shape is None:
        return None
    if own is None:
        raise TilefitError(
            f"{name} takes token sequences; input_shape is for module:function factories",
            expected="load_workload(..., seq_len=...) for text models",
            given=f"input_shape={tuple(input_shape)}",
            fix="pass load_workload(..., input_shape=None, seq_len=...)")
    if tuple(input_shape) != own(cfg):
        raise TilefitError(
            f"{name} takes {'images' if task == 'image-cls' else 'log-mel features'} of shape "
            f"{own(cfg)} (from its config)",
            expected=f"input_shape {own(cfg)} or none", given=str(tuple(input_shape)),
            fix="pass load_workload(..., input_shape=None) (load_workload(..., image_size=...) "
            "changes an image model's size)")
    return None


def _token_ids(batch_size: int, seq_len: int, cfg: PretrainedConfig, device: Any) -> torch.Tensor:
    """Deterministic ids 0, 1, 2, ... (mod vocab) in every row, with the pad id stepped over."""
    import torch

    vocab = int(cfg.vocab_size)
    ids = torch.arange(seq_len, dtype=torch.int64, device=device) % vocab
    pad = getattr(cfg, "pad_token_id", None)
    if pad is not None and vocab > 1:
        ids = torch.where(ids == pad, (pad + 1) % vocab, ids)
    return ids.unsqueeze(0).expand(batch_size, seq_len).contiguous()


def _transcript_ids(batch_size: int, length: int, cfg: PretrainedConfig, device: Any
                    ) -> torch.Tensor:
    """CTC labels: every id but the blank (the pad id), in turn, so no two neighbours repeat
    (a repeat would need a blank frame between them)."""
    import torch

    blank = int(getattr(cfg, "pad_token_id", 0) or 0)
    ids = torch.arange(length, dtype=torch.int64, device=device) % (int(cfg.vocab_size) - 1)
    ids = ids + (ids >= blank).to(torch.int64)
    return ids.unsqueeze(0).expand(batch_size, length).contiguous()


def make_hf_batch(config: Mapping[str, Any], task: str, batch_size: int, seq_len: int | None,
                  device: Any, *, target_seq_len: int | None = None,
                  input_shape: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """A synthetic batch with the shapes and dtypes the task's head takes, labels included.

    causal-lm / masked-lm: input_ids and labels (B, S) int64, every position labelled (for the
    masked LM that is the cost of the loss over all positions; the encoder's cost does not
    depend on which tokens are masked). seq-cls: input_ids (B, S), labels (B,) class 0.
    image-cls: pixel_values (B, C, H, W) float32 zeros, labels (B,) class 0. seq2seq-lm:
    input_ids (B, S), labels (B, T) (the model shifts them into its decoder's inputs).
    speech-seq2seq: input_features (B, mel bins, frames) zeros, labels (B, T). ctc:
    input_values (B, samples) zeros, labels (B, T) without the blank.
    """
    import torch

    from tilefit.models.hf import make_config

    cfg = make_config(config)
    if task == "image-cls":
        pixels = torch.zeros(batch_size, *image_shape(cfg), device=device)
        return {"pixel_values": pixels,
                "labels": torch.zeros(batch_size, dtype=torch.int64, device=device)}
    if task == "speech-seq2seq":
        assert target_seq_len is not None
        return {"input_features": torch.zeros(batch_size, *mel_shape(cfg), device=device),
                "labels": _token_ids(batch_size, target_seq_len, cfg, device)}
    if task == "ctc":
        assert target_seq_len is not None and input_shape is not None
        return {"input_values": torch.zeros(batch_size, *input_shape, device=device),
                "labels": _transcript_ids(batch_size, target_seq_len, cfg, device)}
    assert seq_len is not None
    ids = _token_ids(batch_size, seq_len, cfg, device)
    if task == "seq-cls":
        # One label means regression in transformers (MSE on a float target).
        dtype = torch.float32 if int(cfg.num_labels) == 1 else torch.int64
        labels = torch.zeros(batch_size, dtype=dtype, device=device)
    elif task == "seq2seq-lm":
        assert target_seq_len is not None
        labels = _token_ids(batch_size, target_seq_len, cfg, device)
    else:
        labels = ids.clone()
    return {"input_ids": ids, "labels": labels}


def ctc_loss(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A CTC head's loss as transformers computes it (``loss.loss_ctc.ForCTCLoss``: fp32
    log-softmax, ``nn.functional.ctc_loss`` with the config's blank, reduction and
    zero_infinity), with the lengths as Python ints: every frame and every label is used, so
    the targets stay (B, T) and no shape depends on a value. transformers' own forward reads
    values twice (labels.max() against the vocabulary, masked_select of the labels), which a
    fake tensor cannot give. The reduction is applied here as torch's ctc_loss defines it
    ("mean": each loss divided by its target length, then the batch mean), since torch's
    makes the lengths a tensor from host memory, which a fake run has not."""
    import torch
    from torch import nn

    from tilefit.compat.fake import register_ctc_fakes

    register_ctc_fakes()
    logits = model(input_values=batch["input_values"]).logits
    labels = batch["labels"]
    log_probs = nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    cfg = model.config if hasattr(model, "config") else model.module.config  # DDP: .module
    batch_size, length = int(labels.shape[0]), int(labels.shape[1])
    with torch.backends.cudnn.flags(enabled=False):  # as transformers runs it
        losses = nn.functional.ctc_loss(
            log_probs, labels, [int(logits.shape[1])] * batch_size, [length] * batch_size,
            blank=int(cfg.pad_token_id or 0), reduction="none",
            zero_infinity=cfg.ctc_zero_infinity)
    if cfg.ctc_loss_reduction == "sum":
        return losses.sum()
    return (losses / max(length, 1)).mean()
