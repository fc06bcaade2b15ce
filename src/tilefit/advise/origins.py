"""Where a GEMM dimension comes from, in the user's terms.

A dimension is either a weight dimension (a config field: vocab_size, intermediate_size,
hidden_size, num_labels, heads x head_dim; or a layer's in/out features for plain modules) or a
token dimension (batch x sequence), because the fixes differ: a weight dimension is changed in
the config or the layer, a token dimension by padding the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Any

from tilefit.gemm import round_up
from tilefit.models import Workload

WEIGHT = "weight"
TOKEN = "token"


@dataclass(frozen=True)
class Origin:
    kind: str  # "weight" or "token"
    dimension: str  # user term: "vocab_size", "intermediate_size", "batch x seq", "out_features"
    value: int
    config_field: str | None = None  # the with_config key, when a config field holds it
    step: int = 1  # a suggested value must be a multiple of this as well (hidden / heads)
    product: bool = False  # the dimension is step x config_field (heads x head_dim)

    def field_value(self, dim_value: int) -> int:
        """The config field's value that gives GEMM dimension ``dim_value``."""
        return dim_value // self.step if self.product else dim_value


def _get(cfg: Any, *names: str) -> int | None:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def config_fields(workload: Workload) -> list[Origin]:
    """The GEMM-relevant fields of the model's config, most specific first (a value held by
    several fields is attributed to the first)."""
    if workload.config is None:
        return []
    from tilefit.models import hf

    cfg = hf.make_config(dict(workload.config))
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    heads = _get(cfg, "num_attention_heads", "n_head")
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    inter = _get(cfg, "intermediate_size", "n_inner", "ffn_dim")
    if inter is None and workload.model_type == "gpt2" and hidden:
        inter = 4 * hidden  # GPT2MLP: n_inner None means 4 * n_embd (modeling_gpt2.py)
    out: list[Origin] = []
    vocab = _get(cfg, "vocab_size")
    if vocab and workload.task != "image-cls":
        out.append(Origin(WEIGHT, "vocab_size", vocab, "vocab_size"))
    if inter:
        out.append(Origin(WEIGHT, "intermediate_size", inter, "intermediate_size"))
    if workload.task in ("seq-cls", "image-cls"):
        labels = _get(cfg, "num_labels")
        if labels:
            out.append(Origin(WEIGHT, "num_labels", labels, "num_labels"))
    if hidden:
        # hidden = heads x head_dim for most models: a new hidden size must stay divisible by
        # the head count
        # transformers checks hidden_size % num_attention_heads == 0 (LlamaConfig and others)
        out.append(Origin(WEIGHT, "hidden_size", hidden, "hidden_size", step=heads or 1))
    if heads and head_dim and heads * head_dim != hidden:
        out.append(Origin(WEIGHT, "num_attention_heads x head_dim", heads * head_dim, "head_dim",
                          step=heads, product=True))
    if kv_heads and head_dim and kv_heads != heads:
        out.append(Origin(WEIGHT, "num_key_value_heads x head_dim", kv_heads * head_dim,
                          "head_dim", step=kv_heads, product=True))
    if head_dim:
        out.append(Origin(WEIGHT, "head_dim", head_dim, "head_dim"))
    return out


def nearest_aligned(value: int, multiple: int, step: int = 1) -> int:
    """The smallest value >= ``value`` that is a multiple of both ``multiple`` and ``step``."""
    return round_up(value, lcm(multiple, step))
