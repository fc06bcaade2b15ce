"""The shipped catalog: published config facts, computed parameter counts, `tilefit models`."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

from tilefit.models import catalog_names, load_workload
from tilefit.models.catalog import catalog_entry
from tilefit.models.params import count_parameters

REQUIRED = [
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base-uncased", "bert-large-uncased",
    "roberta-base", "llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b",
    "phi-2", "vit-base-patch16-224",
]


def test_catalog_has_the_required_models() -> None:
    assert set(REQUIRED) <= set(catalog_names())


# Facts from each model's config.json on the Hugging Face hub (typed here from the hub, not read
# from the shipped files), so a typo in a shipped config fails this test.
PUBLISHED = {
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "gpt2-medium": {"n_embd": 1024, "n_layer": 24, "n_head": 16},
    "gpt2-large": {"n_embd": 1280, "n_layer": 36, "n_head": 20},
    "gpt2-xl": {"n_embd": 1600, "n_layer": 48, "n_head": 25},
    "bert-base-uncased": {"vocab_size": 30522, "max_position_embeddings": 512,
                          "hidden_size": 768, "num_hidden_layers": 12},
    "bert-large-uncased": {"hidden_size": 1024, "num_hidden_layers": 24,
                           "num_attention_heads": 16, "intermediate_size": 4096},
    "roberta-base": {"vocab_size": 50265, "max_position_embeddings": 514, "pad_token_id": 1},
    "llama-2-7b": {"vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": 32,
                   "max_position_embeddings": 4096},
    "llama-3-8b": {"vocab_size": 128256, "intermediate_size": 14336, "num_key_value_heads": 8,
                   "rope_theta": 500000.0, "max_position_embeddings": 8192},
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_key_value_heads": 8, "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                      "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192,
                                      "rope_type": "llama3"}},
    "mistral-7b": {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                   "sliding_window": 4096},
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "phi-2": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
              "vocab_size": 51200, "partial_rotary_factor": 0.4},
    "vit-base-patch16-224": {"hidden_size": 768, "num_hidden_layers": 12, "image_size": 224,
                             "patch_size": 16, "num_labels": 1000},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_match_published_values(name: str) -> None:
    entry = catalog_entry(name)
    for key, value in PUBLISHED[name].items():
        assert entry[key] == value, (name, key)
    assert entry["_source"].startswith("https://huggingface.co/")


# Published / hand-derived parameter counts. The code counts them by building on the meta device.
PARAMS = {
    # V=50257, P=1024, d=768, L=12, lm_head tied to wte:
    # wte V*d = 38,597,376; wpe P*d = 786,432; per layer: 2 LayerNorms 2*2d = 3,072,
    # c_attn d*3d+3d = 1,771,776, attn c_proj d*d+d = 590,592, c_fc d*4d+4d = 2,362,368,
    # mlp c_proj 4d*d+d = 2,360,064 -> 7,087,872 * 12 = 85,054,464; ln_f 2d = 1,536.
    # Total 124,439,808 (the figure Hugging Face reports for GPT2LMHeadModel).
    "gpt2": 124_439_808,
    # V=32000, d=4096, I=11008, L=32, untied: embed + lm_head 2*V*d = 262,144,000; per layer
    # q,k,v,o 4d^2 = 67,108,864, gate/up/down 3dI = 135,266,304, 2 RMSNorms 8,192
    # -> 202,383,360 * 32 = 6,476,267,520; final norm 4,096. Total 6,738,415,616.
    "llama-2-7b": 6_738_415_616,
    # V=128256, 8 KV heads of 128 -> k,v width 1024, I=14336: 2*V*d = 1,050,673,152; per layer
    # q,o 2d^2 = 33,554,432, k,v 2*d*1024 = 8,388,608, MLP 3dI = 176,160,768, norms 8,192
    # -> 218,112,000 * 32 = 6,979,584,000; final norm 4,096. Total 8,030,261,248.
    "llama-3-8b": 8_030_261_248,
    # Mistral-7B-v0.1 (same as llama-3-8b with V=32000): 2*32000*4096 = 262,144,000
    # + 6,979,584,000 + 4,096 = 7,241,732,096.
    "mistral-7b": 7_241_732_096,
    # Llama-3.2-1B, tied: V*d = 128256*2048 = 262,668,288; per layer q,o 2d^2 = 8,388,608,
    # k,v 2*d*512 = 2,097,152, MLP 3*2048*8192 = 50,331,648, norms 4,096 -> 60,821,504 * 16
    # = 973,144,064; final norm 2,048. Total 1,235,814,400 (published "1.24B").
    "llama-3.2-1b": 1_235_814_400,
    # ViT-B/16 classifier, the figure of the ViT paper / timm (86.6M): 86,567,656.
    "vit-base-patch16-224": 86_567_656,
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_match_published_figures(name: str) -> None:
    assert count_parameters(load_workload(name)) == PARAMS[name]


def test_what_if_vocab_changes_the_count_by_the_embedding_rows() -> None:
    # gpt2 ties lm_head to wte, so 47 extra rows of 768 add 47*768 = 36,096 parameters once.
    padded = load_workload("gpt2").with_config(vocab_size=50304)
    assert count_parameters(padded) == 124_439_808 + 36_096


def test_models_command_json() -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(REQUIRED) <= set(rows)
    assert rows["gpt2"]["parameters"] == 124_439_808
    assert rows["gpt2"]["task"] == "causal-lm"
    assert rows["roberta-base"]["max_seq_len"] == 512  # 514 positions - (pad 1 + 1)
    assert rows["vit-base-patch16-224"]["task"] == "image-cls"


def test_models_command_table() -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    assert "llama-3-8b" in result.stdout and "8.03B" in result.stdout  # 8,030,261,248


def test_the_catalog_rows_are_computed_once_and_read_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`tilefit models` builds every catalog model once; the next listing reads the same
    computed rows from the cache without building anything, and a cache of other configs or
    versions is not read."""
    from tilefit.models import params

    first = params.catalog_models()
    assert params._rows_cache().is_file()

    def no_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a cached listing built a model")

    monkeypatch.setattr(params, "describe", no_build)
    assert params.catalog_models() == first
    # another transformers version is another key: computed again (here: refused)
    real_version = params.metadata.version
    monkeypatch.setattr(params.metadata, "version",
                        lambda pkg: "0.0" if pkg == "transformers" else real_version(pkg))
    with pytest.raises(AssertionError, match="built a model"):
        params.catalog_models()
