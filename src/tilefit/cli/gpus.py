"""`tilefit gpus`: the device catalog."""

from __future__ import annotations

import typer

from tilefit.cli.common import JSON_OPTION, console, print_json


def register(app: typer.Typer) -> None:
    app.command("gpus")(gpus)


def gpus(json_out: bool = JSON_OPTION) -> None:
    """List the device catalog: memory, bandwidth, SMs, dense peaks per dtype, alignment."""
    from tilefit.hardware import list_devices

    devices = list_devices()
    if json_out:
        print_json([d.to_dict() for d in devices])
        return
    from rich.table import Table

    dtypes = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
    table = Table(title="tilefit device catalog (dense peaks, TFLOP/s)")
    for col in ("name", "arch", "sm", "SMs", "memory GiB", "TB/s", *dtypes, "align B"):
        table.add_column(col, justify="left" if col in ("name", "arch") else "right")
    for d in devices:
        cc = "" if d.compute_capability is None else "{}.{}".format(*d.compute_capability)
        peaks = [
            f"{d.peak_flops_per_s[t] / 1e12:.1f}" if t in d.peak_flops_per_s else "-"
            for t in dtypes
        ]
        table.add_row(
            d.name, d.architecture, cc, str(d.sms), f"{d.memory_bytes / 2**30:.0f}",
            f"{d.bandwidth_bytes_per_s / 1e12:.2f}", *peaks, str(d.alignment_bytes),
        )
    console.print(table)
    console.print("Sources: vendor datasheets and whitepapers; `tilefit gpus --json` has each "
                  "device's source.")
