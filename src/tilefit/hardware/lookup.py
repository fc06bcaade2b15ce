"""Finding a Device: by catalog name or alias, from a user's TOML spec file, or the live GPU.

A named or live device comes with its stored calibration, read through one function,
``tilefit.hardware.profiles.stored_profile`` (once per process per profile file).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from tilefit.errors import TilefitError, close_matches
from tilefit.hardware.catalog import CATALOG, INTERCONNECTS
from tilefit.hardware.device import Device
from tilefit.hardware.profiles import stored_profile
from tilefit.hardware.spec_format import FILE_KEY, device_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_VENDOR_WORDS = ("nvidia-", "geforce-", "tesla-")


def normalize(name: str) -> str:
    """Lower case, runs of spaces/underscores/dashes as one dash, vendor words dropped."""
    key = re.sub(r"[\s_\-]+", "-", name.strip().lower())
    for word in _VENDOR_WORDS:
        key = key.replace(word, "") if key.startswith(word) else key
    return key.strip("-")


def _keys(device: Device) -> list[str]:
    return [normalize(device.name), *(normalize(a) for a in device.aliases)]


def compact(key: str) -> str:
    """A normalized name without its dashes: "rtx4090" and "rtx-4090" are one name."""
    return key.replace("-", "")


_BY_KEY: dict[str, Device] = {k: d for d in CATALOG for k in _keys(d)}
_BY_COMPACT: dict[str, Device] = {compact(k): d for k, d in _BY_KEY.items()}


def _exact(key: str) -> Device | None:
    """The entry a normalized name names, with or without its dashes."""
    return _BY_KEY.get(key) or _BY_COMPACT.get(compact(key))


# GPUs people name that the catalog leaves out, why, and the catalog part to start a spec
# file from (docs/references.md, section 5, "Left out")
_LEFT_OUT: dict[str, tuple[str, str]] = {
    "a10g": ("AWS's A10G (G5 instances) has no NVIDIA datasheet and public tables disagree "
             "on its Tensor Core rate", "a10"),
    "h20": ("the H20's unofficial datasheet gives an fp32 rate its 78 SMs cannot reach at "
            "any published clock", "h100-sxm"),
    "h800": ("the H800 has no NVIDIA datasheet", "h100-sxm"),
    "a800": ("the A800 has no NVIDIA datasheet", "a100-80gb"),
    "b100": ("NVIDIA has not published the B100's SM count", "b200"),
    "gb200": ("NVIDIA has not published the GB200's SM count", "b200"),
    "b300": ("NVIDIA has not published the B300's SM count", "b200"),
    "gb300": ("NVIDIA has not published the GB300's SM count", "b200"),
}


def _left_out_error(text: str, key: str) -> TilefitError | None:
    """The error for a GPU the catalog leaves out on purpose: why, and where to start."""
    entry = _LEFT_OUT.get(compact(key))
    if entry is None:
        return None
    why, base = entry
    return TilefitError(
        f"GPU {text!r} is not in tilefit's catalog: {why}, so tilefit has no figures to cite",
        expected="a catalog name or alias (see `tilefit gpus`), a .toml spec file, or auto",
        given=repr(text),
        fix=f'describe it in a TOML file that starts from the nearest catalog part, '
        f'base = "{base}", with the figures you trust (README, "TOML spec format"), and pass '
        "its path")


def list_devices() -> tuple[Device, ...]:
    return CATALOG


def get_device(spec: str | Device) -> Device:
    """A Device from a catalog name, an alias, a TOML spec file path, or ``"auto"``.

    Aliases are matched case-insensitively. A name that is the start of several devices'
    names (``"a100"``) is ambiguous and the error lists the candidates.
    """
    if isinstance(spec, Device):
        return spec
    text = str(spec).strip()
    if text.lower() == "auto":
        return detect_live_device()
    if text.lower() in ("cpu", "host"):  # this machine's CPU, measured or calibrated
        from tilefit.hardware.cpu import cpu_device

        return cpu_device(stored_profile("cpu"))
    if text.lower() == "cuda":  # the live GPU, whatever it is
        return detect_live_device()
    if text.lower().endswith(".toml") or Path(text).is_file():
        return load_spec_file(Path(text))
    key = normalize(text)
    exact = _exact(key)
    if exact is not None:
        return with_profile(exact)
    prefixed = sorted({d.name for k, d in _BY_KEY.items() if k.startswith(key + "-")})
    if len(prefixed) == 1:
        return with_profile(_BY_KEY[prefixed[0]])
    if len(prefixed) > 1:
        raise TilefitError(
            f"GPU name {text!r} is ambiguous",
            expected="one catalog name",
            given=f"{text!r}, which matches: {', '.join(prefixed)}",
            fix=f"say which one, e.g. estimate(..., gpu={prefixed[0]!r})",
        )
    left_out = _left_out_error(text, key)
    if left_out is not None:
        raise left_out
    near = _near_devices(key)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    raise TilefitError(
        f"unknown GPU {text!r}",
        expected="a catalog name or alias (see `tilefit gpus`), a .toml spec file, or auto",
        given=repr(text),
        fix=f"{hint}run `tilefit gpus` for the list, or describe your GPU in a TOML file "
        "(see the README) and pass its path",
    )


def _near_devices(key: str, n: int = 3) -> list[str]:
    """The catalog names of the devices whose name or an alias is nearest to ``key``, one per
    device (its aliases spell the same GPU several ways), best first."""
    near = close_matches(key, list(_BY_KEY), n=len(_BY_KEY))
    return list(dict.fromkeys(_BY_KEY[k].name for k in near))[:n]


# the Device fields a spec file without ``base`` must give
_REQUIRED = ("name", "sms", "memory_bytes", "bandwidth_bytes_per_s", "peak_flops_per_s")


def load_spec_file(path: Path) -> Device:
    """A Device from a user's TOML file, in the catalog's format (tilefit.hardware.spec_format;
    the flat format of earlier releases is read too).

    ``base = "a100-80gb"`` starts from a catalog entry and overrides what the file gives;
    without ``base`` the file must give name, [compute] sms and dense_tflops, and [memory]
    capacity_gib and bandwidth_gb_per_s.
    """
    data = _read_spec(path)
    base_name = data.pop("base", None)
    data = device_fields(data, f"GPU spec file {str(path)!r}", INTERCONNECTS)
    try:
        if base_name is not None:
            return _from_base(get_device(str(base_name)), data, path)
        return _from_scratch(data, path)
    except (ValueError, TypeError) as exc:
        raise TilefitError(
            f"GPU spec file {str(path)!r} has a bad value",
            expected="positive numbers; alignment_bytes 16 or 128; efficiencies in (0, 1]",
            given=str(exc),
            fix="correct the value named above",
        ) from None


def _read_spec(path: Path) -> dict[str, Any]:
    """The spec file's TOML table, or an error saying the file is missing or not TOML."""
    if not path.is_file():
        raise TilefitError(
            f"GPU spec file {str(path)!r} does not exist",
            expected="a path to a TOML file, or a catalog name",
            given=str(path),
            fix="check the path, or run `tilefit gpus` for catalog names",
        )
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TilefitError(
            f"GPU spec file {str(path)!r} is not valid TOML",
            expected="TOML: key = value lines, and tables such as [compute]",
            given=str(exc),
            fix="fix the line the parser names",
        ) from None


def _from_base(base: Device, data: dict[str, Any], path: Path) -> Device:
    """The catalog entry with the file's fields; a peak table in the file overrides the
    base's entries one dtype at a time."""
    if isinstance(data.get("peak_flops_per_s"), dict):
        data["peak_flops_per_s"] = {**base.peak_flops_per_s, **data["peak_flops_per_s"]}
    if "name" in data:
        data.setdefault("display_name", data["name"])
    overridden = ", ".join(sorted(data)) or "nothing"
    data.setdefault("source", f"{base.source}; {overridden} from user spec file {path}")
    return dataclasses.replace(base, **data)


def _from_scratch(data: dict[str, Any], path: Path) -> Device:
    """A Device from the file alone: it must give every required field."""
    missing = [FILE_KEY.get(k, k) for k in _REQUIRED if k not in data]
    if missing:
        raise TilefitError(
            f"GPU spec file {str(path)!r} lacks required keys",
            expected=", ".join(FILE_KEY.get(k, k) for k in _REQUIRED)
            + " (or base = \"<catalog name>\")",
            given="missing " + ", ".join(missing),
            fix='add them, or start from a catalog entry with base = "a100-80gb"',
        )
    data.setdefault("display_name", data["name"])
    data.setdefault("architecture", "unknown")
    data.setdefault("compute_capability", None)
    data.setdefault("source", f"user spec file {path}")
    return Device(**data)


def match_catalog(device_name: str, memory_bytes: int | None = None) -> Device | None:
    """The catalog entry for a name as CUDA reports it ("NVIDIA A100-SXM4-80GB").

    CUDA names carry extra words ("NVIDIA H100 80GB HBM3"): without an exact match, the
    longest known name that the reported one starts with. One product name may cover
    several memory sizes ("NVIDIA GeForce RTX 4060 Ti": 8 and 16 GB); ``memory_bytes`` (the
    live device's) picks the entry nearest to it.
    """
    key = normalize(device_name)
    exact = _exact(key)
    sized = {d.name: d for k, d in _BY_KEY.items() if re.fullmatch(re.escape(key) + r"-\d+gb", k)}
    if exact is not None and not (sized and memory_bytes):
        return exact
    if sized:
        if exact is not None:
            sized[exact.name] = exact
        if memory_bytes:
            return min(sized.values(), key=lambda d: abs(d.memory_bytes - memory_bytes))
        return next(iter(sized.values())) if len(sized) == 1 else None
    best = max((k for k in _BY_KEY if key.startswith(k + "-")), key=len, default=None)
    return _BY_KEY[best] if best else None


def detect_live_device(index: int = 0, *, use_profile: bool = True) -> Device:
    """The live CUDA device: name, SM count and memory read from it, peaks from the catalog."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is None or not torch.cuda.is_available():
        raise TilefitError(
            "gpu='auto' found no CUDA GPU on this machine",
            expected="a machine with an NVIDIA GPU and a CUDA build of PyTorch",
            given="no CUDA device" if torch is not None else "PyTorch is not installed",
            fix="name the GPU to predict for, e.g. estimate(..., gpu='a100-80gb') (`tilefit "
            "gpus` lists them)",
        )
    props = torch.cuda.get_device_properties(index)
    base = match_catalog(props.name, props.total_memory)
    if base is None:
        raise TilefitError(
            f"the live GPU {props.name!r} is not in the catalog, so its peak FLOP/s are unknown",
            expected="a GPU listed by `tilefit gpus`",
            given=props.name,
            fix="describe it in a TOML spec file (base = the nearest catalog entry) and pass "
            "estimate(..., gpu='path/to/spec.toml')",
        )
    live = dataclasses.replace(
        base,
        display_name=props.name,
        sms=props.multi_processor_count,
        memory_bytes=props.total_memory,
        source=base.source + "; SM count and memory read from the live device",
    )
    return with_profile(live) if use_profile else live


def with_profile(device: Device) -> Device:
    """``device`` with its calibration profile's fitted terms, when `tilefit calibrate` stored
    one for it (profiles/<name>.json in the cache directory); else ``device`` unchanged."""
    profile = stored_profile(device.name)
    if profile is None or profile.kind != device.kind:
        return device
    # gemm_efficiency stays the catalog's: tilefit.gemm reads each dtype's fitted efficiency
    # from the profile, and a dtype the calibration did not measure keeps the catalog value.
    fits = [g for g in profile.gemm if g.gemm_efficiency is not None]
    main = next((g for g in fits if g.dtype == "bf16"), fits[0] if fits else None)
    changes: dict[str, Any] = {
        "profile": profile,
        "source": f"{device.source}; calibrated profile {profile.path} from {profile.date()}",
    }
    if main is not None:  # one launch cost for every kernel
        changes["launch_overhead_s"] = main.call_overhead_s
    if profile.bandwidth_bytes_per_s > 0:
        changes["bandwidth_efficiency"] = min(
            1.0, profile.bandwidth_bytes_per_s / device.bandwidth_bytes_per_s)
    if profile.host is not None:  # this machine's own host, measured by calibrate
        changes["host"] = profile.host
    return dataclasses.replace(device, **changes)
