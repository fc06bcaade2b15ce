"""Nothing is skipped silently: a rule whose what-if cannot be traced, and an op whose FLOP
formula fails, leave a note saying what and why (issue 24, item 5)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

torch = pytest.importorskip("torch")

from tilefit.advise import audit  # noqa: E402
from tilefit.advise.rules_dims import dimension_findings  # noqa: E402
from tilefit.advise.whatif import WhatIf  # noqa: E402
from tilefit.errors import TilefitError  # noqa: E402
from tilefit.estimator import estimate, estimate_trace  # noqa: E402
from tilefit.hardware import get_device  # noqa: E402
from tilefit.models import load_workload  # noqa: E402
from tilefit.recipe import Recipe  # noqa: E402
from tilefit.report.audit_terminal import print_audit  # noqa: E402
from tilefit.tracing.workload_traces import trace_workload  # noqa: E402

ADVISE = Path(__file__).resolve().parents[1] / "src" / "tilefit" / "advise"
CANNOT = "Inductor cannot capture [the step]"  # brackets: not rich markup in the report


def test_a_failing_compiled_retrace_is_a_note_naming_the_rule_and_why(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The tiny MLP on an A100 is host-bound (tests/test_audit.py), so both the compile and
    the host-bound rules re-trace it compiled; that re-trace fails here."""
    real = WhatIf._estimate

    def estimate(self: WhatIf, work: Any, recipe: Any, rewrite: Any = ()) -> Any:
        if recipe.compile:
            raise TilefitError(CANNOT, fix="none in this test")
        return real(self, work, recipe, rewrite)

    monkeypatch.setattr(WhatIf, "_estimate", estimate)
    work = load_workload("tests.fixtures.tiny_models:mlp", input_shape=(32,))
    result = audit(work, gpu="a100-80gb", recipe=Recipe(batch_size=8))
    assert result.estimate.host_bound_fraction > 0.3  # the host-bound rule did need it
    assert not [f for f in result.findings if f.rule in ("compile", "host-bound")]
    rule_notes = [n for n in result.notes if "could not be predicted" in n]
    # the error's first line only (its fix line is left out)
    assert rule_notes == [
        f"host-bound: the step replayed as CUDA graphs could not be predicted ({CANNOT})",
        f"compile: the step under torch.compile could not be predicted ({CANNOT})"]
    assert all(n in result.to_dict()["notes"] for n in rule_notes)
    console = Console(record=True, width=400)
    print_audit(console, result)
    shown = console.export_text()
    assert all(f"note: {n}" in shown for n in rule_notes)


def test_a_padded_sequence_that_cannot_be_traced_is_a_note() -> None:
    """GPT-2 (one layer) at batch 2 x seq 100: 200 tokens are off bf16's multiple of 64 on
    an A100, so the rule re-traces at seq 128, which fails here; the vocabulary's fix, a
    rewrite of the trace, still stands."""
    device = get_device("a100-80gb")
    work = load_workload("gpt2", seq_len=100).with_config(num_hidden_layers=1)
    recipe = Recipe(batch_size=2, precision="bf16-mixed")
    tr = trace_workload(work, recipe, device)

    def no_retrace(wk: Any, rc: Recipe) -> Any:
        raise TilefitError(f"sequence length {wk.seq_len} exceeds the model's positions\n"
                           "  fix: a shorter sequence")

    whatif = WhatIf(workload=work, recipe=recipe, device=device, trace=tr,
                    estimate=estimate_trace(tr, device), retrace_fn=no_retrace)
    found = dimension_findings(whatif)
    assert [f.dimension for f in found] == ["vocab_size"]
    assert whatif.notes == ["sequence-length: the step at sequence length 128 could not be "
                            "predicted (sequence length 128 exceeds the model's positions)"]


def test_a_failing_flop_formula_is_a_warning_naming_the_op(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """nn.Linear(16, 8) at batch 4: the forward is addmm (2 x 4 x 16 x 8 = 1024 FLOPs), the
    backward's gradients are mm (1024 FLOPs each). With mm's formula failing, its ops count 0
    FLOPs and the estimate says which op and why."""
    from tilefit.tracing import shapes

    real = shapes.flop_formula

    def formula(func: Any) -> Any:
        if "aten.mm" in str(func):
            def broken(*args: Any, **kwargs: Any) -> int:
                raise ValueError("shapes the formula does not take\nsecond line")
            return broken
        return real(func)

    def linear_estimate() -> Any:
        return estimate(torch.nn.Linear(16, 8), torch.zeros(4, 16),
                        loss_fn=lambda m, b: m(b).sum(), recipe=Recipe(precision="fp32"),
                        gpu="a100-80gb")

    whole = linear_estimate()
    monkeypatch.setattr(shapes, "flop_formula", formula)
    broken = linear_estimate()
    assert not [w for w in whole.warnings if "FLOP formula failed" in w]
    mm = [c.record for c in broken.ops if c.record.op == "aten.mm.default"]
    assert mm and all(r.flops == 0 for r in mm)
    assert all(r.flops_error == "ValueError: shapes the formula does not take" for r in mm)
    assert whole.flops - broken.flops == 1024 * len(mm)
    assert ("ops whose FLOP formula failed, counted as 0 FLOPs (the MFU leaves them out): "
            "aten.mm.default (ValueError: shapes the formula does not take)") in broken.warnings


def _records_a_note(handler: ast.ExceptHandler) -> bool:
    """The handler re-raises or calls something's ``skipped(...)``."""
    for node in ast.walk(handler):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "skipped":
            return True
    return False


def test_no_except_under_advise_drops_a_finding_without_a_note() -> None:
    handlers = [(path.name, node.lineno) for path in sorted(ADVISE.glob("*.py"))
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ExceptHandler) and not _records_a_note(node)]
    assert handlers == []
    # the check sees the handlers there are
    assert any(isinstance(node, ast.ExceptHandler)
               for node in ast.walk(ast.parse((ADVISE / "whatif.py").read_text())))
