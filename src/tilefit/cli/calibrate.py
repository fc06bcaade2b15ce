"""`tilefit calibrate`: measure GEMMs, bandwidth and call overhead; fit; save the profile."""

from __future__ import annotations

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    device: str = typer.Option("cpu", "--device", help="cpu (this machine) or cuda."),
    quick: bool = typer.Option(False, "--quick", help="A smaller grid (under 3 minutes on "
                               "a 2-core CPU)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Fit the GEMM cost model to this device and store the profile that get_device uses."""
    from tilefit.calibrate.run import calibrate as run_calibration
    from tilefit.calibrate.run import device_kind
    from tilefit.hardware.profiles import save_profile

    with user_errors():
        kind = device_kind(device)
        profile, _samples = run_calibration(
            kind, quick=quick, progress=lambda msg: err_console.print(msg, highlight=False))
        path = save_profile(profile)
    data = profile.to_dict()
    data["path"] = str(path)
    if json_out:
        print_json(data)
        return
    console.print(f"profile saved to {path} ({profile.duration_s:.0f} s)")
    for dt, peak in profile.peak_flops_per_s.items():
        console.print(f"  {dt} peak {peak / 1e9:.0f} GFLOP/s")
    console.print(f"  bandwidth {profile.bandwidth_bytes_per_s / 1e9:.1f} GB/s, call overhead "
                  f"{profile.call_overhead_s * 1e6:.2f} us")
    for g in profile.gemm:
        console.print(f"  {g.dtype}: fit on {g.shapes} shapes, median error "
                      f"{g.median_error:.1%}, p90 {g.p90_error:.1%}")
