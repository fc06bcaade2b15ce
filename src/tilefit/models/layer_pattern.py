"""Which layers of a Hugging Face model are alike: each layer's kind and the pattern's period.

A model's layers are one block repeated (Llama), or a short pattern of kinds repeated: Gemma 2
alternates sliding-window and full attention, Qwen3.5 and Qwen3-Next run three linear-attention
layers to one full-attention layer, Jamba one attention layer in eight and experts every
second layer, Nemotron-H its ``hybrid_override_pattern``. The kind of each layer is read from
the config object transformers builds, where the model's class reads it (its per-layer
fields: ``layer_types``, ``layers_block_type``, ``layers_num_experts``). A model whose pattern
repeats is affine in the number of repeats, as a uniform one is in its layers: the layer lever
traces 1 and 2 repeats (docs/references.md, section 38).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# per-layer fields of transformers' configs: attributes or properties, one entry a layer
PER_LAYER_FIELDS = ("layer_types", "layers_block_type", "layers_num_experts")
# fields that make some layers unlike the others and are no per-layer list
MIXED_LAYER_FIELDS = ("first_k_dense_replace", "mlp_only_layers")


def layer_kinds(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """Each layer's kind, its per-layer fields joined ("linear_attention/1"); None where the
    layers differ in a way no per-layer field states (dense layers first, experts every
    ``decoder_sparse_step`` layers)."""
    from tilefit.models.hf import make_config

    built = make_config(config)
    n = int(built.num_hidden_layers)
    raw = built.to_dict()
    if any(raw.get(key) for key in MIXED_LAYER_FIELDS):
        return None
    if int(raw.get("decoder_sparse_step") or 1) > 1:
        return None
    columns = []
    for name in PER_LAYER_FIELDS:
        try:
            value = getattr(built, name, None)
        except (AttributeError, ValueError, TypeError):  # a property the sizes do not allow
            return None
        if isinstance(value, list | tuple) and len(value) == n:
            columns.append([str(v) for v in value])
    return tuple("/".join(col[i] for col in columns) for i in range(n))


def uniform_layers(config: Mapping[str, Any]) -> bool:
    """Whether every layer is built alike, as the model's class builds ``config``: not where
    its per-layer fields name more than one kind (Gemma 2's sliding and full attention,
    Jamba's Mamba and attention layers), dense layers come before the experts (DeepSeek) or
    experts every few layers (Qwen2-MoE)."""
    kinds = layer_kinds(config)
    return kinds is not None and len(set(kinds)) <= 1


def period_of(kinds: tuple[str, ...]) -> int:
    """The shortest p dividing the layer count with kinds == kinds[:p] repeated."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))


def _shortened(value: Any, n_layers: int, layers: int) -> Any:
    """A per-layer config value for the first ``layers`` of ``n_layers`` layers: a list or a
    pattern string cut, a list of layer indices kept below it; else unchanged."""
    if isinstance(value, list) and len(value) == n_layers:
        return value[:layers]
    if isinstance(value, str) and len(value) == n_layers:
        return value[:layers]
    if isinstance(value, list) and value and all(isinstance(i, int) and 0 <= i < n_layers
                                                 for i in value):
        return [i for i in value if i < layers]
    return value


def depth_changes(config: Mapping[str, Any], field: str, period: int, repeats: int
                  ) -> dict[str, Any]:
    """The config changes that keep the first ``repeats`` x ``period`` layers: the layer count
    and every per-layer list, pattern string or layer-index list cut to it."""
    from tilefit.models.hf import canonical_field

    key = canonical_field(config, field)  # GPT-2's num_hidden_layers is n_layer
    n_layers = int(config[key])
    layers = repeats * period
    out: dict[str, Any] = {field: layers}
    for name, value in config.items():
        # per-layer fields are named so (layer_types, attn_layer_indices, hybrid_layer_ids,
        # hybrid_override_pattern); a token-id list is not cut
        if name not in (field, key) and ("layer" in name or "pattern" in name):
            cut = _shortened(value, n_layers, layers)
            if cut is not value:
                out[name] = cut
    return out


def repeated_period(config: Mapping[str, Any], field: str) -> int | None:
    """The period of the config's layer pattern where it repeats and a config cut to one and
    two repeats builds those layers exactly (1 for alike layers); None where the layers differ
    otherwise, or the cut configs do not reproduce them."""
    kinds = layer_kinds(config)
    if kinds is None:
        return None
    p = period_of(kinds)
    for repeats in (1, 2):
        changed = {**config, **depth_changes(config, field, p, repeats)}
        try:
            if layer_kinds(changed) != kinds[:repeats * p]:
                return None
        except ValueError:  # transformers refuses the cut config (a field it checks)
            return None
    return p
