"""Fused linear cross-entropy, as Liger Kernel runs it, in plain PyTorch that traces.

A causal LM's loss materialises the logits of every token, (B*S) x V, and usually an fp32
copy and their gradient: with Llama-3's 128k vocabulary that is several GiB, often the step's
peak. Liger Kernel's fused linear cross-entropy (HF ``use_liger_kernel=True``) never holds
them whole: in the forward it walks the tokens in chunks of about B*S*H/V rows, computes a
chunk's logits, overwrites them with their gradient in one Triton kernel (two passes over the
row: its log-sum-exp, then the gradient), and folds the chunk into the input's and the
head's gradients with two GEMMs; the backward only returns those gradients
(docs/references.md, section 17).

``FusedLinearCrossEntropy`` does the same steps with the same tensors, so a fake-tensor trace
of it allocates, reads and writes what Liger's does. The Triton kernel is two custom ops,
``tilefit::ce_logsumexp`` (reads the chunk) and ``tilefit::ce_grad_`` (reads it and writes the
gradient in place); their real implementations work through the chunk a few rows at a time,
so that a real CPU run allocates what the fake one records. It is a model of Liger's memory
and traffic, not Liger (which needs a GPU and Triton).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from tilefit.errors import TilefitError

__all__ = ["FusedLinearCrossEntropy", "chunk_rows", "fused_causal_lm_loss",
           "fused_ce_affine_tokens"]

IGNORE_INDEX = -100
_ROW_BLOCK = 8  # rows the real implementations handle at a time (their only temporaries)


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk: about tokens * hidden / vocab rows, a power of two, at most ``tokens``
    (``inc_factor = cdiv(V, H)``, ``chunk_size = next_power_of_2(cdiv(BT, inc_factor))``)."""
    inc = -(-vocab // hidden)
    rows = -(-tokens // inc)
    return min(1 << (rows - 1).bit_length(), tokens)


def fused_ce_affine_tokens(config: dict[str, Any]) -> int:
    """Tokens from which the chunk count stays near V/H (a chunk of two rows or more): below
    it every token is its own chunk. A Hugging Face config's vocab_size and hidden width."""
    vocab = int(config.get("vocab_size") or 0)
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    return 2 * -(-vocab // hidden) if vocab and hidden else 0


@torch.library.custom_op("tilefit::ce_logsumexp", mutates_args=())
def ce_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp in fp32: the kernel's first pass over the chunk."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, logits.shape[0], _ROW_BLOCK):
        out[i:i + _ROW_BLOCK] = torch.logsumexp(logits[i:i + _ROW_BLOCK].float(), dim=-1)
    return out


@ce_logsumexp.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("tilefit::ce_grad_", mutates_args=("logits",))
def ce_grad_(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
             valid: int) -> torch.Tensor:
    """The kernel's second pass: each row's loss (divided by the ``valid`` tokens, as
    reduction='mean' does), and the logits overwritten by d loss / d logits."""
    loss = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, logits.shape[0], _ROW_BLOCK):
        rows = logits[i:i + _ROW_BLOCK]
        t = target[i:i + _ROW_BLOCK]
        keep = t != IGNORE_INDEX
        probs = (rows.float() - lse[i:i + _ROW_BLOCK, None]).exp_()
        picked = rows.float().gather(1, t.clamp(min=0)[:, None])[:, 0]
        loss[i:i + _ROW_BLOCK] = torch.where(keep, lse[i:i + _ROW_BLOCK] - picked, 0.0) / valid
        probs.scatter_add_(1, t.clamp(min=0)[:, None], -torch.ones_like(probs[:, :1]))
        rows.copy_(probs.mul_(keep[:, None] / valid))
    return loss


@ce_grad_.register_fake
def _(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
      valid: int) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def _accumulate(grad_weight: torch.Tensor, grad_logits_t: torch.Tensor,
                piece: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ piece in the GEMM's epilogue (beta = 1), as Liger does:
    with fp32 weights and 16-bit logits, a 16-bit GEMM that accumulates into fp32
    (``addmm(..., out_dtype=float32)``, CUDA, torch >= 2.8)."""
    if grad_logits_t.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits_t, piece.to(grad_weight.dtype))
    else:
        torch.addmm(grad_weight, grad_logits_t, piece.to(grad_logits_t.dtype),
                    out_dtype=grad_weight.dtype, out=grad_weight)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = cross_entropy(hidden @ weight.T, target), mean over the non-ignored tokens,
    with the gradients computed chunk by chunk in the forward (Liger's algorithm)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                target: torch.Tensor, valid: int) -> torch.Tensor:
        tokens, width = hidden.shape
        rows = chunk_rows(tokens, width, weight.shape[0])
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, rows):
            end = min(start + rows, tokens)
            piece = hidden[start:end]
            logits = piece @ weight.t()  # chunk x V, in the autocast dtype
            lse = torch.ops.tilefit.ce_logsumexp(logits)
            loss[start:end] = torch.ops.tilefit.ce_grad_(logits, target[start:end], lse, valid)
            grad_hidden[start:end] = logits @ weight
            if grad_weight is not None:
                _accumulate(grad_weight, logits.t(), piece)
            del logits, lse
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        # Liger scales the gradients only when the loss's gradient is not 1 (it is 1 for
        # loss.backward(), the scaler's and accumulation's scales aside)
        return grad_hidden, grad_weight, None, None


def fused_causal_lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """A Hugging Face causal LM's loss as Liger's fused linear cross-entropy computes it:
    the base model's last hidden states, the output head's weight, the labels shifted by
    one (padded, as transformers' loss does, so no hidden state is copied). A peft model is
    unwrapped to the transformers model its adapters sit in (``get_base_model``), whose
    forward Liger patches."""
    unwrap = getattr(model, "get_base_model", None)
    if callable(unwrap):
        model = unwrap()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    if head is None or base is None or base is model or "labels" not in batch:
        raise TilefitError(
            "fused linear cross-entropy needs a Hugging Face causal LM with labels",
            expected="a *ForCausalLM model (task causal-lm)", given=type(model).__name__,
            fix="pass Recipe(fused_ce=False) for this model")
    if getattr(head, "bias", None) is not None or \
            getattr(model.config, "final_logit_softcapping", None):
        raise TilefitError(
            "fused linear cross-entropy is modelled for a plain output head",
            expected="no head bias and no final_logit_softcapping",
            given=type(model).__name__, fix="pass Recipe(fused_ce=False) for this model")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = base(**inputs).last_hidden_state
    target = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    valid = int(target.numel() - target.shape[0])  # every position labelled but the last
    return FusedLinearCrossEntropy.apply(flat, head.weight, target.reshape(-1), valid)
