"""The published multi-GPU corpus (benchmarks/multigpu_corpus/published.jsonl) parses, and each
record has what its README requires: the configuration, the measurement, a source pinned to a
commit, and a GPU and model that tilefit resolves. Fast: nothing is traced."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tilefit.estimator.zero import ZeroConfig
from tilefit.hardware import get_device
from tilefit.models.catalog import catalog_names
from tilefit.vocab import PRECISION_NAMES, STRATEGIES, ZERO_STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "benchmarks" / "multigpu_corpus" / "published.jsonl"
REQUIRED = ("id", "series", "source", "model", "gpu", "gpu_stated", "world_size", "nodes",
            "gpus_per_node", "interconnect", "strategy", "micro_batch", "seq", "accumulation",
            "precision", "precision_stated", "activation_checkpointing", "compiled", "float8",
            "context_parallel", "optimizer", "max_grad_norm", "measured", "caveats")
AC = ("none", "full", "selective-op", "selective-layer", "unstated")
MEMORY_KINDS = ("reserved-peak", "allocated-peak", "nvidia-smi")
SHA = re.compile(r"^[0-9a-f]{40}$")


def records() -> list[dict]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_the_corpus_parses_with_unique_ids() -> None:
    recs = records()
    assert len(recs) >= 10
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("rec", records(), ids=lambda r: r["id"])
def test_each_record_states_its_configuration_and_a_pinned_source(rec: dict) -> None:
    missing = [k for k in REQUIRED if k not in rec]
    assert not missing, missing
    src = rec["source"]
    assert SHA.match(src["commit"]), src
    assert src["commit"] in src["url"] and src["file"] in src["url"]
    assert src["where"] and src["title"] and re.match(r"^\d{4}-\d{2}-\d{2}$", src["date"])
    assert rec["nodes"] == -(-rec["world_size"] // rec["gpus_per_node"])  # whole nodes, or one
    assert rec["strategy"] in (*STRATEGIES, *ZERO_STRATEGIES, "none")
    assert rec["precision"] in PRECISION_NAMES
    assert rec["activation_checkpointing"] in AC
    assert rec["model"]["base"] in catalog_names() and isinstance(rec["model"]["changes"], dict)
    m = rec["measured"]
    assert m["tokens_per_s_per_gpu"] > 0
    if "memory_gib" in m:
        assert m["memory_kind"] in MEMORY_KINDS
    if rec["strategy"] in ZERO_STRATEGIES:  # DeepSpeed: offload said, buckets as ZeroConfig
        assert isinstance(rec["offload"], bool)
        ZeroConfig(**rec.get("zero_config", {}))
    if "derived" in m:  # a derived figure names the published one it comes from
        assert any(k in m for k in ("samples_per_s_job", "tokens_per_s_job")), m
    if "excluded" in rec:
        assert isinstance(rec["excluded"], str) and rec["excluded"]
    gpu = rec["gpu"]
    device = get_device(str(ROOT / gpu) if gpu.endswith(".toml") else gpu)
    # the device tilefit predicts with has the record's node size where it crosses nodes
    assert device.gpus_per_node == rec["gpus_per_node"] or rec["nodes"] == 1
