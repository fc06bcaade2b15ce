"""The published GPU-memory corpus (benchmarks/reserved_corpus/) parses, and each record has
what its README requires: the configuration, a known kind of measurement with a positive
figure (or a fit / out-of-memory verdict), a source URL, and a model and GPU that tilefit
resolves. Fast: nothing is traced."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tilefit.hardware import get_device
from tilefit.models.catalog import catalog_names
from tilefit.models.hf import TASKS
from tilefit.vocab import OPTIMIZER_NAMES, PRECISION_NAMES, STRATEGIES, ZERO_STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "benchmarks" / "reserved_corpus"
REQUIRED = ("id", "series", "source", "model", "gpu", "gpu_stated", "world_size", "strategy",
            "micro_batch", "seq", "accumulation", "precision", "precision_stated", "optimizer",
            "optimizer_stated", "activation_checkpointing", "attention", "compiled", "software",
            "alloc_conf", "measured", "caveats")
FIGURE_KINDS = ("reserved-peak", "nvml-used", "nvidia-smi", "allocated-peak", "active-peak")
VERDICT_KINDS = ("fit", "oom")
CONTEXT_KINDS = ("nvml-used", "nvidia-smi", "device-used")
AC = ("none", "full", "unstated")
ATTENTION = ("eager", "sdpa", "flash", None)
UNITS = {"MiB": 2**20, "GiB": 2**30, "GB (10^9 bytes)": 10**9, "bytes": 1}
SHA = re.compile(r"^[0-9a-f]{40}$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _read(name: str) -> list[dict]:
    lines = (FOLDER / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def records() -> list[dict]:
    return _read("records.jsonl")


def test_the_corpus_parses_with_unique_ids_and_several_sources() -> None:
    recs = records()
    assert len(recs) >= 10
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids))
    assert len({r["source"]["url"].split("/blob/")[0] for r in recs}) >= 4
    kinds = {r["measured"]["kind"] for r in recs}
    assert {"reserved-peak", "nvml-used", "oom", "fit"} <= kinds


def _check_source(src: dict) -> None:
    assert src["url"].startswith("https://github.com/"), src
    assert src["where"] and src["title"] and DATE.match(src["date"]), src
    if "commit" in src:  # a repository file: the URL is pinned to the commit and names the file
        assert SHA.match(src["commit"]), src
        assert src["commit"] in src["url"] and src["file"] in src["url"], src


def _check_measured(m: dict) -> None:
    if m["kind"] in VERDICT_KINDS:
        assert m["fits"] is (m["kind"] == "fit"), m
        assert "value" not in m  # a verdict carries no figure
        return
    assert m["kind"] in FIGURE_KINDS, m
    assert m["value"] > 0 and m["bytes"] > 0, m
    # bytes are the published value in the published unit, converted exactly (rounded)
    assert m["bytes"] == round(m["value"] * UNITS[m["unit"]]), m
    assert m["when"], m


@pytest.mark.parametrize("rec", records(), ids=lambda r: r["id"])
def test_each_record_states_its_configuration_and_its_source(rec: dict) -> None:
    missing = [k for k in REQUIRED if k not in rec]
    assert not missing, missing
    _check_source(rec["source"])
    _check_measured(rec["measured"])
    model = rec["model"]
    assert model["base"] in catalog_names() and isinstance(model["changes"], dict)
    assert model.get("task", "causal-lm") in TASKS
    assert rec["strategy"] in (*STRATEGIES, *ZERO_STRATEGIES, "zero0", "none")
    assert (rec["strategy"] == "none") == (rec["world_size"] == 1)
    assert rec["precision"] in PRECISION_NAMES
    assert rec["optimizer"] in OPTIMIZER_NAMES
    assert rec["activation_checkpointing"] in AC and rec["attention"] in ATTENTION
    for key in ("micro_batch", "seq", "accumulation", "world_size"):
        assert isinstance(rec[key], int) and rec[key] > 0, key
    assert rec["caveats"]
    gpu = rec["gpu"]
    if gpu is not None:  # null only where the source does not name the GPU (said in caveats)
        get_device(str(ROOT / gpu) if gpu.endswith(".toml") else gpu)
    else:
        assert rec["gpu_stated"] is None and "GPU" in rec["caveats"]


@pytest.mark.parametrize("rec", _read("context.jsonl"), ids=lambda r: r["id"])
def test_each_context_figure_names_its_probe_and_source(rec: dict) -> None:
    _check_source(rec["source"])
    m = rec["measured"]
    assert m["kind"] in CONTEXT_KINDS and m["value"] > 0
    assert m["bytes"] == round(m["value"] * UNITS[m["unit"]])
    # what the probe left in PyTorch's allocator is below the reading it is part of
    assert 0 <= rec["includes_allocator_bytes"] < m["bytes"]
    assert rec["probe"] and rec["caveats"]
    if rec["gpu"] is not None:
        get_device(rec["gpu"])


def test_the_published_byte_conversions_by_hand() -> None:
    by_id = {r["id"]: r["measured"] for r in records()}
    # 14949 MiB x 1,048,576 = 15,675,162,624 bytes; 26.79 GB = 26,790,000,000 bytes
    assert by_id["hf-v100-bert-large-b4"]["bytes"] == 15_675_162_624
    assert by_id["rasbt-vit-l16-fp32-b64"]["bytes"] == 26_790_000_000
    # 60.0 GiB = 64,424,509,440 bytes
    assert by_id["tt-a100-llama3.2-3b-packed-4096-b2"]["bytes"] == 64_424_509_440
