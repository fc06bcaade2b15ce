"""The derived steady-state rates of benchmarks/gpu_corpus/e2e.jsonl (`steady`) agree with the
timestamps and arithmetic their `from` text states, sit right after `measured`, and exist for
every Lambda record (source 4 of the corpus README). Fast: nothing is traced or fetched."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "benchmarks" / "gpu_corpus" / "e2e.jsonl"
TS = r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\)"
FROM = re.compile(rf"^DLL timestamps of 'Training Iteration: 51' {TS} and "
                  rf"'Training Iteration: 101' {TS}: (\d+) x 50 steps / ([\d.]+) s = "
                  rf"([\d.]+) samples/s, ([\d.]+) x the published")


def records() -> list[dict]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_lambda_record_has_a_steady_rate() -> None:
    lam = [r for r in records() if r["id"].startswith("lambda-")]
    assert len(lam) == 34
    assert all("steady" in r for r in lam)


@pytest.mark.parametrize("rec", [r for r in records() if "steady" in r], ids=lambda r: r["id"])
def test_the_steady_rate_is_the_arithmetic_its_text_states(rec: dict) -> None:
    keys = list(rec)
    assert keys[keys.index("measured") + 1] == "steady"
    st = rec["steady"]
    assert st["derived"] is True and set(st) == {"samples_per_s", "derived", "from"}
    m = FROM.match(st["from"])
    assert m, st["from"]
    t51, t101 = (datetime.strptime(m[i], "%Y-%m-%d %H:%M:%S.%f") for i in (1, 2))
    seconds = (t101 - t51).total_seconds()
    assert int(m[3]) == rec["batch"]
    assert st["samples_per_s"] == rec["batch"] * 50 / seconds
    assert f"{seconds:.3f}" == m[4] and f"{st['samples_per_s']:.2f}" == m[5]
    assert f"{st['samples_per_s'] / rec['measured']['samples_per_s']:.3f}" == m[6]
    # the published figure counts the warm-up step, so the steady rate is the higher one
    assert 1.0 < st["samples_per_s"] / rec["measured"]["samples_per_s"] < 1.1
