"""The network between nodes, and a device placed in a job of several nodes.

A multi-node step's collectives cross the network between nodes, whose bandwidth per GPU is
far below NVLink's (docs/references.md, section 20, items 5 and 9). The catalog GPUs carry
the network of the systems NVIDIA builds them into (DGX: one NIC per GPU); ``--network``
names another one (a name below or a TOML spec file) and ``--nodes`` says how many nodes the
GPUs span.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilefit.batches import divisors
from tilefit.errors import TilefitError, close_matches
from tilefit.hardware.device import Device

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

GBIT = 1e9 / 8  # bytes per second in one Gb/s


@dataclass(frozen=True)
class Network:
    """One GPU's bandwidth to other nodes, one direction (its NIC's line rate)."""

    name: str
    display_name: str
    bytes_per_s: float
    source: str


# Line rates per port, one NIC per GPU as DGX A100 / H100 / B200 systems are built
# (docs/references.md, section 20, item 9).
NETWORKS: tuple[Network, ...] = (
    Network("ib-hdr", "InfiniBand HDR, 200 Gb/s per GPU", 200 * GBIT, "InfiniBand HDR"),
    Network("ib-ndr", "InfiniBand NDR, 400 Gb/s per GPU", 400 * GBIT, "InfiniBand NDR"),
    Network("ib-xdr", "InfiniBand XDR, 800 Gb/s per GPU", 800 * GBIT, "InfiniBand XDR"),
    Network("roce-100g", "RoCE over 100 GbE per GPU", 100 * GBIT, "Ethernet line rate"),
    Network("roce-200g", "RoCE over 200 GbE per GPU", 200 * GBIT, "Ethernet line rate"),
    Network("roce-400g", "RoCE over 400 GbE per GPU", 400 * GBIT, "Ethernet line rate"),
)
SPEC_FORMAT = ('a TOML file with gbit_per_s = <each GPU\'s line rate to other nodes, Gb/s, '
               'one direction> and optionally name = "..." (e.g. gbit_per_s = 100 for one '
               '100 GbE NIC per GPU)')


def get_network(spec: str) -> Network:
    """A catalog network by name, or a TOML spec file; else an error with both forms."""
    for net in NETWORKS:
        if spec.lower() == net.name:
            return net
    path = Path(spec)
    if spec.lower().endswith(".toml") or path.is_file():
        return _load_spec(path)
    names = [n.name for n in NETWORKS]
    raise TilefitError(
        f"unknown network {spec!r}", expected="one of " + ", ".join(names) + ", or "
        + SPEC_FORMAT, given=spec,
        fix=f"pass get_network(spec={(close_matches(spec, names) or [names[1]])[0]!r}), or "
        "get_network(spec='my_net.toml')")


def _load_spec(path: Path) -> Network:
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TilefitError(f"network spec file {path} not found", expected=SPEC_FORMAT,
                           given=str(path), fix="check the path") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TilefitError(f"network spec file {path} is not valid TOML: {exc}",
                           expected=SPEC_FORMAT, given=str(path), fix="fix the file") from None
    rate = data.get("gbit_per_s")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0:
        raise TilefitError(f"network spec file {path} has no usable gbit_per_s",
                           expected=SPEC_FORMAT, given=f"gbit_per_s = {rate!r}",
                           fix="gbit_per_s = 200")
    name = str(data.get("name", path.stem))
    return Network(name, f"{name}, {rate:g} Gb/s per GPU", rate * GBIT, str(path))


def on_nodes(device: Device, gpus: int, nodes: int | None = None,
             network: Network | None = None) -> Device:
    """``device`` as one of ``gpus`` GPUs spread evenly over ``nodes`` nodes (None: as many
    as the device's GPUs per node need), joined by ``network`` (None: the device's own)."""
    if nodes is not None:
        if nodes < 1 or gpus % nodes:
            fits = divisors(gpus)
            raise TilefitError(
                f"{gpus} GPUs cannot be spread evenly over {nodes} nodes",
                expected=f"a node count that divides on_nodes(..., gpus={gpus}): "
                + ", ".join(map(str, fits)), given=f"on_nodes(..., nodes={nodes})",
                fix=f"pass on_nodes(..., nodes={min(fits, key=lambda n: abs(n - nodes))}), or "
                "another on_nodes(..., gpus=...)")
        device = dataclasses.replace(device, gpus_per_node=gpus // nodes)
    if network is not None:
        device = dataclasses.replace(device, network_bytes_per_s=network.bytes_per_s,
                                     notes=(device.notes + "; " if device.notes else "")
                                     + f"network {network.display_name}")
    return device
