"""The device catalog and device lookup (names, aliases, spec files, auto)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tilefit.errors import TilefitError
from tilefit.hardware import get_device, list_devices, load_spec_file

CANONICAL = (
    "v100", "t4", "a10", "a100-40gb", "a100-80gb", "a100-pcie-80gb", "rtx-3090", "rtx-4090",
    "l4", "l40s", "h100-sxm", "h100-pcie", "h200", "b200",
)
DATACENTER_128B = ("a100-40gb", "a100-80gb", "a100-pcie-80gb", "h100-sxm", "h100-pcie", "h200",
                   "b200")


def test_canonical_names_exist() -> None:
    names = {d.name for d in list_devices()}
    missing = set(CANONICAL) - names
    assert not missing, missing
    for name in CANONICAL:
        assert get_device(name).name == name


@pytest.mark.parametrize(
    ("alias", "expected"),
    [("H100", "h100-sxm"), ("h100", "h100-sxm"), ("A100 80GB", "a100-80gb"),
     ("a100 80gb", "a100-80gb"), ("4090", "rtx-4090"), ("NVIDIA A10", "a10"),
     ("GeForce RTX 4090", "rtx-4090"), ("a100_40gb", "a100-40gb")],
)
def test_aliases_resolve_case_insensitively(alias: str, expected: str) -> None:
    assert get_device(alias).name == expected


def test_a100_is_ambiguous_and_lists_candidates() -> None:
    with pytest.raises(TilefitError) as info:
        get_device("a100")
    msg = str(info.value)
    assert "ambiguous" in msg
    for candidate in ("a100-40gb", "a100-80gb", "a100-pcie-80gb"):
        assert candidate in msg


def test_unknown_gpu_suggests_close_matches() -> None:
    with pytest.raises(TilefitError) as info:
        get_device("h1000")
    assert "did you mean" in str(info.value)
    assert "h100" in str(info.value)


@pytest.mark.parametrize("name", DATACENTER_128B)
def test_alignment_128_bytes_on_a100_and_later(name: str) -> None:
    d = get_device(name)
    assert d.alignment_bytes == 128
    # NVIDIA "Matrix Multiplication Background", Table 1: 128 B / element size
    assert d.multiple("fp16") == 64  # 128 / 2
    assert d.multiple("bf16") == 64  # 128 / 2
    assert d.multiple("tf32") == 32  # 128 / 4
    assert d.multiple("fp8") == 128  # 128 / 1
    assert d.multiple("int8") == 128  # 128 / 1


@pytest.mark.parametrize("name", sorted(set(CANONICAL) - set(DATACENTER_128B)))
def test_alignment_16_bytes_elsewhere(name: str) -> None:
    d = get_device(name)
    assert d.alignment_bytes == 16
    assert d.multiple("fp16") == 8  # 16 / 2
    assert d.multiple("tf32") == 4  # 16 / 4
    assert d.multiple("fp8") == 16  # 16 / 1


# Values copied from docs/references.md, section 5 (vendor datasheets, dense peaks).
@pytest.mark.parametrize(
    ("name", "dtype", "tflops", "bandwidth_gbs", "sms"),
    [
        ("a100-40gb", "fp16", 312, 1555, 108),
        ("a100-80gb", "tf32", 156, 2039, 108),
        ("h100-sxm", "bf16", 989, 3350, 132),
        ("h100-sxm", "fp8", 1979, 3350, 132),
        ("h100-pcie", "fp16", 756, 2000, 114),
        ("h200", "bf16", 989, 4800, 132),
        ("v100", "fp16", 125, 900, 80),
        ("t4", "int8", 130, 320, 40),
        ("rtx-4090", "bf16", 165.2, 1008, 128),  # fp32-accumulate rate (Ada whitepaper)
        ("l4", "fp8", 242, 300, 58),
        ("b200", "bf16", 2250, 8000, 148),
    ],
)
def test_peaks_match_reference(name: str, dtype: str, tflops: float, bandwidth_gbs: float,
                               sms: int) -> None:
    d = get_device(name)
    assert d.peak(dtype) == pytest.approx(tflops * 1e12)
    assert d.bandwidth_bytes_per_s == pytest.approx(bandwidth_gbs * 1e9)
    assert d.sms == sms


@pytest.mark.parametrize(("name", "dtype"),
                         [("v100", "bf16"), ("t4", "bf16"), ("v100", "tf32"), ("a100-80gb", "fp8"),
                          ("rtx-3090", "fp8"), ("t4", "fp8")])
def test_missing_dtypes_are_clear_errors(name: str, dtype: str) -> None:
    d = get_device(name)
    assert not d.supports(dtype)
    with pytest.raises(TilefitError) as info:
        d.peak(dtype)
    assert f"no {dtype} math" in str(info.value)
    assert "fix:" in str(info.value)


def test_a100_ops_per_byte() -> None:
    # 312e12 FLOP/s / 1555e9 B/s = 200.64 FLOP/B (FC-layer guide: "about 201")
    assert get_device("a100-40gb").ops_per_byte("fp16") == pytest.approx(200.643, abs=1e-3)


# ---- spec files ------------------------------------------------------------------------------

def _write(tmp_path: Path, text: str, name: str = "gpu.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_spec_file_with_base_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = _write(tmp_path, 'base = "a100-80gb"\nname = "my-a100"\nsms = 100\n'
                            "[peak_flops_per_s]\nfp16 = 300e12\n")
    d = get_device(str(path))
    assert d.name == "my-a100"
    assert d.sms == 100
    assert d.peak("fp16") == 300e12
    # untouched entries come from the base (A100 datasheet: 19.5 TFLOP/s fp32, 2039 GB/s)
    assert d.peak("fp32") == pytest.approx(19.5e12)
    assert d.bandwidth_bytes_per_s == pytest.approx(2039e9)
    assert d.alignment_bytes == 128
    assert str(path) in d.source


def test_spec_file_without_base(tmp_path: Path) -> None:
    path = _write(tmp_path, 'name = "mygpu"\nsms = 64\nmemory_bytes = 25769803776\n'
                            "bandwidth_bytes_per_s = 1.0e12\n"
                            "[peak_flops_per_s]\nfp32 = 20e12\nfp16 = 150e12\n")
    d = load_spec_file(path)
    assert (d.name, d.sms, d.alignment_bytes) == ("mygpu", 64, 16)
    assert d.ops_per_byte("fp16") == pytest.approx(150.0)  # 150e12 / 1e12
    assert not d.supports("bf16")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\nsmz = 3\n', "unknown keys"),
        ('name = "x"\nsms = 3\n', "lacks required keys"),
        ('base = "a100-80gb"\nsms = -1\n', "bad value"),
        ('base = "a100-80gb"\nalignment_bytes = 64\n', "bad value"),
        ('base = "a100-80gb"\n[peak_flops_per_s]\nfp64 = 1e12\n', "bad value"),
        ('base = "a100-80gb"\nsms = "many"\n', "bad value"),
        ('base = "a100-80gb"\nsms = \n', "not valid TOML"),
        ('base = "no-such-gpu"\n', "unknown GPU"),
    ],
)
def test_bad_spec_files(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(TilefitError) as info:
        get_device(str(path))
    assert message in str(info.value)


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(TilefitError, match="does not exist"):
        get_device(str(tmp_path / "nope.toml"))


def test_spec_file_from_the_cli(tmp_path: Path, cli) -> None:
    path = _write(tmp_path, 'base = "h100-sxm"\nname = "h100-slow"\n'
                            "bandwidth_bytes_per_s = 1.0e12\n")
    proc = cli("gemm", "128", "4096", "4096", "--gpu", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["gpu"] == "h100-slow"
    assert data["ops_per_byte"] == pytest.approx(989.0)  # 989e12 FLOP/s / 1e12 B/s
    bad = _write(tmp_path, 'name = "x"\nsmz = 3\n', "bad.toml")
    proc = cli("gemm", "64", "64", "64", "--gpu", str(bad))
    assert proc.returncode == 2
    assert "unknown keys" in proc.stderr and "smz" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_gpu_auto(cli) -> None:
    proc = cli("gemm", "64", "64", "64", "--gpu", "auto", "--json")
    if proc.returncode == 0:  # a machine with a catalogued CUDA GPU
        assert json.loads(proc.stdout)["gpu"] in {d.name for d in list_devices()}
    else:
        assert proc.returncode == 2
        assert "no CUDA GPU" in proc.stderr or "not in the catalog" in proc.stderr
        assert "--gpu" in proc.stderr  # the fix names the option
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""


def test_device_to_dict_is_plain_data() -> None:
    d = get_device("h200").to_dict()
    assert d["peak_flops_per_s"]["bf16"] == pytest.approx(989e12)
    assert d["compute_capability"] == "9.0"
    assert d["memory_bytes"] == 141 * 2**30  # datasheet GB read as GiB (catalog.py)
    json.dumps(d)  # serialisable as is
