"""Parameter counts, computed by building the model on the meta device (no memory, no init)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tilefit.models.sources import Workload


def count_parameters(workload: Workload) -> int:
    """Distinct parameters of the built model (tied weights counted once, as PyTorch does).

    The model is built under ``torch.device("meta")``: shapes only, nothing allocated, so a 70B
    count takes well under a second.
    """
    import torch

    with torch.device("meta"):
        model = workload.build(attention="auto")
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class CatalogModel:
    """One catalog row: facts read from the published config, parameters computed."""

    name: str
    hub_id: str
    task: str
    model_type: str
    parameters: int
    layers: int
    hidden_size: int
    vocab_size: int | None
    max_seq_len: int | None  # position limit (None: no position table)
    default_seq_len: int | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(workload: Workload) -> CatalogModel:
    """The catalog row of a catalog (or config.json) workload."""
    from tilefit.models import hf

    assert workload.config is not None
    cfg = hf.make_config(workload.config)
    return CatalogModel(
        name=workload.name,
        hub_id=str(workload.config.get("_hub_id", "")),
        task=workload.task,
        model_type=str(cfg.model_type),
        parameters=count_parameters(workload),
        layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        vocab_size=getattr(cfg, "vocab_size", None) if workload.task != "image-cls" else None,
        max_seq_len=None if workload.task == "image-cls" else hf.position_limit(cfg),
        default_seq_len=workload.seq_len,
        source=str(workload.config.get("_source", "")),
    )


def catalog_models() -> list[CatalogModel]:
    """Every catalog model, parameters computed from its config by building it on the meta
    device (seconds, with torch and transformers imported), then kept in the user cache
    (``TILEFIT_CACHE_DIR``) under a key of the configs' text and the installed tilefit,
    torch and transformers: the next listing reads the same computed rows back without
    importing either."""
    path = _rows_cache()
    try:
        return [CatalogModel(**row) for row in json.loads(path.read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError):
        pass  # not computed yet for these configs and versions (or unreadable): compute
    from tilefit.models.catalog import catalog_names
    from tilefit.models.sources import load_workload

    rows = [describe(load_workload(name)) for name in catalog_names()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.to_dict() for r in rows]), encoding="utf-8")
    except OSError:
        pass  # a read-only cache only costs the next listing its seconds
    return rows


def _rows_cache() -> Path:
    """Where the computed catalog rows of these configs and library versions are kept."""
    from tilefit.hardware.profiles import cache_dir
    from tilefit.models.catalog import catalog_entry, catalog_names

    key = hashlib.sha256()
    for name in catalog_names():
        key.update(json.dumps(catalog_entry(name), sort_keys=True).encode())
    for package in ("tilefit", "torch", "transformers"):
        try:
            key.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            key.update(package.encode())
    return cache_dir() / "catalog" / f"models-{key.hexdigest()[:16]}.json"
