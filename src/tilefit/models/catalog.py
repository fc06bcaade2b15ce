"""The catalog of published model configs shipped with tilefit (``models/configs/*.json``).

Each file is the ``config.json`` of a model on the Hugging Face hub, copied from the address in
its ``_source`` key (keys that start with ``_`` are tilefit's notes and are dropped before the
config reaches transformers). No torch import here: listing names stays fast.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from tilefit.errors import TilefitError, close_matches


@cache
def _files() -> dict[str, str]:
    """Catalog name -> JSON text, read once from the package data."""
    folder = resources.files("tilefit.models") / "configs"
    return {
        entry.name[: -len(".json")]: entry.read_text(encoding="utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith(".json")
    }


def catalog_names() -> list[str]:
    """The catalog's model names, sorted."""
    return sorted(_files())


def _hub_ids() -> dict[str, str]:
    """Lower-cased hub id (``meta-llama/Meta-Llama-3-8B``) -> catalog name."""
    ids = {}
    for name in _files():
        hub_id = json.loads(_files()[name]).get("_hub_id")
        if hub_id:
            ids[hub_id.lower()] = name
    return ids


def resolve_name(source: str) -> str | None:
    """The catalog name for ``source`` (a name or a hub id, any case), or None."""
    lowered = source.lower()
    names = {n.lower(): n for n in _files()}
    if lowered in names:
        return names[lowered]
    return _hub_ids().get(lowered)


def catalog_entry(name: str) -> dict[str, Any]:
    """The published config of a catalog model, including tilefit's ``_`` notes (a fresh copy)."""
    resolved = resolve_name(name)
    if resolved is None:
        raise unknown_model_error(name)
    return json.loads(_files()[resolved])


def unknown_model_error(source: str) -> TilefitError:
    suggestions = close_matches(source, catalog_names())
    fix = "use one of the catalog names (`tilefit models`), a Hugging Face Hub id org/name, "
    fix += "a path to a config.json, or package.module:function returning an nn.Module"
    if suggestions:
        fix = f"did you mean {', '.join(suggestions)}? Otherwise {fix}"
    return TilefitError(
        f"unknown model {source!r}",
        expected="a catalog name (" + ", ".join(catalog_names()) + "), a Hub id org/name, "
        "a config.json path, or package.module:function",
        given=source,
        fix=fix,
    )
