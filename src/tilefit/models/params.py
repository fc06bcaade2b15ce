"""Parameter counts, computed by building the model on the meta device (no memory, no init)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tilefit.models.workload import Workload


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
    """Every catalog model, parameters computed from its config (about 2 s for all)."""
    from tilefit.models.catalog import catalog_names
    from tilefit.models.workload import load_workload

    return [describe(load_workload(name)) for name in catalog_names()]
