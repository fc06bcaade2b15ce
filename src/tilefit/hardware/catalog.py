"""The device catalog: the GPUs people rent and own, read from the data file shipped with the
package (hardware/catalog.toml), each entry in a user spec file's format
(tilefit.hardware.spec_format) with the sources of its figures beside them.

What stays in Python is formulas: an RTX card's peaks from its SM count and boost clock and
each architecture's simt_gemm_factor (tilefit.hardware.architectures). The file's
``[defaults]`` tables fill what an entry leaves out; its ``[interconnects]`` are the links an
entry's ``[links] interconnect`` names.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Any

from tilefit.errors import TilefitError
from tilefit.hardware.architectures import simt_gemm_factor
from tilefit.hardware.device import Device
from tilefit.hardware.spec_format import device_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["CATALOG", "DEFAULT_GEMM_EFFICIENCY", "INTERCONNECTS", "catalog_entry"]

DATA_FILE = "catalog.toml"


def _read_catalog() -> dict[str, Any]:
    """The data file's tables, found where the package is installed."""
    text = resources.files("tilefit.hardware").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return tomllib.loads(text)


_DATA = _read_catalog()
INTERCONNECTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(_DATA["interconnects"])
_DEFAULTS: Mapping[str, Mapping[str, Any]] = _DATA["defaults"]
# the gemm_efficiency of a GPU with no published best-matmul figure or sweep (the H100's)
DEFAULT_GEMM_EFFICIENCY: float = _DEFAULTS["cost_model"]["gemm_efficiency"]


def _device(entry: Mapping[str, Any]) -> Device:
    """One [[gpu]] entry, the file's defaults under it, as a Device."""
    table = dict(entry)
    for group, defaults in _DEFAULTS.items():
        table[group] = {**defaults, **entry.get(group, {})}
    where = f"catalog entry {entry.get('name')!r} (tilefit/hardware/{DATA_FILE})"
    fields = device_fields(table, where, INTERCONNECTS)
    fields.setdefault("simt_gemm_factor", simt_gemm_factor(fields["architecture"]))
    return Device(**fields)


CATALOG: tuple[Device, ...] = tuple(_device(entry) for entry in _DATA["gpu"])
_BY_NAME: Mapping[str, Device] = MappingProxyType({d.name: d for d in CATALOG})


def catalog_entry(name: str) -> Device:
    """The catalog's Device of this exact name (no alias, no calibration profile)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise TilefitError(f"no catalog entry named {name!r}", expected="a catalog name",
                           given=name, fix="run `tilefit gpus` for the names") from None
