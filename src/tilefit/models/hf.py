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
from tilefit.models.tasks import DEFAULT_SEQ_LEN, TASKS, auto_class_name, head_class_name
from tilefit.quiet_imports import quiet_imports
from tilefit.vocab import ATTENTIONS

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# Re-exported: callers that read the task table through hf keep working.
__all__ = ["TASKS", "auto_class_name", "build_model", "make_config"]

# Model types whose position ids start after the padding index (RobertaEmbeddings:
# position ids = padding_idx + 1 + cumulative count), so max_position_embeddings - (pad + 1)
# tokens fit: 514 - 2 = 512 for roberta-base.
_PADDING_OFFSET_TYPES = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "longformer",
     "data2vec-text", "xmod", "ibert", "mpnet"}
)

# A field name people use for one model family that another family spells differently.
_FIELD_ALIASES = {"gpt2": {"intermediate_size": "n_inner"}}


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
        import transformers

        hints = close_matches(str(model_type), list(CONFIG_MAPPING.keys()))
        raise TilefitError(
            f"model_type {model_type!r} in {origin} is not known to transformers "
            f"{transformers.__version__} (installed)",
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
            fix="pass e.g. load_workload(..., seq_len=1024)",
        )
    limit = position_limit(cfg)
    if limit is not None and seq_len > limit:
        field = "n_positions" if cfg.model_type == "gpt2" else "max_position_embeddings"
        offset = " minus its padding offset" if cfg.model_type in _PADDING_OFFSET_TYPES else ""
        raise TilefitError(
            f"{name} takes at most {limit} tokens per sample ({field}{offset})",
            expected=f"seq_len <= {limit}",
            given=str(seq_len),
            fix=f"use load_workload(..., seq_len={limit}) or less (split longer documents), "
            "or a model with "
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
    # PretrainedConfig's own keywords: the label count, and how a mixture of experts runs its
    # experts (transformers/configuration_utils.py pops it into _experts_implementation)
    fields |= {"num_labels", "experts_implementation"}
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
    """A fresh model in train mode, fp32, on the current default device / fake mode.

    ``attention``: "auto" lets transformers choose for the architecture (SDPA where the model
    class supports it, else eager: Gemma 2, BLOOM, Mamba); "sdpa" or "eager" as asked, and
    "sdpa" on a class that refuses it is a TilefitError naming the fix.
    """
    import torch
    import transformers

    from tilefit.compat.transformers import (
        check_attention,
        skip_init_without_data,
        tensors_have_data,
    )

    if attention not in ATTENTIONS:
        raise TilefitError(
            f"unknown attention implementation {attention!r}",
            expected=" | ".join(ATTENTIONS),
            given=str(attention),
            fix="pass attention='auto' (transformers' choice for the model), 'sdpa' or 'eager'",
        )
    cfg = make_config(config)
    if task == "seq-cls" and getattr(cfg, "pad_token_id", None) is None:
        # Decoder classifiers pick each row's last non-pad token and refuse batches > 1 without
        # a pad id; the synthetic batch never contains it, so the last token is used.
        eos = getattr(cfg, "eos_token_id", None)
        cfg.pad_token_id = (eos[0] if isinstance(eos, list | tuple) else eos) or 0
    if cfg.architectures is None:  # a config.json without it (JSON null, or left out)
        # transformers' Auto class iterates it when the model_type maps to several heads of
        # the task (DeiT's classifier with and without teacher); [] picks the first, its default
        cfg.architectures = []
    if not tensors_have_data():
        _no_random_structure(cfg)
    # the Auto class imports transformers' modeling code, and with it torchao if installed
    with quiet_imports():
        auto_class = getattr(transformers, auto_class_name(task))
        head = head_class_name(task, cfg.model_type)
        if head is not None and hasattr(transformers, head):
            check_attention(getattr(transformers, head), attention)
    # fp32 master weights whatever dtype the checkpoint was published in; the precision of a
    # recipe (tilefit.vocab.Precision) is applied by the tracer, not here.
    with quiet_imports(), skip_init_without_data(), hub_offline():
        model = auto_class.from_config(
            cfg, attn_implementation=None if attention == "auto" else attention,
            dtype=torch.float32)
    if task == "causal-lm" and getattr(model, "loss_type", "") is None:
        # GPT2LMHeadModel's name matches no loss family, so transformers falls back to its
        # causal-LM loss with a warning on every run; name that same loss to keep stderr clean.
        model.loss_type = "ForCausalLM"
    model.train()
    return model


def refuses_sdpa(config: Mapping[str, Any], task: str) -> bool:
    """True when the class transformers builds for the config and task refuses SDPA (Gemma
    2, BLOOM): its attention "auto" is eager."""
    import transformers

    from tilefit.compat.transformers import refuses_sdpa as class_refuses

    head = head_class_name(task, str(config["model_type"]))
    with quiet_imports():
        return head is not None and hasattr(transformers, head) and \
            class_refuses(getattr(transformers, head))


def _no_random_structure(cfg: PretrainedConfig) -> None:
    """LayerDrop and SpecAugment off, in a build without data (the trace's).

    LayerDrop (Wav2Vec2's layerdrop 0.1, BART's encoder_layerdrop, ...) skips each layer at
    random by comparing torch.rand([]) with the rate, a value a fake tensor cannot give: the
    trace runs every layer, the step whose peak is highest. SpecAugment (Wav2Vec2's
    mask_time_prob 0.05, mask_feature_prob) indexes the hidden states with a boolean mask drawn
    on the host, whose backward needs the mask's true count: the trace leaves out that one
    masked write of the hidden states.
    """
    for field, value in cfg.to_dict().items():
        random_part = field.endswith("layerdrop") or field in _SPEC_AUGMENT
        if random_part and isinstance(value, float) and value > 0:
            setattr(cfg, field, 0.0)


_SPEC_AUGMENT = frozenset({"mask_time_prob", "mask_feature_prob"})
