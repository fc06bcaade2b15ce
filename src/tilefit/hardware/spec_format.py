"""The one TOML format of a device, for the shipped catalog's entries (hardware/catalog.toml)
and a user's spec file alike (README, "TOML spec format").

Who the device is sits at the top level (name, display_name, architecture,
compute_capability, kind, aliases, source, notes; a spec file's ``base``); its figures sit in
tables, each key with its unit in its name:

- ``[compute]``: sms, dense_tflops (dtype -> dense TFLOP/s), alignment_bytes; or, for an RTX
  card, boost_mhz and geforce instead of dense_tflops (tilefit.hardware.architectures derives
  the peaks);
- ``[memory]``: capacity_gib, bandwidth_gb_per_s, cuda_context_bytes, and the CPU's
  fresh_alloc_s_per_byte and fresh_alloc_min_bytes;
- ``[links]``: interconnect (a link the catalog names, e.g. "nvlink4"), or name, gb_per_s
  (one direction), efficiency; and gpus_per_node, network_gb_per_s;
- ``[cost_model]``: gemm_efficiency, bandwidth_efficiency, launch_overhead_s,
  simt_gemm_factor, gemm_tile_latency_s (terms of tilefit's model, not datasheet facts);
- ``[host]``: memory_bytes (the training machine's RAM) and the host's seconds per op.

``device_fields`` turns one such table into the Device's keyword arguments: the Device keeps
its flat attribute names, the grouping is the file's. The flat format of earlier releases
(the Device's field names at the top level, peaks in FLOP/s in ``[peak_flops_per_s]``) is
still read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tilefit.errors import TilefitError
from tilefit.hardware.architectures import FP32_PER_SM_CLOCK, rtx_peaks, rtx_source
from tilefit.hardware.device import GB, GIB, TB, Device
from tilefit.hardware.host import DEFAULT_HOST, HostModel
from tilefit.units import parse_bytes

IDENTITY = ("name", "display_name", "architecture", "compute_capability", "kind", "aliases",
            "source", "notes")


@dataclass(frozen=True)
class _Key:
    """A key of a table: the Device field it sets, and the factor from the file's unit to the
    field's (None: as written)."""

    field: str
    scale: float | None = None
    whole: bool = False  # the field is a whole number (bytes)


def _same(*names: str) -> dict[str, _Key]:
    return {n: _Key(n) for n in names}


GROUPS: Mapping[str, Mapping[str, _Key]] = MappingProxyType({
    "compute": {**_same("sms", "alignment_bytes"),
                "dense_tflops": _Key("peak_flops_per_s", TB)},
    "memory": {"capacity_gib": _Key("memory_bytes", GIB, whole=True),
               "bandwidth_gb_per_s": _Key("bandwidth_bytes_per_s", GB),
               **_same("cuda_context_bytes", "fresh_alloc_s_per_byte", "fresh_alloc_min_bytes")},
    "links": {"name": _Key("link_name"), "gb_per_s": _Key("link_bytes_per_s", GB),
              "efficiency": _Key("link_efficiency"), **_same("gpus_per_node"),
              "network_gb_per_s": _Key("network_bytes_per_s", GB)},
    "cost_model": _same("gemm_efficiency", "bandwidth_efficiency", "launch_overhead_s",
                        "simt_gemm_factor", "gemm_tile_latency_s"),
})
# keys that set no one field: an RTX card's peaks from its clock, a named interconnect
_DERIVING = {"compute": ("boost_mhz", "geforce"), "links": ("interconnect",)}
# Device field -> where the grouped format writes it ("[memory] capacity_gib")
FILE_KEY: Mapping[str, str] = MappingProxyType(
    {k.field: f"[{g}] {name}" for g, keys in GROUPS.items() for name, k in keys.items()}
    | {"host_memory_bytes": "[host] memory_bytes", "host": "[host]"})
_FLAT = frozenset(f.name for f in dataclasses.fields(Device)) - set(IDENTITY) - {"host"}


def device_fields(data: Mapping[str, Any], where: str,
                  interconnects: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The Device keyword arguments a device's table gives (``base`` removed), in the grouped
    format or the flat one. ``where`` names the table in errors ("GPU spec file 'x.toml'");
    ``interconnects``: the links ``[links] interconnect`` may name."""
    flat = sorted(set(data) & _FLAT)
    if flat and set(data) & set(GROUPS):
        raise TilefitError(
            f"{where} mixes the flat format (top-level {', '.join(flat)}) with the grouped one",
            expected="the grouped format: " + ", ".join(f"[{g}]" for g in GROUPS) + ", [host]",
            given=", ".join(sorted(data)),
            fix="move each top-level figure into its table (README, \"TOML spec format\")")
    if flat:
        return _flat_fields(dict(data), where)
    return _grouped_fields(data, where, interconnects)


def _identity(data: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level keys saying who the device is, in the Device's types."""
    out = {k: data[k] for k in IDENTITY if k in data}
    if out.get("compute_capability") is not None:
        cc = str(out["compute_capability"]).split(".")
        out["compute_capability"] = (int(cc[0]), int(cc[1]) if len(cc) > 1 else 0)
    if "aliases" in out:
        out["aliases"] = tuple(out["aliases"])
    return out


def _unknown(where: str, given: list[str], expected: str) -> TilefitError:
    return TilefitError(f"{where} has unknown keys", expected=expected,
                        given=", ".join(given), fix="rename or remove those keys")


def _grouped_fields(data: Mapping[str, Any], where: str,
                    interconnects: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The grouped format's tables as Device fields."""
    tables = (*GROUPS, "host")
    unknown = sorted(set(data) - set(IDENTITY) - set(tables))
    if unknown:
        raise _unknown(where, unknown, "top-level " + ", ".join(IDENTITY) + " (and base), and "
                       "the tables " + ", ".join(f"[{t}]" for t in tables)
                       + " (README, \"TOML spec format\")")
    fields = _identity(data)
    for group, keys in GROUPS.items():
        table = _table(data, group, where)
        if group == "links" and "interconnect" in table:
            table = {**_interconnect(table["interconnect"], where, interconnects), **table}
        unknown = sorted(set(table) - set(keys) - set(_DERIVING.get(group, ())))
        if unknown:
            raise _unknown(where, [f"[{group}] {k}" for k in unknown],
                           f"[{group}] keys among " + ", ".join((*keys, *_DERIVING.get(group, ()))))
        for name, key in keys.items():
            if name in table:
                fields[key.field] = _scaled(table[name], key, f"[{group}] {name}", where)
    compute = _table(data, "compute", where)
    if "boost_mhz" in compute:
        _rtx_fields(fields, compute, where)
    if "host" in data:
        host = dict(_table(data, "host", where))
        if "memory_bytes" in host:
            fields["host_memory_bytes"] = host_memory(host.pop("memory_bytes"), where,
                                                      "[host] memory_bytes")
        if host:
            fields["host"] = host_model(host, where)
    return fields


def _table(data: Mapping[str, Any], group: str, where: str) -> Mapping[str, Any]:
    table = data.get(group, {})
    if not isinstance(table, Mapping):
        raise TilefitError(f"{where}: {group} must be a table", expected=f"[{group}] and its keys",
                           given=f"{group} = {table!r}", fix=f"write [{group}] on its own line "
                           "with its keys below it")
    return table


def _scaled(value: Any, key: _Key, name: str, where: str) -> Any:
    """A value in the Device field's unit: a number (or a dtype -> number table) times the
    key's factor."""
    if key.scale is None:
        return value
    if isinstance(value, Mapping):
        return {k: _scaled(v, key, f"{name}.{k}", where) for k, v in value.items()}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TilefitError(f"{where} has a bad value", expected=f"{name} = a number",
                           given=f"{name} = {value!r}", fix="correct the value named above")
    return int(value * key.scale) if key.whole else value * key.scale


def _interconnect(name: Any, where: str, known: Mapping[str, Mapping[str, Any]]
                  ) -> Mapping[str, Any]:
    if name not in known:
        raise TilefitError(f"{where} names an unknown interconnect",
                           expected="[links] interconnect among " + ", ".join(known),
                           given=f"interconnect = {name!r}",
                           fix="name one of those, or give [links] name, gb_per_s, efficiency")
    return known[name]


def _rtx_fields(fields: dict[str, Any], compute: Mapping[str, Any], where: str) -> None:
    """The peaks of an RTX card from its SM count and boost clock (no dense_tflops beside)."""
    arch, sms = fields.get("architecture"), fields.get("sms")
    if "dense_tflops" in compute or arch not in FP32_PER_SM_CLOCK or not isinstance(sms, int):
        raise TilefitError(
            f"{where}: [compute] boost_mhz derives an RTX card's peaks",
            expected="architecture among " + ", ".join(FP32_PER_SM_CLOCK) + ", [compute] sms "
            "and boost_mhz, and no dense_tflops", given=f"architecture = {arch!r}, sms = {sms!r}"
            + (", dense_tflops" if "dense_tflops" in compute else ""),
            fix="give those, or the peaks themselves in [compute] dense_tflops")
    boost = _scaled(compute["boost_mhz"], _Key("boost_mhz", 1.0), "[compute] boost_mhz", where)
    tflops = rtx_peaks(arch, sms, boost, geforce=bool(compute.get("geforce", False)))
    fields["peak_flops_per_s"] = {k: v * TB for k, v in tflops.items()}
    if "source" in fields:
        fields["source"] += rtx_source(sms, boost)


def _flat_fields(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The flat format: the Device's own field names at the top level."""
    fields = {f.name for f in dataclasses.fields(Device)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise _unknown(where, unknown, "Device fields: " + ", ".join(sorted(fields))
                       + " (and base); or the grouped format (README, \"TOML spec format\")")
    data.update(_identity(data))
    if "host" in data:
        data["host"] = host_model(data["host"], where)
    if "host_memory_bytes" in data:
        data["host_memory_bytes"] = host_memory(data["host_memory_bytes"], where,
                                                "host_memory_bytes")
    return data


def host_model(table: Any, where: str) -> HostModel:
    """A [host] table: HostModel fields over the defaults (seconds per op)."""
    known = {f.name for f in dataclasses.fields(HostModel)}
    if not isinstance(table, Mapping) or set(table) - known:
        raise TilefitError(
            f"{where} has a [host] table tilefit cannot read",
            expected="[host] with keys among " + ", ".join(sorted(known)),
            given=repr(table), fix="e.g. [host] forward_op_s = 8e-6")
    try:
        return HostModel(**{**dataclasses.asdict(DEFAULT_HOST), **table})
    except (TypeError, ValueError) as exc:
        raise TilefitError(f"{where}: bad [host] value", expected="non-negative seconds",
                           given=str(exc), fix="e.g. [host] forward_op_s = 8e-6") from None


def host_memory(value: Any, where: str, key: str) -> int:
    """The training machine's RAM: bytes, or a size as people write it ("64GiB")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    try:
        return parse_bytes(str(value), option=f"{key} =")
    except TilefitError as exc:
        raise TilefitError(f"{where}: {exc.problem}",
                           expected=f"{key} = 68719476736 or \"64GiB\"",
                           given=f"{key} = {value!r}",
                           fix=f'write the training machine\'s RAM, e.g. {key} = "64GiB"'
                           ) from None
