"""The training task of a Hugging Face config: which head, which Auto class, what it reads.

The task comes from transformers' own auto mappings (``transformers.models.auto.
modeling_auto``'s ``MODEL_FOR_*_MAPPING_NAMES``, model_type -> class name): the config's
``architectures`` entry names the head it was published with (``T5ForConditionalGeneration``
is in the sequence-to-sequence mapping, ``Wav2Vec2ForCTC`` in the CTC one); without one, the
first task in ``PREFERENCE`` whose mapping holds the model_type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tilefit.errors import TilefitError

# task -> (name of the model_type -> class-name mapping in transformers.models.auto.modeling_auto,
#          Auto class name)
_TASK_MAPPINGS: dict[str, tuple[str, str]] = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                "AutoModelForSequenceClassification"),
    "image-cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                  "AutoModelForImageClassification"),
    "seq2seq-lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "speech-seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
}

TASKS: tuple[str, ...] = tuple(_TASK_MAPPINGS)

# The order in which a model_type's tasks are tried, and a class in several mappings is read
# (BartForConditionalGeneration is both bart's masked-LM and its seq2seq head): the
# encoder-decoders' generation heads first (BART and Whisper also register a decoder-only
# causal LM; they are trained as encoder-decoders), CTC for speech encoders, image
# classification for vision types, then masked LM (encoders such as BERT also register a
# causal-LM head, but are pre-trained as masked LMs), then causal LM, then classification.
PREFERENCE: tuple[str, ...] = ("speech-seq2seq", "seq2seq-lm", "ctc", "image-cls", "masked-lm",
                               "causal-lm", "seq-cls")

# The tasks whose input is token ids (seq_len tokens per sample), and those whose labels are a
# decoder's or a CTC transcript's tokens (target_seq_len per sample).
TOKEN_INPUT_TASKS = frozenset({"causal-lm", "masked-lm", "seq-cls", "seq2seq-lm"})
TARGET_TASKS = frozenset({"seq2seq-lm", "speech-seq2seq", "ctc"})

# Default tokens per sample when the user gives none: decoders 2048 (the context length of the
# Llama/Mistral/Qwen/Phi pre-training recipes, and a common fine-tuning length), encoders 512
# (BERT's and RoBERTa's pre-training length, and T5's input length); all capped by the model's
# position limit, so GPT-2 gets 1024 and BERT 512.
DEFAULT_SEQ_LEN = {"causal-lm": 2048, "masked-lm": 512, "seq-cls": 512, "seq2seq-lm": 512}

# Raw audio of a CTC model: 20 s (run_speech_recognition_ctc.py's max_duration_in_seconds, the
# transformers example that fine-tunes Wav2Vec2 for CTC) at 16 kHz (Wav2Vec2FeatureExtractor's
# sampling_rate).
DEFAULT_AUDIO_SECONDS = 20
AUDIO_SAMPLING_RATE = 16_000


def auto_class_name(task: str) -> str:
    """transformers' Auto class of a task (AutoModelForCausalLM, ...)."""
    return _TASK_MAPPINGS[task][1]


def mapping(task: str) -> Mapping[str, Any]:
    """transformers' model_type -> class name(s) mapping of a task."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, _TASK_MAPPINGS[task][0])


def _class_names(task: str, model_type: str) -> tuple[str, ...]:
    names = mapping(task).get(model_type, ())
    return (names,) if isinstance(names, str) else tuple(names)


def head_class_name(task: str, model_type: str) -> str | None:
    """The class transformers' Auto class builds for this task and model_type."""
    names = _class_names(task, model_type)
    return names[0] if names else None


def supported_tasks(model_type: str) -> list[str]:
    return [t for t in PREFERENCE if model_type in mapping(t)]


def default_task(config: Mapping[str, Any]) -> str:
    """The task of the config's own architecture, else the model_type's first in PREFERENCE."""
    model_type = str(config["model_type"])
    for arch in config.get("architectures") or ():
        for task in PREFERENCE:
            if str(arch) in _class_names(task, model_type):
                return task
    tasks = supported_tasks(model_type)
    if tasks:
        return tasks[0]
    raise TilefitError(
        f"model_type {model_type!r} has no head tilefit can train",
        expected="a model with one of these heads in transformers: " + ", ".join(TASKS),
        given=str(model_type),
        fix="wrap the model in a package.module:function factory that returns an nn.Module",
    )


def check_task(config: Mapping[str, Any], task: str) -> None:
    if task not in TASKS:
        raise TilefitError(
            f"unknown task {task!r}",
            expected=" | ".join(TASKS),
            given=task,
            fix="pick one of the tasks, or leave it out to use the model's own head",
        )
    model_type = str(config["model_type"])
    if model_type not in mapping(task):
        raise TilefitError(
            f"{model_type} models have no {task} head in transformers",
            expected=" | ".join(supported_tasks(model_type)) or "a supported task",
            given=task,
            fix="choose a task this model supports, or pass load_workload(..., task=None)",
        )
