"""Bytes and seconds as people read them ("12.32 GiB", "98.78 ms"): the one formatting of
both, for the reports and the results' one-line reprs. Torch-free, a leaf."""

from __future__ import annotations

GIB = 1024**3


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
