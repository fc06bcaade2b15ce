"""tilefit audit: findings traced back to the user's terms, gains re-estimated with the fix
applied, no false alarms, the CLI (terminal, JSON, HTML) and the page in a real browser.

Every trace here is tiny (one layer, short sequences) so the file stays well under a minute.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.conftest import invoke_cli  # noqa: E402

from tilefit.advise import audit  # noqa: E402
from tilefit.advise.origins import nearest_aligned  # noqa: E402
from tilefit.advise.whatif import rewrite_op  # noqa: E402
from tilefit.models import load_workload  # noqa: E402
from tilefit.recipe import Recipe  # noqa: E402
from tilefit.tracing.records import GemmShape, OpRecord  # noqa: E402

A100_BF16_MULTIPLE = 64  # 128-byte rule on A100 / 2-byte bf16 elements


def _dims(a, rule: str = "weight-dim-alignment"):  # type: ignore[no-untyped-def]
    return {f.dimension: f for f in a.findings if f.rule == rule}


@pytest.fixture(scope="module")
def gpt2_tiny():  # type: ignore[no-untyped-def]
    return load_workload("gpt2", seq_len=128).with_config(num_hidden_layers=1)


@pytest.fixture(scope="module")
def gpt2_audit(gpt2_tiny):  # type: ignore[no-untyped-def]
    # batch 8: at batch 2 one layer's step is host-bound on an A100 (the GPU waits for the
    # host's issue), so padding the vocabulary would rightly gain nothing
    return audit(gpt2_tiny, recipe=Recipe(batch_size=8), gpu="a100-80gb", confirm=True)


# ---- the headline: GPT-2's vocabulary -------------------------------------------------------

def test_gpt2_vocab_is_flagged_with_one_fix_for_the_tied_weights(gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    f = _dims(gpt2_audit)["vocab_size"]
    assert f.current == 50257
    # 50257 / 64 = 785.27 -> 786 x 64 = 50304 (nanoGPT's padded vocabulary)
    assert f.suggested == 50304
    assert f.recommended and f.predicted_speedup > 1.01
    assert {"lm_head", "transformer.wte"} <= set(f.modules)  # tied: one finding for both
    assert "resize_token_embeddings" in f.fix and "pad_to_multiple_of=64" in f.fix
    assert "tied" in f.fix
    assert "backward" in f.reason and "forward" in f.reason
    assert f.step_time_after_s < f.step_time_before_s


def test_cheap_rewrite_matches_a_full_retrace(gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    """The what-if rewrites the trace; a second method re-traces the model built with
    vocab_size=50304. They must agree (the rewrite only scales shapes it can see)."""
    c = gpt2_audit.confirmation
    assert c is not None
    assert c.retrace_speedup > 1
    assert c.rewrite_speedup == pytest.approx(c.retrace_speedup, rel=0.01)
    # the re-trace's speedup is the audited step over the re-traced one
    assert c.retrace_speedup == pytest.approx(
        gpt2_audit.estimate.step_time_s / c.retrace_step_time_s)
    assert gpt2_audit.to_dict()["confirmation"] == {
        "rewrite_step_time_s": c.rewrite_step_time_s,
        "retrace_step_time_s": c.retrace_step_time_s,
        "rewrite_speedup": c.rewrite_speedup, "retrace_speedup": c.retrace_speedup}


def test_findings_are_ordered_by_predicted_gain(gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    rec = [f.predicted_speedup for f in gpt2_audit.findings if f.recommended]
    assert rec == sorted(rec, reverse=True)
    flags = [f.recommended for f in gpt2_audit.findings]
    assert flags == sorted(flags, reverse=True)  # recommended before the rest


def test_foreach_adamw_gets_the_fused_finding_with_its_retraced_gain(gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    f = next(f for f in gpt2_audit.findings if f.rule == "fused-optimizer")
    assert (f.current, f.method) == ("adamw", "retrace")
    assert "fused=True" in f.fix and "adamw_torch_fused" in f.fix
    # a second method: the optimizer phase's bytes shrink 80 -> 28 per parameter, and the
    # rest of the step is the same trace, so the step shrinks by (a little more than, with
    # the launches) the optimizer phase's GPU time times 1 - 28/80
    opt_s = sum(c.time_s * c.repeats for c in gpt2_audit.estimate.ops
                if c.record.phase == "optimizer")
    saved_s = f.step_time_before_s - f.step_time_after_s
    assert saved_s == pytest.approx(opt_s * (1 - 28 / 80), rel=0.05)


def test_compile_finding_is_the_retraced_compiled_step(gpt2_tiny, gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    # a second method: estimate the same step compiled directly
    from dataclasses import replace

    from tilefit.estimator.workload_estimate import estimate_workload

    f = next(f for f in gpt2_audit.findings if f.rule == "compile")
    assert f.method == "retrace" and "torch.compile(model)" in f.fix
    assert "torch_compile=True" in f.fix
    direct = estimate_workload(gpt2_tiny, replace(gpt2_audit.recipe, compile=True),
                               "a100-80gb")
    assert f.step_time_after_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert f.peak_memory_after_bytes == direct.peak_memory_bytes
    assert f.step_time_after_s < f.step_time_before_s  # fused elementwise ops are cheaper


def test_compile_finding_for_a_checkpointed_step(gpt2_tiny) -> None:  # type: ignore[no-untyped-def]
    """With gradient checkpointing the compiled re-trace recomputes the checkpointed layer
    as Dynamo's tagged region: the finding is that re-estimate (a second method: the
    same recipe estimated directly), and its fix names the use_cache switch whose warning
    would break Dynamo's graph."""
    from dataclasses import replace

    from tilefit.estimator.workload_estimate import estimate_workload

    a = audit(gpt2_tiny, recipe=Recipe(batch_size=8, grad_checkpointing=True), gpu="a100-80gb",
              confirm=False)
    f = next(f for f in a.findings if f.rule == "compile")
    assert "use_cache = False" in f.fix
    direct = estimate_workload(gpt2_tiny, replace(a.recipe, compile=True), "a100-80gb")
    assert direct.time_by_phase_s.get("recompute", 0.0) == 0.0  # recomputed in the backward
    assert f.step_time_after_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert f.peak_memory_after_bytes == direct.peak_memory_bytes


def test_audit_reuses_traces(gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    # the vocab what-if is a rewrite: re-traces are only the batch screen's pick, the
    # confirmation, the fused-optimizer, fused-loss, fused-activation and compile what-ifs
    # and the fixes combined, never one per finding
    assert gpt2_audit.retraces <= 7
    assert any(f.method == "rewrite" for f in gpt2_audit.findings)


def test_combined_fixes_are_reported_first_and_in_json(gpt2_audit) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console

    from tilefit.report.audit_terminal import print_findings

    c = gpt2_audit.combined
    assert c is not None and len(c.fixes) >= 2
    # compile and CUDA graphs set the compile mode two ways: only the larger gain is applied
    assert not ({"compile", "host-bound"} <= {fix.split(":")[0] for fix in c.fixes})
    assert json.loads(json.dumps(gpt2_audit.to_dict()))["combined"]["fixes"] == list(c.fixes)
    console = Console(record=True, width=200)
    print_findings(console, gpt2_audit)
    first = console.export_text().splitlines()[1]
    assert first.startswith(f"all {len(c.fixes)} fixes together:")
    assert f"({c.predicted_speedup:.2f}x" in first


def _llama(changes: tuple[tuple[str, int], ...]):  # type: ignore[no-untyped-def]
    base = {"num_hidden_layers": 1, "intermediate_size": 1024}
    return load_workload("llama-2-7b", seq_len=64).with_config(**{**base, **dict(changes)})


@functools.cache
def _llama_audit(changes: tuple[tuple[str, int], ...]):  # type: ignore[no-untyped-def]
    return audit(_llama(changes), recipe=Recipe(batch_size=2))


def _whatif(work, **recipe):  # type: ignore[no-untyped-def]
    """The step audit(work, **recipe) traces (the old keywords' Recipe on the default GPU),
    as the audit's rules see it."""
    from tilefit.advise.whatif import WhatIf
    from tilefit.estimator import estimate_trace
    from tilefit.hardware import get_device
    from tilefit.recipe import DEFAULT_GPU, Recipe
    from tilefit.tracing.workload_traces import trace_workload

    device = get_device(DEFAULT_GPU)
    step = Recipe(**recipe).on(device)
    tr = trace_workload(work, step, device)
    return WhatIf(work, step, device, tr, estimate_trace(tr, device),
                  lambda w, r: trace_workload(w, r, device))


def _rule_findings(work, *rules, **recipe):  # type: ignore[no-untyped-def]
    """Some of the audit's rules alone on that step: their own re-traces where their fixes
    need them, not every other rule's what-ifs (the whole audit's own tests are the
    gpt2_audit ones)."""
    from tilefit.advise.audit import RULES

    assert set(rules) <= set(RULES)
    whatif = _whatif(work, **recipe)
    return [f for rule in rules for f in rule(whatif)]


@functools.cache
def _llama_dims(changes: tuple[tuple[str, int], ...]):  # type: ignore[no-untyped-def]
    from tilefit.advise.rules_dims import dimension_findings

    return {f.dimension: f for f in _rule_findings(_llama(changes), dimension_findings,
                                                   batch_size=2)
            if f.rule == "weight-dim-alignment"}


# ---- held-in configs: the suggestion is the nearest aligned value ---------------------------

@pytest.mark.parametrize(
    ("changes", "dimension", "current", "suggested"),
    [
        # 5003 is odd; 79 x 64 = 5056 is the first multiple of 64 above it
        ({"intermediate_size": 5003}, "intermediate_size", 5003, 5056),
        # 32001 (a pad token added to Llama's 32000): 501 x 64 = 32064
        ({"vocab_size": 32001}, "vocab_size", 32001, 32064),
        # 20 heads x 70 = 1400: a hidden size must stay divisible by 20 heads and be a
        # multiple of 64: lcm(64, 20) = 320, 5 x 320 = 1600
        ({"hidden_size": 1400, "num_attention_heads": 20, "num_key_value_heads": 20},
         "hidden_size", 1400, 1600),
        # same config: head_dim 70 is no multiple of 8 (flash rejects it): 72
        ({"hidden_size": 1400, "num_attention_heads": 20, "num_key_value_heads": 20},
         "head_dim", 70, 72),
    ],
)
def test_held_in_configs_get_the_nearest_aligned_value(changes, dimension, current,  # type: ignore[no-untyped-def]
                                                       suggested) -> None:
    found = _llama_dims(tuple(sorted(changes.items())))
    assert dimension in found, sorted(found)
    assert found[dimension].current == current
    assert found[dimension].suggested == suggested


def test_head_dim_off_8_falls_back_to_the_math_kernel() -> None:
    a = _llama_audit((("hidden_size", 1400), ("num_attention_heads", 20),
                      ("num_key_value_heads", 20)))
    att = next(f for f in a.findings if f.rule == "attention-kernel")
    assert "head_dim 70" in att.reason and att.current == "math"
    # the head_dim fix (70 -> 72) is re-traced: attention then runs the flash kernel
    fix = _dims(a)["head_dim"]
    assert fix.method == "retrace" and fix.recommended


def test_nearest_aligned_by_hand() -> None:
    assert nearest_aligned(50257, 64) == 50304
    assert nearest_aligned(1400, 64, 20) == 1600
    assert nearest_aligned(4096, 64) == 4096


# ---- no false alarms ------------------------------------------------------------------------

def test_aligned_published_config_raises_no_dimension_alarm() -> None:
    # Llama-2-7B: vocab 32000 = 500 x 64, intermediate 11008 = 172 x 64, hidden 4096 = 64 x 64,
    # head_dim 128; batch 2 x seq 64 = 128 tokens = 2 x 64
    from tilefit.advise.rules_dims import dimension_findings  # the rule of both

    work = load_workload("llama-2-7b", seq_len=64).with_config(num_hidden_layers=1)
    found = _rule_findings(work, dimension_findings, batch_size=2)
    assert not [f for f in found if f.rule in ("weight-dim-alignment", "sequence-length")]


def test_padding_a_tiny_classifier_is_not_recommended() -> None:
    """10 labels padded to 64 on a (batch x 768) @ (768 x 10) GEMM: the GEMM is launch-bound,
    the padding only adds bytes, so the re-estimate shows no gain."""
    from tilefit.advise.rules_dims import dimension_findings

    work = load_workload("bert-base-uncased", seq_len=64, task="seq-cls").with_config(
        num_hidden_layers=1, num_labels=10)
    found = _rule_findings(work, dimension_findings, batch_size=8)
    labels = [f for f in found if f.dimension == "num_labels"]
    for f in labels:
        assert not f.recommended and f.predicted_speedup < 1.005
    assert not [f for f in found if f.recommended and f.rule == "weight-dim-alignment"]


def test_sequence_length_off_the_multiple_is_padded(gpt2_tiny) -> None:  # type: ignore[no-untyped-def]
    # batch 2 x seq 100 = 200 tokens, 200 % 64 = 8: pad the sequence to 64's multiple, 128
    from tilefit.advise.rules_dims import dimension_findings

    work = gpt2_tiny.with_seq_len(100)
    f = next(f for f in _rule_findings(work, dimension_findings, batch_size=2)
             if f.rule == "sequence-length")
    assert f.current == 100 and f.suggested == 128
    assert "pad_to_multiple_of=64" in f.fix and f.method == "retrace"


# ---- the other rules ------------------------------------------------------------------------

def test_fp32_step_gets_tf32_and_autocast_findings(gpt2_tiny) -> None:  # type: ignore[no-untyped-def]
    from tilefit.advise.rules_precision import attention_findings, precision_findings

    found = _rule_findings(gpt2_tiny, precision_findings, attention_findings, batch_size=2,
                           precision="fp32")
    prec = {f.suggested: f for f in found if f.rule == "fp32-gemms"}
    assert {"tf32", "bf16-mixed"} <= set(prec)
    # the GEMMs go from fp32 (19.5 TFLOP/s) to TF32 Tensor Cores (156): the step must gain
    assert prec["tf32"].recommended and prec["tf32"].predicted_speedup > 1.1
    assert "allow_tf32" in prec["tf32"].fix
    # fp32 attention runs the memory-efficient kernel (head_dim 64 % 4 == 0), not math
    assert not [f for f in found if f.rule == "attention-kernel"]


def test_small_batch_memory_bound_gemms(gpt2_tiny) -> None:  # type: ignore[no-untyped-def]
    """Batch 1 x seq 128: 128-token GEMMs are memory-bound on an A100. Independently of
    tilefit.gemm: intensity = 2MNK / (2 bytes x (MK + KN + MN)) against the A100's bf16
    FLOP/byte (312e12 / 2.039e12 = 153); the finding's batch is the first doubling at which
    every token GEMM of the trace reaches it."""
    from tilefit.advise.audit import RULES
    from tilefit.advise.rules_batch import memory_bound_findings

    assert memory_bound_findings in RULES
    whatif = _whatif(gpt2_tiny, batch_size=1)
    f = next(f for f in memory_bound_findings(whatif) if f.rule == "small-batch")
    ridge = 312e12 / 2.039e12
    shapes = {(g.m, g.n, g.k) for c in whatif.estimate.ops if c.record.kind == "gemm"
              for g in c.record.gemms if 128 in (g.m, g.n, g.k)}

    def intensity(m: int, n: int, k: int) -> float:
        return 2 * m * n * k / (2 * (m * k + k * n + m * n))

    for b in (2, 4, 8, 16, 32, 64):
        scaled = [tuple(128 * b if d == 128 else d for d in s) for s in shapes]
        if all(intensity(*s) >= ridge for s in scaled):
            break
    assert f.suggested == b
    assert f.per_sample and "fit" in f.reason


def test_step_that_does_not_fit_gets_candidates_that_fit() -> None:
    work = load_workload("gpt2", seq_len=1024).with_config(num_hidden_layers=1)
    a = audit(work, recipe=Recipe(batch_size=32), gpu="t4")
    assert not a.estimate.fits
    rules = {f.rule: f for f in a.findings}
    assert {"does-not-fit", "optimizer-memory", "activation-memory"} <= set(rules)
    half = rules["does-not-fit"]
    assert half.suggested == 16 and "gradient_accumulation_steps=2" in half.fix
    # halving the micro-batch halves the activations: the peak must drop by a lot
    assert half.peak_memory_after_bytes < 0.75 * half.peak_memory_before_bytes
    assert half.recommended


def test_plain_module_names_its_layers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4000), torch.nn.ReLU(),
                                torch.nn.Linear(4000, 1024))
    a = audit(model, torch.zeros(512, 1024))
    found = _dims(a)
    assert "out_features" in found or "in_features" in found
    f = found.get("out_features") or found["in_features"]
    assert f.current == 4000 and f.suggested == 4032  # 63 x 64
    # both layers that hold the width change: the one that makes it and the one that takes it
    assert "0: nn.Linear(1024, 4032)" in f.fix and "2: nn.Linear(4032, 1024)" in f.fix
    assert a.notes  # stand-in loss, no re-traces


def test_a_model_that_cannot_be_traced_is_a_clear_error() -> None:
    from tilefit.errors import TilefitError

    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(10, 10)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.fc(x).view(3, -1, 7)  # 80 elements cannot be viewed as 3 x ? x 7

    with pytest.raises(TilefitError, match="one training step of the model failed") as err:
        audit(Broken(), torch.zeros(8, 10))
    assert "input" in err.value.fix
    # where the error was raised: the model's own line (this file), not torch's or tilefit's
    assert "raised at tests/test_audit.py:" in err.value.given


# ---- the trace rewrite by hand ---------------------------------------------------------------

def test_rewrite_op_scales_shapes_bytes_and_flops() -> None:
    op = OpRecord(op="aten.mm.default", phase="forward", module="lm_head",
                  input_shapes=((8192, 768), (768, 50257)), output_shapes=((8192, 50257),),
                  dtype="bfloat16", flops=2 * 8192 * 50257 * 768, bytes=2 * (8192 * 768 + 768 *
                  50257 + 8192 * 50257), kind="gemm", step=1, micro=0,
                  gemms=(GemmShape(1, 8192, 50257, 768, "bf16"),))
    new = rewrite_op(op, 50257, 50304)
    assert new.gemms[0].n == 50304 and new.gemms[0].m == 8192
    assert new.output_shapes == ((8192, 50304),)
    assert new.flops == 2 * 8192 * 50304 * 768
    assert new.bytes == 2 * (8192 * 768 + 768 * 50304 + 8192 * 50304)
    untouched = OpRecord("aten.add.Tensor", "forward", "x", ((4, 4),), ((4, 4),), "float32",
                         16, 96, "memory", 1, 0)
    assert rewrite_op(untouched, 50257, 50304) is untouched


# ---- CLI --------------------------------------------------------------------------------------

def _tiny_gpt2_config(tmp_path: Path) -> Path:
    cfg = json.loads((Path(__file__).parents[1] / "src/tilefit/models/configs/gpt2.json")
                     .read_text())
    cfg["n_layer"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_cli_json_and_html(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    page = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["audit", str(_tiny_gpt2_config(tmp_path)), "--seq", "128",
                                   "--batch", "8", "--json", "--html", str(page)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["gpu"] == "a100-80gb"
    assert {"step_time_s", "peak_memory_bytes", "memory_breakdown"} <= set(data["estimate"])
    vocab = next(f for f in data["findings"] if f["dimension"] == "vocab_size")
    assert vocab["suggested"] == 50304 and vocab["predicted_speedup"] > 1
    assert {"rule", "severity", "modules", "current", "fix", "reason"} <= set(vocab)
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 3  # roofline, modules, memory
    assert "resize_token_embeddings" in text and "http" not in text.split("<body>")[1]


def test_cli_terminal_report(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    res = CliRunner().invoke(app, ["audit", str(_tiny_gpt2_config(tmp_path)), "--seq", "128",
                                   "--batch", "2"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "vocab_size 50257 -> 50304" in out
    assert "time by module" in out and "step time" in out
    # each fix, code to copy, is one line even 80 columns wide (CliRunner is no terminal):
    # the line after it is the finding's reason
    lines = res.stdout.splitlines()
    fixes = [i for i, line in enumerate(lines) if line.startswith("   fix: ")]
    assert fixes and max(len(lines[i]) for i in fixes) > 80
    assert all(lines[i + 1].startswith("   why: ") for i in fixes)
    # the loop the trace assumed, on stderr as `tilefit estimate` prints it: the Trainer's
    # defaults for a Hugging Face model (Recipe.for_model)
    err = " ".join(res.stderr.split())
    assert "note: the training loop as assumed: gradients clipped at 1.0" in err
    assert "the loss read each micro-batch" in err
    # in the command line's words: the flags that change it, not the Recipe fields
    assert "--max-grad-norm NORM, --optimizer OPTIMIZER and --loss-sync change them" in err


@pytest.mark.parametrize(("args", "messages", "fresh"), [
    (["audit", "gtp2"], ["did you mean", "gpt2"], True),
    (["audit", "gpt2", "--gpu", "auto"], ["--gpu"], False),
    (["audit", "gpt2", "--html", "/no/such/dir/report.html"], ["does not exist"], False),
])
def test_cli_bad_input_exits_2(cli, args, messages, fresh) -> None:  # type: ignore[no-untyped-def]
    # one case through the real entry point in a fresh interpreter; the others in this
    # process (the same app, ~8 s of imports less each)
    proc = cli(*args) if fresh else invoke_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = " ".join(proc.stderr.split())
    for m in messages:
        assert m in err
    assert "Traceback" not in proc.stderr


# ---- the page in a real browser -------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: "
                    "apt-get install -y chromium); the HTML report's browser check needs it")
def test_html_report_renders_in_headless_chromium(gpt2_audit, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from matplotlib.image import imread

    from tilefit.report.html import write_html

    page = write_html(gpt2_audit, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1200,2000", page.resolve().as_uri()],
                   capture_output=True, timeout=120, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1200)
    # a blank page has zero variance; text, coloured finding bars and plots give plenty
    assert float(pixels.var()) > 0.01
    # the top of the page is not all white: the title and summary rendered
    assert float(pixels[:400].mean()) < 0.99
    assert not math.isnan(float(pixels.mean()))


def test_a_host_bound_step_gets_a_cuda_graph_finding() -> None:
    """A tiny MLP (32 -> 64 -> 10, batch 8) on an A100: microseconds of GPU work, hundreds of
    microseconds of host time. The finding's 'after' is the step re-traced with
    torch.compile(mode="reduce-overhead"): the forward and backward replayed as CUDA graphs
    (tilefit.estimator.cudagraphs), the optimizer step still eager."""
    import dataclasses

    from tilefit.advise import audit
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload

    model = "tests.fixtures.tiny_models:mlp"
    work = load_workload(model, input_shape=(32,))
    result = audit(work, gpu="a100-80gb", recipe=Recipe(batch_size=8))
    est = result.estimate
    assert est.host_bound_fraction > 0.3
    (finding,) = [f for f in result.findings if f.rule == "host-bound"]
    after = estimate_workload(
        work,
        dataclasses.replace(result.recipe, compile="reduce-overhead"),
        result.device)
    assert finding.step_time_after_s == pytest.approx(after.step_time_s, rel=1e-9)
    assert finding.peak_memory_after_bytes == after.peak_memory_bytes
    assert finding.predicted_speedup == pytest.approx(est.step_time_s / after.step_time_s,
                                                      rel=1e-9)
    assert 'mode="reduce-overhead"' in finding.fix and finding.method == "retrace"


def test_a_device_bound_step_has_no_host_finding() -> None:
    """Full GPT-2 at batch 8 x 1024 on an A100 keeps the GPU busy: the host rule, run on the
    step's own trace, finds nothing (the whole audit of it is the slowest of the suite, and
    each other rule has its own test)."""
    from tilefit.advise.rules_host import MIN_HOST_BOUND_FRACTION, host_findings
    from tilefit.advise.whatif import WhatIf
    from tilefit.estimator import estimate_trace
    from tilefit.hardware import get_device
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    work = load_workload("gpt2", seq_len=1024)
    device = get_device("a100-80gb")
    recipe = Recipe.for_model(work, batch_size=8).on(device)
    tr = trace_workload(work, recipe, device)
    est = estimate_trace(tr, device)
    assert est.host_bound_fraction < MIN_HOST_BOUND_FRACTION == 0.10
    assert host_findings(WhatIf(work, recipe, device, tr, est)) == []
