"""The HTML renderings. The audit's page: the GPU's capacity drawn on the memory chart, the
fit verdict in colour, the host/GPU timeline and the assumed training loop, and a
non-recommended finding's reason. Each result's notebook view (``_repr_html_``): HTML that
parses, with the result's key figures. One tiny GPT-2 step (one layer, hidden 64, 32 tokens)
is traced and estimated once; the Audit, Plan, TuneResult and NoiseScale are built by hand
around known figures (the code that makes them is tested in tests/test_audit*.py,
test_plan*.py, test_tasks.py and test_noise_scale.py), so what is shown is known."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

import tilefit
from tilefit.advise import Audit, Finding


class _Page(HTMLParser):
    """The text of each element with a class, by class name (nested text included)."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[str, list[str]]] = []
        self.text: dict[str, list[str]] = {}
        self.seconds: list[float] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("data-seconds"):
            self.seconds.append(float(a["data-seconds"] or 0))
        if tag in ("img", "meta", "br"):
            return
        self.open.append((tag, (a.get("class") or "").split()))

    def handle_endtag(self, tag: str) -> None:
        if self.open:
            self.open.pop()

    def handle_data(self, data: str) -> None:
        for _, classes in self.open:
            for c in classes:
                self.text.setdefault(c, []).append(data)

    def of(self, cls: str) -> list[str]:
        return self.text.get(cls, [])


def _parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    p.close()
    return p


@pytest.fixture(scope="module")
def step():  # type: ignore[no-untyped-def]
    from tilefit.models import load_workload

    work = load_workload("gpt2", seq_len=32).with_config(num_hidden_layers=1, n_embd=64,
                                                          n_head=2)
    recipe = tilefit.Recipe.for_model(work, batch_size=4)
    device = tilefit.get_device("a100-80gb")
    tr = tilefit.trace(work, recipe=recipe, gpu=device)
    return recipe, tilefit.estimate_trace(tr, device), tr


def _finding(**kw: Any) -> Finding:
    base: dict[str, Any] = dict(
        rule="fused-optimizer", severity="low", title="use the fused AdamW", modules=(),
        dimension=None, current=None, suggested=None, fix="AdamW(fused=True)",
        reason="one kernel per step", step_time_before_s=2e-3, step_time_after_s=1e-3,
        method="retrace")
    return Finding(**{**base, **kw})


@pytest.fixture(scope="module")
def audited(step):  # type: ignore[no-untyped-def]
    recipe, est, _ = step
    # slower after the fix: not recommended, 2 ms -> 4 ms is 0.500x
    slower = _finding(rule="compile", title="compile the step", step_time_after_s=4e-3,
                      recommended=False)
    return Audit(model="gpt2-tiny", device=est.device, recipe=recipe, seq_len=32,
                 estimate=est, findings=(_finding(), slower), retraces=0, elapsed_s=0.0)


def test_the_memory_chart_draws_the_gpus_capacity_as_a_labelled_line(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import memory_chart, render_html

    # the A100 80GB's catalog memory: 80 GiB = 85,899,345,920 bytes
    assert audited.estimate.device.memory_bytes == 80 * 1024**3
    fig = memory_chart(audited.estimate)
    ax = fig.axes[0]
    flat = [line for line in ax.get_lines() if len(set(line.get_ydata())) == 1]
    assert [float(line.get_ydata()[0]) for line in flat] == [80.0]
    labels = [t.get_text() for t in ax.texts]
    assert "a100-80gb capacity: 80.00 GiB" in labels
    # the stacked column adds up to the tensors' peak plus context and workspace
    est = audited.estimate
    heights = sum(p.get_height() for p in ax.patches[:-1] if p.get_x() < 0.5)
    assert heights == pytest.approx(est.total_memory_bytes / 1024**3, rel=1e-9)
    import matplotlib.pyplot as plt

    plt.close(fig)
    page = render_html(audited)
    assert "a100-80gb capacity: 80.00 GiB" in "".join(_parse(page).of("capacity"))


def _verdict(page: str) -> list[tuple[str, ...]]:
    return re.findall(r'<span class="verdict (\w+)" style="color:#fff;background:(#\w+);'
                      r'[^"]*">([^<]*)</span>', page)


def test_the_verdict_is_green_when_it_fits_and_red_when_not(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import render_html

    est = audited.estimate
    assert est.fits
    page = render_html(audited)
    assert set(_verdict(page)) == {("fits", "#1b7f3b", "fits")}  # green
    # one byte past the device: the same step does not fit
    over = est.device.memory_bytes - est.overhead_bytes + 1
    big = dataclasses.replace(est, peak_memory_bytes=over)
    assert not big.fits
    page = render_html(dataclasses.replace(audited, estimate=big))
    assert set(_verdict(page)) == {("nofit", "#c62828", "DOES NOT FIT")}  # red
    assert '80.00 GiB of 80.00 GiB: <span class="verdict nofit"' in page


def test_the_timeline_gives_the_estimates_host_and_gpu_times(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import render_html
    from tilefit.report.terminal import fmt_time

    est = audited.estimate
    page = render_html(audited)
    section = page.split("<h2>Host and GPU</h2>")[1].split("<h2>")[0]
    assert _parse(section).seconds == [est.host_time_s, est.device_time_s, est.step_time_s]
    assert fmt_time(est.host_time_s) in section and fmt_time(est.device_time_s) in section
    assert f"{est.host_bound_fraction:.0%} of the step" in section
    # the tiny step is launch-bound: the host issues for longer than the GPU runs
    assert est.host_time_s > 2 * est.device_time_s
    assert "host-bound" in "".join(_parse(section).of("hostbound"))


def test_the_page_states_the_assumed_training_loop(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import render_html

    page = render_html(audited)
    section = page.split("<h2>Assumed training loop</h2>")[1].split("<h2>")[0]
    # the Trainer's loop (Recipe.for_model of a Hugging Face model): clipping at 1.0, the
    # fused AdamW, the loss read each micro-batch
    assert audited.recipe.max_grad_norm == 1.0 and audited.recipe.loss_sync
    assert "gradients clipped at 1.0" in section and "the loss read each micro-batch" in section


def test_a_finding_not_recommended_shows_why(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import render_html

    page = render_html(audited)
    assert "[not recommended]" not in page
    blocks = _parse(page).of("finding")
    text = " ".join(blocks)
    assert "[slower: 0.500x]" in text  # 2 ms before, 4 ms after
    assert "[low]" in text  # the recommended one keeps its severity


def _way_forward_plan(device: Any, overhead: int) -> Any:
    """A plan whose best row is known: bf16 autocast, checkpointing, micro-batch 2 x 4
    accumulation steps, 12.5 ms and 3 GiB of a 70 GiB budget; its configs the planner's own
    for that row (tested in tests/test_plan*.py)."""
    from tilefit.planner import Plan
    from tilefit.planner.configs import single_gpu_configs
    from tilefit.planner.rows import PlanRow

    budget = 70 * 1024**3
    row = PlanRow(recipe=tilefit.Recipe(batch_size=2, accumulation_steps=4,
                                        precision="bf16-mixed", grad_checkpointing=True),
                  predicted_peak_memory_bytes=3 * 1024**3, predicted_step_time_s=0.0125,
                  samples_per_s=640.0, tokens_per_s=None, mfu=0.4, budget_bytes=budget)
    return Plan(model="gpt2-tiny", device=device, global_batch=8, seq_len=32,
                objective="samples-per-s", memory_fraction=0.9, budget_bytes=budget,
                overhead_bytes=overhead, rows=(row,), best=row, reason="the fastest that fits",
                confirmation=None, configs=single_gpu_configs(row, "causal-lm"),
                multi_gpu=None)


def test_the_way_forward_sits_under_the_verdict_with_its_configs(audited) -> None:  # type: ignore[no-untyped-def]
    import html as html_lib

    from tilefit.report.html import render_html

    est = audited.estimate
    assert "Way forward" not in render_html(audited)  # the step fits: no plan
    big = dataclasses.replace(est, peak_memory_bytes=est.device.memory_bytes)
    plan = _way_forward_plan(est.device, est.overhead_bytes)
    page = render_html(dataclasses.replace(audited, estimate=big, plan=plan))
    verdict, forward, findings = (page.index('class="verdict nofit"'),
                                  page.index("<h2>Way forward"), page.index("<h2>Findings"))
    assert verdict < forward < findings  # right under the summary's verdict
    text = " ".join(_parse(page).of("wayforward"))
    assert "bf16-mixed adamw ckpt" in text  # the row's label: precision, optimizer, ckpt
    assert "micro-batch 2 x 4 accumulation steps = global batch 8" in text
    assert "12.50 ms, 640.00 samples/s, MFU 40%" in text
    assert "3.00 GiB of 70.00 GiB budget" in text
    pres = re.findall(r"<pre>(.*?)</pre>", page, re.S)
    cfg = plan.configs
    assert html_lib.unescape(pres[0]) == cfg["hf_python"]  # escaped, and nothing lost
    assert html_lib.unescape(pres[1]) == cfg["hf_training_arguments_json"]
    assert '"' not in pres[1] and "&quot;gradient_accumulation_steps&quot;: 4" in pres[1]
    assert cfg["hf_training_arguments"]["per_device_train_batch_size"] == 2
    nothing = dataclasses.replace(plan, best=None, rows=(), reason="no recipe fits one GPU")
    page = render_html(dataclasses.replace(audited, estimate=big, plan=nothing))
    assert "no recipe fits one GPU" in " ".join(_parse(page).of("wayforward"))
    assert "<pre>" not in page


def _combined() -> Any:
    """Two fixes together: 2 ms for 4 samples before, 2.5 ms for 8 after (a batch fix), so
    0.5 ms against 0.3125 ms a sample: 1.60x per sample; one fix left out."""
    from tilefit.advise.combined import CombinedFix
    from tilefit.advise.findings import Change

    return CombinedFix(fixes=("fused-optimizer: optimizer adamw -> adamw (fused)",
                              "batch: batch_size 4 -> 8"),
                       left_out=("batch: batch_size 4 -> 16",), change=Change(),
                       step_time_before_s=2e-3, step_time_after_s=2.5e-3, samples_before=4,
                       samples_after=8, peak_memory_before_bytes=2**30,
                       peak_memory_after_bytes=2**31, fits=True)


def test_the_page_shows_the_fixes_together(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import render_html

    assert "fixes together" not in render_html(audited)
    page = render_html(dataclasses.replace(audited, combined=_combined()))
    text = " ".join(_parse(page).of("combined"))
    assert "all 2 fixes together: 2.00 ms -> 2.50 ms per step (1.60x per sample)" in text
    assert "optimizer adamw -&gt; adamw (fused)" in page  # escaped in the page's source
    assert "fixes: fused-optimizer: optimizer adamw -> adamw (fused); batch: batch_size 4 -> 8" \
        in text
    assert "batch: batch_size 4 -> 16" in text and "left out" in text
    # above the single findings, as the terminal prints it
    assert page.index('class="combined"') < page.index('class="finding')


# ---- the notebook views: _repr_html_ ----------------------------------------------------

class _Balanced(HTMLParser):
    """Fails on a closing tag that closes no open one; ``open`` is what is left unclosed."""

    VOID = frozenset({"br", "img", "meta", "hr", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open.pop() == tag, f"</{tag}> closes nothing open"

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _shown(result: Any) -> str:
    """The text a notebook shows for ``result``, once its HTML is known to be balanced."""
    fragment = result._repr_html_()
    assert isinstance(fragment, str) and fragment.startswith('<div class="tilefit">')
    assert "<script" not in fragment and "<style" not in fragment
    p = _Balanced()
    p.feed(fragment)
    p.close()
    assert p.open == []
    return " ".join(" ".join(p.text).split())


def test_the_estimate_and_trace_show_their_key_figures(step) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.terminal import fmt_time

    _, est, tr = step
    text = _shown(est)
    assert f"step time {fmt_time(est.step_time_s)}" in text
    assert "fits" in text and "DOES NOT FIT" not in text
    # one layer, hidden 64, GPT-2's vocabulary: 50257 x 64 (tied) + 1024 x 64 positions
    # + one block's 12 x 64^2 + 13 x 64 + the final LayerNorm's 2 x 64 = 3,332,096
    assert tr.param_count == 50257 * 64 + 1024 * 64 + 12 * 64**2 + 13 * 64 + 2 * 64
    text = _shown(tr)
    assert "3,332,096" in text and f"ops recorded {len(tr.ops):,}" in text
    assert "4 samples, 128 tokens" in text  # batch 4 x 32 tokens


def test_the_audit_shows_its_findings_and_why_one_is_not_recommended(audited) -> None:  # type: ignore[no-untyped-def]
    text = _shown(audited)
    assert "1 fix(es) recommended" in text
    assert "[slower: 0.500x]" in text and "2.000x (2.00 ms -> 1.00 ms per step)" in text
    assert "combined" not in text
    text = _shown(dataclasses.replace(audited, combined=_combined()))
    assert "combined all 2 fixes together: 2.00 ms -> 2.50 ms per step (1.60x per sample): " \
        "fused-optimizer: optimizer adamw -> adamw (fused); batch: batch_size 4 -> 8" in text
    assert "left out (each conflicts with a fix of larger gain): batch: batch_size 4 -> 16" \
        in text


def test_the_plan_shows_the_chosen_recipe(step) -> None:  # type: ignore[no-untyped-def]
    from tilefit.planner import Plan
    from tilefit.planner.rows import PlanRow

    _, est, _ = step
    budget = 70 * 1024**3
    row = PlanRow(recipe=tilefit.Recipe(batch_size=4, accumulation_steps=2),
                  predicted_peak_memory_bytes=3 * 1024**3, predicted_step_time_s=0.0125,
                  samples_per_s=640.0, tokens_per_s=None, mfu=0.4, budget_bytes=budget)
    plan = Plan(model="gpt2-tiny", device=est.device, global_batch=8, seq_len=32,
                objective="samples-per-s", memory_fraction=0.9, budget_bytes=budget,
                overhead_bytes=est.overhead_bytes, rows=(row,), best=row,
                reason="the fastest that fits", confirmation=None, configs={}, multi_gpu=None)
    text = _shown(plan)
    assert "micro-batch 4 x 2 accumulation" in text and "12.50 ms" in text
    assert "640.0 samples/s" in text and "3.00 GiB of 70.00 GiB" in text
    nothing = dataclasses.replace(plan, best=None, rows=())
    assert "nothing fits one GPU" in _shown(nothing)


def test_tune_and_the_noise_scale_show_their_figures() -> None:
    from tilefit.tuning import NoiseScale, TuneResult

    tuned = TuneResult(batch_size=24, max_fitting_batch_size=37, accumulation_steps=1,
                       samples_per_s=1234.5, trials=(), budget_bytes=9 * 1024**3,
                       capacity_bytes=10 * 1024**3)
    text = _shown(tuned)
    assert "chosen batch 24" in text and "largest that fits 37" in text
    assert "1,234.5 samples/s" in text and "budget 9.00 GiB of 10.00 GiB" in text
    noise = NoiseScale(b_simple=812.25, b_simple_low=700.0, b_simple_high=950.5,
                       confidence=0.9, gradient_sq_norm=1.0, trace_sigma=812.25,
                       batch_small=8, batch_big=64, measurements=10, samples=640, time_s=3.0)
    assert "B_simple 812.2 samples (90% interval 700.0 to 950.5)" in _shown(noise)


def test_the_gemm_linear_and_device_views_need_no_torch() -> None:
    """A GEMM's, a Linear layer's and a GPU's views: their figures, and no torch loaded."""
    import subprocess
    import sys

    code = ("import sys, tilefit; d = tilefit.get_device('a100-80gb'); "
            "print(d._repr_html_()); "
            "print(tilefit.analyze_gemm(4096, 4096, 4096, 'bf16', d)._repr_html_()); "
            "print(tilefit.analyze_linear(1024, 1024, [1, 64], dtype='bf16', device=d)"
            "._repr_html_()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[-1] == "False"
    device, gemm, linear = out[:3]
    # the A100 SXM4 80GB's datasheet: 80 GiB, 2,039 GB/s, 312 dense bf16 TFLOP/s
    for fragment in (device, gemm, linear):
        p = _Balanced()
        p.feed(fragment)
        assert p.open == []
    assert "80.00 GiB" in device and "2.04 TB/s" in device and "bf16 312" in device
    g = tilefit.analyze_gemm(4096, 4096, 4096, "bf16", tilefit.get_device("a100-80gb"))
    assert g.flops == 2 * 4096**3  # the GEMM's FLOPs by hand
    assert "4096 x 4096 x 4096, bf16 on a100-80gb" in gemm
    assert f"{g.predicted_tflops:.1f} of 312 TFLOP/s" in gemm and "math" in gemm
    assert "batch 1" in linear and "batch 64" in linear and "Linear 1024 -&gt; 1024" in linear


def test_every_public_result_has_a_notebook_view() -> None:
    """Each result class the public functions return inherits HtmlRepr and has a renderer."""
    from tilefit.html_repr import HtmlRepr
    from tilefit.report.notebook import RENDERERS

    results = [tilefit.Estimate, tilefit.Audit, tilefit.Plan, tilefit.Trace,
               tilefit.TuneResult, tilefit.NoiseScale, tilefit.Device]
    results += [type(tilefit.analyze_gemm(64, 64, 64, "bf16", tilefit.get_device("h100"))),
                type(tilefit.analyze_linear(64, 64, 8, device=tilefit.get_device("h100")))]
    assert sorted(c.__name__ for c in results) == sorted(RENDERERS)
    assert all(issubclass(c, HtmlRepr) for c in results)


def test_a_way_forward_that_found_no_recipe_says_so_not_a_fix_that_does_not_fit(audited) -> None:  # type: ignore[no-untyped-def]
    """The way forward of a step nothing fits is no change: its tag says no recipe fits,
    and no "change: ... -> None" line is printed, in the terminal or on the page."""
    from tilefit.report.audit_terminal import not_recommended_because
    from tilefit.report.html import render_html

    est = audited.estimate
    none = _finding(rule="way-forward", severity="high", title="no recipe fits one GPU",
                    dimension="recipe", current="bf16-mixed adamw", suggested=None,
                    method="plan", recommended=False, step_time_after_s=2e-3,
                    peak_memory_before_bytes=est.device.memory_bytes,
                    peak_memory_after_bytes=est.device.memory_bytes)
    assert not_recommended_because(none, audited) == "no recipe fits one GPU"
    page = render_html(dataclasses.replace(audited, findings=(none,)))
    assert "[no recipe fits one GPU]" in page and "&rarr; <b>None</b>" not in page
