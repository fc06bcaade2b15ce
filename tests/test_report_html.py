"""The audit's HTML page: the GPU's capacity drawn on the memory chart, the fit verdict in
colour, the host/GPU timeline and the assumed training loop, and a non-recommended finding's
reason. One tiny GPT-2 step (one layer, hidden 64, 32 tokens) is estimated once; the Audit
around it is built by hand (the rules' own tests are tests/test_audit*.py), so the page is
rendered from known findings."""

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
    return recipe, tilefit.estimate(work, recipe=recipe, gpu="a100-80gb")


def _finding(**kw: Any) -> Finding:
    base: dict[str, Any] = dict(
        rule="fused-optimizer", severity="low", title="use the fused AdamW", modules=(),
        dimension=None, current=None, suggested=None, fix="AdamW(fused=True)",
        reason="one kernel per step", step_time_before_s=2e-3, step_time_after_s=1e-3,
        method="retrace")
    return Finding(**{**base, **kw})


@pytest.fixture(scope="module")
def audited(step):  # type: ignore[no-untyped-def]
    recipe, est = step
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


def _verdict(page: str) -> list[str]:
    return re.findall(r'<span class="verdict (\w+)">([^<]*)</span>', page)


def test_the_verdict_is_green_when_it_fits_and_red_when_not(audited) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.html import render_html

    est = audited.estimate
    assert est.fits
    page = render_html(audited)
    assert set(_verdict(page)) == {("fits", "fits")}
    css = page.split("<style>")[1].split("</style>")[0]
    assert ".verdict.fits{background:#1b7f3b}" in css and "#c62828" in css
    # one byte past the device: the same step does not fit
    over = est.device.memory_bytes - est.overhead_bytes + 1
    big = dataclasses.replace(est, peak_memory_bytes=over)
    assert not big.fits
    page = render_html(dataclasses.replace(audited, estimate=big))
    assert set(_verdict(page)) == {("nofit", "DOES NOT FIT")}
    assert "80.00 GiB of 80.00 GiB: <span class=\"verdict nofit\">" in page


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
