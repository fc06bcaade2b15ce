"""Hugging Face models from a config dict: tasks, position limits, building, example batches.

Models are built with transformers' Auto classes from the config alone
(``AutoModelFor*.from_config``), never ``from_pretrained``: nothing is downloaded, and under a
FakeTensorMode or on the meta device no weight memory is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError, close_matches
from tilefit.quiet_imports import quiet_imports

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

TASKS: tuple[str, ...] = ("causal-lm", "masked-lm", "seq-cls", "image-cls")

# task -> (name of the model_type -> class-name mapping in transformers.models.auto.modeling_auto,
#          Auto class name)
_TASK_MAPPINGS: dict[str, tuple[str, str]] = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                "AutoModelForSequenceClassification"),
    "image-cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                  "AutoModelForImageClassification"),
}

# Suffix of a class in the config's "architectures" list -> task.
_ARCH_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),  # GPT2LMHeadModel
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "seq-cls"),
    ("ForImageClassification", "image-cls"),
)

# Default tokens per sample when the user gives none: decoders 2048 (the context length of the
# Llama/Mistral/Qwen/Phi pre-training recipes, and a common fine-tuning length), encoders 512
# (BERT's and RoBERTa's pre-training length); both capped by the model's position limit, so
# GPT-2 gets 1024 and BERT 512.
DEFAULT_SEQ_LEN = {"causal-lm": 2048, "masked-lm": 512, "seq-cls": 512}

# Model types whose position ids start after the padding index (RobertaEmbeddings:
# position ids = padding_idx + 1 + cumulative count), so max_position_embeddings - (pad + 1)
# tokens fit: 514 - 2 = 512 for roberta-base.
_PADDING_OFFSET_TYPES = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "longformer",
     "data2vec-text", "xmod", "ibert", "mpnet"}
)

# A field name people use for one model family that another family spells differently.
_FIELD_ALIASES = {"gpt2": {"intermediate_size": "n_inner"}}


def auto_class_name(task: str) -> str:
    """transformers' Auto class of a task (AutoModelForCausalLM, ...)."""
    return _TASK_MAPPINGS[task][1]


def _mapping(task: str) -> Mapping[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, _TASK_MAPPINGS[task][0])


def transformers_config_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without tilefit's ``_`` notes, ready for transformers."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def check_model_type(config: Mapping[str, Any], origin: str) -> str:
    """The config's model_type, or a TilefitError when it is missing or unknown to transformers."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not model_type:
        raise TilefitError(
            f"the config {origin} has no model_type",
            expected='a Hugging Face config.json with a "model_type" key, e.g. "llama"',
            given=f"keys {sorted(config)[:12]}",
            fix='add "model_type" (see the model\'s config.json on the hub)',
        )
    if model_type not in CONFIG_MAPPING:
        hints = close_matches(str(model_type), list(CONFIG_MAPPING.keys()))
        raise TilefitError(
            f"model_type {model_type!r} in {origin} is not known to this transformers version",
            expected="a model_type of transformers' CONFIG_MAPPING",
            given=str(model_type),
            fix=(f"did you mean {', '.join(hints)}? " if hints else "")
            + "upgrade transformers, or correct model_type",
        )
    return str(model_type)


@contextmanager
def hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for the duration of a call into transformers, then as it was: tilefit
    builds models from configs it ships (from_config) and must never reach the hub, but the
    user's own process keeps its setting."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def config_rejections() -> tuple[type[Exception], ...]:
    """What transformers raises for a config it rejects: TypeError or ValueError, which the
    strict config classes of transformers 5 wrap in huggingface_hub's StrictDataclassError
    (LlamaConfig: hidden_size not a multiple of num_attention_heads)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # a huggingface_hub without strict dataclasses (transformers 4)
        return (TypeError, ValueError)
    return (TypeError, ValueError, StrictDataclassError)


def make_config(config: Mapping[str, Any]) -> PretrainedConfig:
    """A fresh transformers config object from the dict (the dict is not changed)."""
    with hub_offline():
        from transformers import AutoConfig

        clean = transformers_config_dict(config)
        model_type = clean.pop("model_type")
        return AutoConfig.for_model(model_type, **clean)


def default_task(config: Mapping[str, Any]) -> str:
    """The task of the config's own architecture, else the first task its model_type supports.

    Order of the fallback: image classification for vision types, then masked LM (encoders
    such as BERT also register a causal-LM head, but are pre-trained as masked LMs), then
    causal LM, then sequence classification.
    """
    for arch in config.get("architectures") or ():
        for suffix, task in _ARCH_SUFFIXES:
            if str(arch).endswith(suffix):
                return task
    model_type = config["model_type"]
    for task in ("image-cls", "masked-lm", "causal-lm", "seq-cls"):
        if model_type in _mapping(task):
            return task
    raise TilefitError(
        f"model_type {model_type!r} has no head tilefit can train",
        expected="a model with a causal-LM, masked-LM, sequence- or image-classification head",
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
    model_type = config["model_type"]
    if model_type not in _mapping(task):
        supported = [t for t in TASKS if model_type in _mapping(t)]
        raise TilefitError(
            f"{model_type} models have no {task} head in transformers",
            expected=" | ".join(supported) or "a supported task",
            given=task,
            fix="choose a task this model supports, or leave --task out",
        )


def position_limit(cfg: PretrainedConfig) -> int | None:
    """The most tokens one sample may have, from the model's position table (None: no limit)."""
    limit = getattr(cfg, "max_position_embeddings", None)  # n_positions for GPT-2 (attribute_map)
    if limit is None:
        return None
    if cfg.model_type in _PADDING_OFFSET_TYPES:
        limit -= int(getattr(cfg, "pad_token_id", 1) or 0) + 1
    return int(limit)


def check_seq_len(name: str, cfg: PretrainedConfig, seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise TilefitError(
            "seq_len must be a positive whole number of tokens",
            expected="an integer >= 1",
            given=repr(seq_len),
            fix="pass e.g. --seq 1024 (seq_len=1024 in Python)",
        )
    limit = position_limit(cfg)
    if limit is not None and seq_len > limit:
        field = "n_positions" if cfg.model_type == "gpt2" else "max_position_embeddings"
        offset = " minus its padding offset" if cfg.model_type in _PADDING_OFFSET_TYPES else ""
        raise TilefitError(
            f"{name} takes at most {limit} tokens per sample ({field}{offset})",
            expected=f"seq_len <= {limit}",
            given=str(seq_len),
            fix=f"use --seq {limit} or less (split longer documents), or a model with "
            "longer positions",
        )


def choose_seq_len(task: str, cfg: PretrainedConfig) -> int:
    limit = position_limit(cfg)
    default = DEFAULT_SEQ_LEN[task]
    return default if limit is None else min(default, limit)


def known_fields(config: Mapping[str, Any]) -> set[str]:
    """Field names a what-if may change: the config's own keys and its class's defaults."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[config["model_type"]]()
    fields = set(transformers_config_dict(config)) | set(defaults.to_dict())
    fields |= set(getattr(defaults, "attribute_map", {}) or {})
    fields |= set(getattr(defaults, "rope_parameters", None) or {})  # rope_theta, partial_rotary..
    fields |= {"num_labels"}
    return fields


def canonical_field(config: Mapping[str, Any], field: str) -> str:
    """The key the config dict stores ``field`` under (GPT-2's hidden_size is n_embd)."""
    from transformers import CONFIG_MAPPING

    model_type = config["model_type"]
    alias = _FIELD_ALIASES.get(model_type, {}).get(field)
    if alias:
        return alias
    attribute_map = getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {}
    return attribute_map.get(field, field)


def build_model(config: Mapping[str, Any], task: str, attention: str) -> torch.nn.Module:
    """A fresh model in train mode, fp32, on the current default device / fake mode."""
    import torch
    import transformers

    if attention not in ("eager", "sdpa"):
        raise TilefitError(
            f"unknown attention implementation {attention!r}",
            expected="eager | sdpa",
            given=str(attention),
            fix="pass attention='sdpa' (PyTorch's fused attention) or 'eager'",
        )
    cfg = make_config(config)
    if task == "seq-cls" and getattr(cfg, "pad_token_id", None) is None:
        # Decoder classifiers pick each row's last non-pad token and refuse batches > 1 without
        # a pad id; the synthetic batch never contains it, so the last token is used.
        eos = getattr(cfg, "eos_token_id", None)
        cfg.pad_token_id = (eos[0] if isinstance(eos, list | tuple) else eos) or 0
    # the Auto class imports transformers' modeling code, and with it torchao if installed
    with quiet_imports():
        auto_class = getattr(transformers, _TASK_MAPPINGS[task][1])
    # fp32 master weights whatever dtype the checkpoint was published in; the precision of a
    # recipe (tilefit.vocab.Precision) is applied by the tracer, not here.
    with quiet_imports(), _skip_init_without_data(), hub_offline():
        model = auto_class.from_config(cfg, attn_implementation=attention, dtype=torch.float32)
    if task == "causal-lm" and getattr(model, "loss_type", "") is None:
        # GPT2LMHeadModel's name matches no loss family, so transformers falls back to its
        # causal-LM loss with a warning on every run; name that same loss to keep stderr clean.
        model.loss_type = "ForCausalLM"
    model.train()
    return model


def _tensors_have_data() -> bool:
    """False inside a FakeTensorMode or under the meta device, where weights hold no values.

    Read from the active dispatch modes and the default device, without creating a tensor (a
    probe tensor would show up in a tracer's record of the build).
    """
    import torch

    from tilefit.compat.fake import fake_mode_active

    if fake_mode_active():
        return False
    return torch.get_default_device().type != "meta"


@contextmanager
def _skip_init_without_data() -> Iterator[None]:
    """Skip weight initialisation when tensors are fake or meta (nothing to initialise).

    Needed, not only faster: ``torch.nn.init.trunc_normal_`` (ViT, ...) branches on
    ``mask.any()``, a data-dependent value a FakeTensor cannot give. Weight tying still runs
    (GPT-2's lm_head shares wte), since it is ``tie_weights``, not ``initialize_weights``.
    With real tensors nothing is skipped: real runs get the model's own initialisation.
    """
    if _tensors_have_data():
        yield
        return
    from transformers import PreTrainedModel

    try:  # transformers >= 5: the torch init functions and modules it patches itself
        from transformers.initialization import TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

        with no_init_weights():
            yield
        return

    import sys

    def _noop(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else None

    originals: list[tuple[Any, str, Any]] = []
    for module_name in TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(module_name)
        for func_name in TORCH_INIT_FUNCTIONS:
            if module is not None and hasattr(module, func_name):
                originals.append((module, func_name, getattr(module, func_name)))
                setattr(module, func_name, _noop)
    originals.append(
        (PreTrainedModel, "initialize_weights", PreTrainedModel.__dict__["initialize_weights"])
    )
    PreTrainedModel.initialize_weights = _noop  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)


def _token_ids(batch_size: int, seq_len: int, cfg: PretrainedConfig, device: Any) -> torch.Tensor:
    """Deterministic ids 0, 1, 2, ... (mod vocab) in every row, with the pad id stepped over."""
    import torch

    vocab = int(cfg.vocab_size)
    ids = torch.arange(seq_len, dtype=torch.int64, device=device) % vocab
    pad = getattr(cfg, "pad_token_id", None)
    if pad is not None and vocab > 1:
        ids = torch.where(ids == pad, (pad + 1) % vocab, ids)
    return ids.unsqueeze(0).expand(batch_size, seq_len).contiguous()


def make_hf_batch(
    config: Mapping[str, Any], task: str, batch_size: int, seq_len: int | None, device: Any
) -> dict[str, torch.Tensor]:
    """A synthetic batch with the shapes and dtypes the task's head takes, labels included.

    causal-lm / masked-lm: input_ids and labels (B, S) int64, every position labelled (for the
    masked LM that is the cost of the loss over all positions; the encoder's cost does not
    depend on which tokens are masked). seq-cls: input_ids (B, S), labels (B,) class 0.
    image-cls: pixel_values (B, C, H, W) float32 zeros, labels (B,) class 0.
    """
    import torch

    cfg = make_config(config)
    if task == "image-cls":
        size = cfg.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        channels = int(getattr(cfg, "num_channels", 3))
        return {
            "pixel_values": torch.zeros(batch_size, channels, height, width, device=device),
            "labels": torch.zeros(batch_size, dtype=torch.int64, device=device),
        }
    assert seq_len is not None
    ids = _token_ids(batch_size, seq_len, cfg, device)
    if task == "seq-cls":
        # One label means regression in transformers (MSE on a float target).
        dtype = torch.float32 if int(cfg.num_labels) == 1 else torch.int64
        labels = torch.zeros(batch_size, dtype=dtype, device=device)
    else:
        labels = ids.clone()
    return {"input_ids": ids, "labels": labels}
