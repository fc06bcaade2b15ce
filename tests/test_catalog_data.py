"""The GPU catalog is a data file (src/tilefit/hardware/catalog.toml) in a user spec file's
grouped format (issue 44, item 5).

tests/fixtures/catalog_before_data_file.json is a one-off snapshot of every Device the Python
catalog built (hardware/catalog.py, catalog_rtx.py and gpu_entry.py at commit 6da59a7, the
commit before the move), written by the same ``_plain`` as below; the data file must give
the same Devices, field for field and type for type.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tilefit.errors import TilefitError
from tilefit.hardware import Device, get_device, list_devices, load_spec_file
from tilefit.hardware.catalog import DATA_FILE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = Path(__file__).parent / "fixtures" / "catalog_before_data_file.json"
CATALOG_TOML = ROOT / "src" / "tilefit" / "hardware" / DATA_FILE


def _plain(value: Any) -> Any:
    """A Device's fields as JSON values (tuples as lists, mappings as dicts)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_every_catalog_device_equals_the_python_catalogs() -> None:
    before = json.loads(SNAPSHOT.read_text(encoding="utf-8"))["devices"]
    now = [json.loads(json.dumps(_plain(d))) for d in list_devices()]
    assert [d["name"] for d in now] == [d["name"] for d in before]
    for old, new in zip(before, now, strict=True):
        assert new.keys() == old.keys()
        for field, value in old.items():
            assert (new[field], type(new[field])) == (value, type(value)), (old["name"], field)


def test_the_data_file_ships_with_the_package() -> None:
    # importlib.resources finds it where the package is (an installed wheel too), and the
    # build's package data names it
    found = resources.files("tilefit.hardware").joinpath(DATA_FILE)
    assert found.is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert f"hardware/{DATA_FILE}" in pyproject["tool"]["setuptools"]["package-data"]["tilefit"]


def _entries() -> list[tuple[str, str]]:
    """Each [[gpu]] entry's text as a spec file: its sub-tables [gpu.x] become [x]."""
    text = CATALOG_TOML.read_text(encoding="utf-8")
    blocks = text.split("[[gpu]]\n")[1:]
    out = []
    for block in blocks:
        block = re.sub(r"^\[gpu\.", "[", block, flags=re.MULTILINE)
        out.append((tomllib.loads(block)["name"], block))
    return out


@pytest.mark.parametrize(("name", "text"), _entries(), ids=lambda v: v[:20])
def test_each_catalog_entry_is_a_spec_file(tmp_path: Path, name: str, text: str) -> None:
    # the same format: a catalog entry's text, written to a file, is the catalog's Device but
    # for the cost-model terms the catalog's [defaults] table and the architecture's
    # simt_gemm_factor fill in (a user's file takes the Device's own defaults)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    catalog = get_device(name)
    from_file = load_spec_file(path)
    assert dataclasses.replace(from_file, gemm_efficiency=catalog.gemm_efficiency,
                               simt_gemm_factor=catalog.simt_gemm_factor) == catalog
    assert from_file.gemm_efficiency in (catalog.gemm_efficiency, 0.80)


GROUPED = """
name = "my-gpu"
display_name = "My GPU 24GB"
architecture = "Ada"
compute_capability = "8.9"
aliases = ["mine"]
[compute]
sms = 76
alignment_bytes = 16
dense_tflops = { fp32 = 40, tf32 = 40, fp16 = 80, bf16 = 80 }
[memory]
capacity_gib = 24
bandwidth_gb_per_s = 716.8
cuda_context_bytes = 400000000
[links]
interconnect = "pcie4"
gpus_per_node = 4
[cost_model]
gemm_efficiency = 0.75
launch_overhead_s = 5e-6
[host]
memory_bytes = "64GiB"
forward_op_s = 8e-6
"""
# the same GPU in the flat format of earlier releases, each figure by hand in the Device's
# units: 24 GiB = 24 * 2**30 bytes; PCIe 4.0 x16: 32 GB/s one way, NCCL at 60% of it
FLAT = """
name = "my-gpu"
display_name = "My GPU 24GB"
architecture = "Ada"
compute_capability = "8.9"
aliases = ["mine"]
sms = 76
alignment_bytes = 16
memory_bytes = 25769803776
bandwidth_bytes_per_s = 716.8e9
cuda_context_bytes = 400000000
link_name = "PCIe 4.0 x16"
link_bytes_per_s = 32e9
link_efficiency = 0.60
network_bytes_per_s = 0
gpus_per_node = 4
gemm_efficiency = 0.75
launch_overhead_s = 5e-6
host_memory_bytes = "64GiB"
[peak_flops_per_s]
fp32 = 40e12
tf32 = 40e12
fp16 = 80e12
bf16 = 80e12
[host]
forward_op_s = 8e-6
"""


def _load(tmp_path: Path, text: str) -> Device:
    path = tmp_path / "gpu.toml"  # one path: the Device's source names it
    path.write_text(text)
    return load_spec_file(path)


def test_grouped_and_flat_spec_files_give_the_same_device(tmp_path: Path) -> None:
    grouped, flat = _load(tmp_path, GROUPED), _load(tmp_path, FLAT)
    assert grouped == flat
    assert _plain(grouped) == _plain(flat)
    assert grouped.memory_bytes == 24 * 2**30
    assert grouped.peak("bf16") == 80e12
    assert grouped.host_memory_bytes == 64 * 2**30
    assert grouped.host.forward_op_s == 8e-6
    assert (grouped.link_name, grouped.link_bytes_per_s) == ("PCIe 4.0 x16", 32e9)


def test_grouped_spec_file_with_base(tmp_path: Path) -> None:
    text = ('base = "a100-80gb"\nname = "a100-250w"\n[compute]\ndense_tflops = { fp16 = 280 }\n'
            "[links]\ninterconnect = \"pcie4\"\n")
    flat = ('base = "a100-80gb"\nname = "a100-250w"\nlink_name = "PCIe 4.0 x16"\n'
            "link_bytes_per_s = 32e9\nlink_efficiency = 0.6\nnetwork_bytes_per_s = 0\n"
            "[peak_flops_per_s]\nfp16 = 280e12\n")
    grouped = _load(tmp_path, text)
    assert grouped.peak("fp16") == 280e12
    assert grouped.peak("bf16") == 312e12  # the base's, A100 datasheet
    assert grouped.link_bytes_per_s == 32e9
    assert dataclasses.replace(grouped, source="") == dataclasses.replace(
        _load(tmp_path, flat), source="")


def test_an_rtx_card_from_its_clock(tmp_path: Path) -> None:
    # RTX 4070: 46 SMs at 2475 MHz; GeForce fp16 with fp32 accumulate is half of
    # 46 x 1024 x 2.475 GHz = 116.6 TFLOP/s: 58.3 (the catalog's figure, derived the same way)
    d = _load(tmp_path, 'name = "x"\narchitecture = "Ada"\nsource = "page"\n[compute]\n'
                        "sms = 46\nboost_mhz = 2475\ngeforce = true\n[memory]\ncapacity_gib = 12\n"
                        "bandwidth_gb_per_s = 504\n")
    assert d.peak("fp16") == pytest.approx(58.3e12)
    assert d.peak_flops_per_s == get_device("rtx-4070").peak_flops_per_s
    assert d.source == "page; 46 SMs at 2475 MHz boost x the per-SM rate"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\nsms = 3\n[memory]\ncapacity_gib = 1\n', "mixes the flat format"),
        ('base = "a100-80gb"\n[links]\ninterconnect = "nvlink9"\n', "unknown interconnect"),
        ('base = "a100-80gb"\n[memory]\ncapacity = 1\n', "unknown keys"),
        ('base = "a100-80gb"\n[memory]\ncapacity_gib = "lots"\n', "bad value"),
        ('base = "a100-80gb"\n[compute]\nboost_mhz = 2000\n', "boost_mhz derives"),
        ('base = "a100-80gb"\ncompute = 3\n', "must be a table"),
        ('name = "x"\n[compute]\nsms = 3\n', "[memory] capacity_gib"),
    ],
)
def test_bad_grouped_spec_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TilefitError) as info:
        _load(tmp_path, text)
    assert message in str(info.value)


def test_the_cli_prints_a_spec_files_tables_as_written(tmp_path: Path, cli) -> None:
    # an error naming "[memory]" keeps its brackets (they are not rich markup)
    path = tmp_path / "gpu.toml"
    path.write_text('base = "a100-80gb"\n[memory]\ncapacity = 1\n')
    proc = cli("gemm", "64", "64", "64", "--gpu", str(path))
    assert proc.returncode == 2
    assert "given:    [memory] capacity" in proc.stderr
    assert "[memory] keys among capacity_gib" in proc.stderr
