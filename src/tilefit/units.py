"""Bytes and seconds as people read them ("12.32 GiB", "98.78 ms"): the one formatting of
both, for the reports and the results' one-line reprs, and the one reading of a size a
person writes ("64GiB", "500MB"). Torch-free, a leaf."""

from __future__ import annotations

import re

from tilefit.errors import TilefitError

GIB = 1024**3
# Decimal units are powers of 1000 and binary units powers of 1024 (IEC 80000-13).
UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(text: str, *, option: str = "") -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, '123456' -> 123456. ``option``: the
    flag or field the size was given as, named in the error."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    given = f"{option} {text}" if option else repr(text)
    example = f"{option} 64GiB" if option else "24GiB"
    if match is None or unit not in UNITS:
        raise TilefitError(
            "memory size not understood",
            expected="bytes, or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
            given=given,
            fix=f"write it like {example}, 500MB or 2000000",
        )
    value = int(float(match.group(1)) * UNITS[unit])
    if value < 1:
        raise TilefitError("memory size must be positive", expected="at least 1 byte",
                           given=given, fix=f"write it like {example}")
    return value


def fmt_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"
