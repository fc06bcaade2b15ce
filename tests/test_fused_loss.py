"""Fused linear cross-entropy (Liger Kernel's algorithm, tilefit.models.fused_loss): its
chunks, its math against torch's cross-entropy, its traced memory against a real run, and the
audit's finding (docs/references.md, section 17)."""

from __future__ import annotations

import pytest
import torch

from tilefit.bench.step import measure_step
from tilefit.errors import TilefitError
from tilefit.estimator.workload_estimate import estimate_workload
from tilefit.models import load_workload
from tilefit.models.fused_loss import FusedLinearCrossEntropy, chunk_rows
from tilefit.recipe import Recipe


@pytest.mark.parametrize(("tokens", "hidden", "vocab", "rows"), [
    (8192, 768, 50257, 128),  # cdiv(50257, 768) = 66; cdiv(8192, 66) = 125 -> 128
    (8192, 2048, 128256, 256),  # 63; 131 -> 256
    (100, 4096, 32000, 16),  # 8; 13 -> 16
    (10, 4096, 4096, 10),  # 1; 10 -> 16, capped at the 10 tokens
])
def test_chunk_rows_follow_ligers_rule(tokens: int, hidden: int, vocab: int, rows: int) -> None:
    assert chunk_rows(tokens, hidden, vocab) == rows


def test_loss_and_gradients_equal_torchs_cross_entropy() -> None:
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[5] = -100  # an ignored token
    loss = FusedLinearCrossEntropy.apply(h, w, t, int((t != -100).sum()))
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h2 @ w2.t(), t)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(h.grad, h2.grad, atol=1e-6)
    assert torch.allclose(w.grad, w2.grad, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_lm():  # type: ignore[no-untyped-def]
    return load_workload("gpt2", seq_len=64).with_config(
        num_hidden_layers=1, n_embd=64, n_head=2, vocab_size=4000)


def test_traced_peak_matches_a_real_cpu_step(tiny_lm) -> None:  # type: ignore[no-untyped-def]
    # a second method: PyTorch's MemTracker on a real CPU step of the same fused loss
    recipe = Recipe(batch_size=2, precision="fp32", optimizer="adamw", fused_ce=True)
    predicted = estimate_workload(tiny_lm, recipe, "cpu").peak_memory_bytes
    measured = measure_step(tiny_lm, recipe, "cpu", steps=1, warmup=2).peak_memory_bytes
    assert predicted == pytest.approx(measured, rel=0.02)


def test_fused_loss_saves_the_logits(tiny_lm) -> None:  # type: ignore[no-untyped-def]
    plain = estimate_workload(tiny_lm, Recipe(batch_size=8, precision="fp32"), "cpu")
    fused = estimate_workload(tiny_lm, Recipe(batch_size=8, precision="fp32", fused_ce=True),
                              "cpu")
    logits = 8 * 64 * 4000 * 4  # one fp32 copy of (B*S) x V
    saved = plain.peak_memory_bytes - fused.peak_memory_bytes
    assert saved >= logits  # the eager loss holds at least the logits whole


def test_other_tasks_are_refused() -> None:
    work = load_workload("bert-base-uncased", seq_len=32).with_config(num_hidden_layers=1)
    with pytest.raises(TilefitError, match="causal LM"):
        estimate_workload(work, Recipe(batch_size=1, precision="fp32", fused_ce=True), "cpu")
