"""config.json paths, module:function factories, defaults, what-ifs and every bad input."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tilefit.errors import TilefitError
from tilefit.models import load_workload

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}


# --- defaults -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "task", "seq_len"),
    [
        ("gpt2", "causal-lm", 1024),  # 2048 capped by n_positions 1024
        ("bert-base-uncased", "masked-lm", 512),
        ("roberta-base", "masked-lm", 512),  # 514 positions - 2 (padding offset)
        ("llama-3-8b", "causal-lm", 2048),
        ("phi-2", "causal-lm", 2048),
        ("vit-base-patch16-224", "image-cls", None),
    ],
)
def test_default_task_and_seq_len(name: str, task: str, seq_len: int | None) -> None:
    workload = load_workload(name)
    assert (workload.task, workload.seq_len) == (task, seq_len)


def test_hub_id_resolves_to_the_catalog_name() -> None:
    assert load_workload("meta-llama/Meta-Llama-3-8B").name == "llama-3-8b"


# --- config.json ----------------------------------------------------------------------------

def test_config_json_path_and_folder(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    for source in (str(path), str(tmp_path)):
        workload = load_workload(source, seq_len=16)
        assert workload.task == "causal-lm" and workload.config["hidden_size"] == 64
        with FakeTensorMode():
            model = workload.build()
            loss = workload.loss_fn(model, workload.make_batch(2))
            loss.backward()
        # embed 512*64 + lm_head 512*64 = 65,536; per layer q,o 2*64*64 = 8,192,
        # k,v 2*64*32 = 4,096, MLP 3*64*128 = 24,576, norms 128 -> 36,992 * 2 = 73,984;
        # final norm 64. Total 139,584.
        assert sum(p.numel() for p in model.parameters()) == 139_584


def test_config_saved_by_transformers_with_an_infinite_float(tmp_path: Path) -> None:
    # save_pretrained writes Mamba 2's time_step_limit (0.0, inf) as {"__float__": "Infinity"};
    # plain json.loads left that dict, which transformers then rejected
    from transformers import Mamba2Config

    Mamba2Config(num_hidden_layers=1, hidden_size=64, num_heads=8, head_dim=16, n_groups=1,
                 vocab_size=256).save_pretrained(tmp_path)
    assert "__float__" in (tmp_path / "config.json").read_text()
    workload = load_workload(str(tmp_path), seq_len=16)
    assert workload.task == "causal-lm"
    assert list(workload.config["time_step_limit"]) == [0.0, float("inf")]


def test_config_without_model_type(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    with pytest.raises(TilefitError, match="model_type") as err:
        load_workload(str(path))
    assert err.value.fix


def test_config_with_unknown_model_type_suggests(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "model_type": "lama"}))
    with pytest.raises(TilefitError) as err:
        load_workload(str(path))
    assert "llama" in err.value.fix


def test_missing_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(TilefitError, match="does not exist"):
        load_workload(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TilefitError, match="JSON"):
        load_workload(str(bad))


# --- module:function ------------------------------------------------------------------------

FACTORY = """
import torch
from torch import nn

def build():
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.copy_(torch.tensor([1.0, 3.0]))
    return model

def not_a_module():
    return 42

VALUE = 3
"""


@pytest.fixture
def factory_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module with a unique name in a temporary current directory; returns its name."""
    name = f"tf_factory_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    return name


def test_factory_workload_stand_in_loss(factory_dir: str) -> None:
    workload = load_workload(f"{factory_dir}:build", input_shape=(4,))
    assert (workload.task, workload.seq_len, workload.input_shape) == ("module", None, (4,))
    assert workload.loss_is_stand_in
    batch = workload.make_batch(3)
    assert batch.shape == (3, 4) and batch.dtype == torch.float32
    model = workload.build()
    # zeros through the layer give the bias [1, 3] per row; the stand-in loss is its mean, 2.
    assert workload.loss_fn(model, batch).item() == pytest.approx(2.0)
    with FakeTensorMode():
        fake_model = workload.build()
        loss = workload.loss_fn(fake_model, workload.make_batch(5))
        loss.backward()
    assert fake_model.weight.grad.shape == (2, 4)


def test_factory_needs_input_shape(factory_dir: str) -> None:
    with pytest.raises(TilefitError, match="shape") as err:
        load_workload(f"{factory_dir}:build")
    assert "load_workload(..., input_shape=(3, 224, 224))" in err.value.fix


def test_factory_module_not_importable(factory_dir: str) -> None:
    with pytest.raises(TilefitError, match="cannot import") as err:
        load_workload("no_such_module_xyz:build", input_shape=(4,))
    assert "PYTHONPATH" in err.value.fix


def test_factory_function_missing(factory_dir: str) -> None:
    with pytest.raises(TilefitError, match="no function") as err:
        load_workload(f"{factory_dir}:buidl", input_shape=(4,))
    assert "build" in err.value.fix
    with pytest.raises(TilefitError, match="no function"):
        load_workload(f"{factory_dir}:VALUE", input_shape=(4,))  # not callable


def test_factory_returning_something_else(factory_dir: str) -> None:
    workload = load_workload(f"{factory_dir}:not_a_module", input_shape=(4,))
    with pytest.raises(TilefitError, match=r"not an nn\.Module"):
        workload.build()


def test_factory_rejects_token_options(factory_dir: str) -> None:
    with pytest.raises(TilefitError, match="seq_len"):
        load_workload(f"{factory_dir}:build", input_shape=(4,), seq_len=8)
    with pytest.raises(TilefitError, match="input_shape"):
        load_workload(f"{factory_dir}:build", input_shape=(0, 3))


# --- bad names, shapes, tasks ---------------------------------------------------------------

def test_unknown_name_suggests_close_matches() -> None:
    with pytest.raises(TilefitError, match="unknown model") as err:
        load_workload("gtp2-medium")
    assert "gpt2-medium" in err.value.fix


@pytest.mark.parametrize(
    ("name", "seq_len", "limit"),
    [("gpt2", 1025, 1024), ("bert-base-uncased", 513, 512), ("roberta-base", 513, 512),
     ("llama-2-7b", 4097, 4096), ("phi-2", 4096, 2048)],
)
def test_sequence_longer_than_positions(name: str, seq_len: int, limit: int) -> None:
    load_workload(name, seq_len=limit)  # the limit itself fits
    with pytest.raises(TilefitError, match=f"at most {limit} tokens") as err:
        load_workload(name, seq_len=seq_len)
    assert str(limit) in err.value.fix


def test_bad_seq_len_and_batch() -> None:
    with pytest.raises(TilefitError, match="positive"):
        load_workload("gpt2", seq_len=0)
    with pytest.raises(TilefitError, match="positive"):
        load_workload("gpt2", seq_len=8).make_batch(0)


def test_task_override_and_unsupported_task() -> None:
    workload = load_workload("gpt2", task="seq-cls", seq_len=8).with_config(n_layer=1)
    with FakeTensorMode():
        model = workload.build()
        loss = workload.loss_fn(model, workload.make_batch(2))
    assert type(model).__name__ == "GPT2ForSequenceClassification" and loss.shape == ()
    with pytest.raises(TilefitError, match="no image-cls head"):
        load_workload("gpt2", task="image-cls")
    with pytest.raises(TilefitError, match="unknown task"):
        load_workload("gpt2", task="lm")


def test_options_that_do_not_fit_the_model() -> None:
    with pytest.raises(TilefitError, match="image model"):
        load_workload("vit-base-patch16-224", seq_len=128)
    with pytest.raises(TilefitError, match="input_shape"):
        load_workload("gpt2", input_shape=(3, 224, 224))
    load_workload("vit-base-patch16-224", input_shape=(3, 224, 224))  # its own shape is fine
    with pytest.raises(TilefitError, match="images of shape"):
        load_workload("vit-base-patch16-224", input_shape=(3, 384, 384))
    with pytest.raises(TilefitError, match="attention"):
        load_workload("gpt2", seq_len=8).build("flash")


# --- what-ifs -------------------------------------------------------------------------------

def test_with_config_replaces_fields_and_keeps_the_original() -> None:
    base = load_workload("llama-2-7b", seq_len=128)
    changed = base.with_config(intermediate_size=11264, vocab_size=32064)
    assert changed.config["intermediate_size"] == 11264 and changed.config["vocab_size"] == 32064
    assert base.config["intermediate_size"] == 11008  # the original is unchanged
    assert (changed.name, changed.task, changed.seq_len) == ("llama-2-7b", "causal-lm", 128)
    with pytest.raises(TypeError):
        base.config["vocab_size"] = 1  # read-only mapping


def test_with_config_aliases_and_rope_fields() -> None:
    gpt2 = load_workload("gpt2").with_config(hidden_size=1024, intermediate_size=3000)
    assert gpt2.config["n_embd"] == 1024 and gpt2.config["n_inner"] == 3000
    llama = load_workload("llama-2-7b").with_config(rope_theta=500000.0)
    assert llama.config["rope_theta"] == 500000.0


def test_with_config_unknown_field_suggests() -> None:
    with pytest.raises(TilefitError, match="no field 'vocab_sise'") as err:
        load_workload("gpt2").with_config(vocab_sise=50304)
    assert "vocab_size" in err.value.fix


def test_a_config_transformers_rejects_is_a_tilefit_error() -> None:
    # transformers 5 checks hidden_size % num_attention_heads when the config is made (as
    # huggingface_hub's StrictDataclassError); older versions when the model is built
    try:
        load_workload("llama-2-7b").with_config(hidden_size=1000)
    except TilefitError as err:
        assert "transformers rejects the config" in err.problem


def test_with_config_rechecks_the_sequence_length() -> None:
    with pytest.raises(TilefitError, match="at most 512 tokens"):
        load_workload("gpt2", seq_len=1024).with_config(n_positions=512)


def test_workloads_compare_and_hash_by_value() -> None:
    a, b = load_workload("gpt2", seq_len=64), load_workload("gpt2", seq_len=64)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != a.with_config(vocab_size=50304) and a != load_workload("gpt2", seq_len=128)
    assert a.to_dict()["config"]["n_embd"] == 768 and a.loss_is_stand_in is False
