"""Every catalog model builds inside FakeTensorMode and trains one tiny step; batches; real init."""

from __future__ import annotations

import contextlib
import math
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tilefit.compat.moe import RoutedExperts, experts_modules
from tilefit.models import catalog_names, load_workload
from tilefit.vocab import BALANCED


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection (a hub download) fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tilefit.models tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _layers_field(config: dict) -> str:
    return "n_layer" if "n_layer" in config else "num_hidden_layers"


@pytest.mark.parametrize("name", catalog_names())
def test_catalog_model_trains_one_step_on_fake_tensors(name: str) -> None:
    workload = load_workload(name)
    config = dict(workload.config)
    if config[_layers_field(config)] > 2:  # 2 layers keep the suite fast; shapes are per layer
        workload = workload.with_config(num_hidden_layers=2)
    if workload.seq_len is not None:
        workload = workload.with_seq_len(8)
    with FakeTensorMode():
        model = workload.build("sdpa")
        batch = workload.make_batch(1)
        # a mixture of experts routes tokens by values fake tensors do not have: under the
        # tracer's balanced routing (tilefit.tracing.moe), as every trace runs it
        routed = RoutedExperts(BALANCED.counts) if experts_modules(model) else \
            contextlib.nullcontext()
        with routed:
            loss = workload.loss_fn(model, batch)
            loss.backward()
    assert model.training
    params = list(model.parameters())
    assert all(isinstance(p, FakeTensor) and p.dtype == torch.float32 for p in params)
    assert isinstance(loss, FakeTensor) and loss.shape == ()
    # backward reaches every parameter (the loss depends on all of them in these heads)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(p.grad.shape == p.shape for p in params)
    assert model.config._attn_implementation == "sdpa"


def test_attention_choice_reaches_the_model() -> None:
    workload = load_workload("gpt2", seq_len=8).with_config(n_layer=1)
    with FakeTensorMode():
        assert workload.build("eager").config._attn_implementation == "eager"


def test_fake_build_keeps_gpt2_weight_tying() -> None:
    with FakeTensorMode():
        model = load_workload("gpt2").with_config(n_layer=1).build()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_causal_lm_batch() -> None:
    workload = load_workload("gpt2", seq_len=16)
    batch = workload.make_batch(3)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (3, 16) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["input_ids"][0].tolist() == list(range(16))  # deterministic 0, 1, 2, ...
    assert workload.tokens_per_sample == 16


def test_token_ids_stay_in_vocab_and_skip_the_pad_id() -> None:
    # roberta's pad id is 1: position ids count non-pad tokens, so the batch must not contain it.
    ids = load_workload("roberta-base", seq_len=8).make_batch(2)["input_ids"]
    assert ids[0].tolist() == [0, 2, 2, 3, 4, 5, 6, 7]
    tiny_vocab = load_workload("gpt2", seq_len=300).with_config(vocab_size=100)
    ids = tiny_vocab.make_batch(1)["input_ids"]
    assert int(ids.max()) == 99 and ids[0, 100].item() == 0  # 100 mod 100


def test_seq_cls_and_image_batches() -> None:
    cls = load_workload("bert-base-uncased", seq_len=32, task="seq-cls").make_batch(4)
    assert cls["input_ids"].shape == (4, 32) and cls["labels"].shape == (4,)
    image = load_workload("vit-base-patch16-224").make_batch(2)
    assert image["pixel_values"].shape == (2, 3, 224, 224)
    assert image["pixel_values"].dtype == torch.float32 and image["labels"].shape == (2,)


def test_decoder_sequence_classification_with_batch_over_one() -> None:
    # Llama classifiers need a pad id for batches > 1; the build supplies eos as pad.
    workload = load_workload("llama-3-8b", seq_len=8, task="seq-cls").with_config(
        num_hidden_layers=1
    )
    with FakeTensorMode():
        model = workload.build()
        loss = workload.loss_fn(model, workload.make_batch(2))
    assert loss.shape == ()


def test_real_build_is_initialised() -> None:
    # With real tensors the model keeps its own init (std 0.02), so the first loss is close to
    # the uniform-prediction cross-entropy ln(V): ln(1000) = 6.91. Garbage (uninitialised)
    # weights would give nan or a loss far from it.
    workload = load_workload("gpt2", seq_len=16).with_config(
        n_layer=1, n_embd=64, n_head=4, vocab_size=1000
    )
    torch.manual_seed(0)
    model = workload.build("eager")
    loss = workload.loss_fn(model, workload.make_batch(2))
    assert not isinstance(loss, FakeTensor)
    assert abs(loss.item() - math.log(1000)) < 0.5
    loss.backward()
    assert model.transformer.wte.weight.grad is not None


def test_full_llama_3_8b_step_at_its_default_length_on_fake_tensors() -> None:
    # The headline case: all 32 layers, batch 1, seq 2048, nothing allocated.
    workload = load_workload("llama-3-8b")
    assert workload.seq_len == 2048
    with FakeTensorMode():
        model = workload.build()
        batch = workload.make_batch(1)
        logits_loss = workload.loss_fn(model, batch)
        logits_loss.backward()
    assert batch["input_ids"].shape == (1, 2048)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # see test_models_catalog
