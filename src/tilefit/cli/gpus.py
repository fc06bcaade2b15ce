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
    from rich import box
    from rich.table import Table

    dtypes = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
    table = Table(title="tilefit device catalog (dense peaks, TFLOP/s)", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=0)
    for col in ("name", "sm", "SMs", "GiB", "TB/s", *dtypes, "align B", "eff"):
        table.add_column(col, justify="left" if col == "name" else "right",
                         no_wrap=True)
    for d in devices:
        cc = "" if d.compute_capability is None else "{}.{}".format(*d.compute_capability)
        peaks = [_tflops(d.peak_flops_per_s[t]) if t in d.peak_flops_per_s else "-"
                 for t in dtypes]
        table.add_row(
            d.name, cc, str(d.sms), f"{d.memory_bytes / 2**30:.0f}",
            f"{d.bandwidth_bytes_per_s / 1e12:.2f}", *peaks, str(d.alignment_bytes),
            f"{d.gemm_efficiency:.2f}",
        )
    console.print(table)
    console.print("sm: compute capability. GiB: memory. TB/s: memory bandwidth. align B: the "
                  "byte multiple GEMM dimensions want. eff: the share of the Tensor Core "
                  "peak a GEMM's main loop runs at (published best matmuls and sweeps; "
                  "`tilefit calibrate` measures your own). Sources: vendor datasheets and "
                  "whitepapers; `tilefit gpus --json` has each device's source and architecture.",
                  highlight=False)


def _tflops(flops_per_s: float) -> str:
    """Peak in TFLOP/s, to the precision datasheets give (15.7, 165.2, 989)."""
    t = flops_per_s / 1e12
    return f"{t:.1f}" if t < 100 else f"{t:.0f}"
