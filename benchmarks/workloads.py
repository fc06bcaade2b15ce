"""Small, varied training workloads shared by the memory and speed benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    optimizer_name: str
    grad_checkpointing: bool = False


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.LayerNorm(2048), nn.Linear(2048, 100))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def gpt2_like() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=5000,
                                      n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0,
                                      embd_pdrop=0.0))


def bert_like() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=256,
                                      num_attention_heads=4, intermediate_size=1024,
                                      vocab_size=5000, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def llama_like() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=256,
                                        intermediate_size=688, num_attention_heads=8,
                                        num_key_value_heads=2, vocab_size=5000,
                                        max_position_embeddings=512))


def _tokens(b: int, s: int, vocab: int = 5000) -> dict[str, torch.Tensor]:
    ids = torch.arange(b * s).reshape(b, s) % vocab
    return {"input_ids": ids, "labels": ids.clone()}


def _sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=False)


def _adam(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=1e-4, foreach=False)


def _adamw_foreach(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-4, foreach=True)


def _adamw_loop(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-4, foreach=False)


CASES: tuple[Case, ...] = (
    Case("mlp / sgd-momentum", mlp, lambda: (torch.randn(64, 512), torch.randint(0, 100, (64,))),
         _ce, _sgd, "sgd-momentum"),
    Case("cnn+batchnorm / adam", cnn,
         lambda: (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))), _ce, _adam, "adam"),
    Case("gpt2-like / adamw foreach", gpt2_like, lambda: _tokens(4, 128), _hf_loss,
         _adamw_foreach, "adamw-foreach"),
    Case("bert-like / adamw for-loop", bert_like, lambda: _tokens(4, 128), _hf_loss,
         _adamw_loop, "adamw-for-loop"),
    Case("llama-like swiglu rope gqa / adamw foreach", llama_like, lambda: _tokens(2, 128),
         _hf_loss, _adamw_foreach, "adamw-foreach"),
    Case("llama-like + grad checkpointing / adamw for-loop", llama_like, lambda: _tokens(2, 128),
         _hf_loss, _adamw_loop, "adamw-for-loop", grad_checkpointing=True),
)
