"""`tilefit gemm M N K`: one GEMM analysed on one device."""

from __future__ import annotations

import typer

from tilefit.cli.common import GPU_HELP, JSON_OPTION, console, print_json, user_errors


def register(app: typer.Typer) -> None:
    app.command("gemm")(gemm)


def gemm(
    m: str = typer.Argument(..., help="Rows of the output (tokens, for a linear layer)."),
    n: str = typer.Argument(..., help="Columns of the output."),
    k: str = typer.Argument(..., help="The reduction dimension."),
    dtype: str = typer.Option("fp16", "--dtype", help="fp16, bf16, tf32, fp32, fp8 or int8."),
    gpu: str = typer.Option("a100-80gb", "--gpu", help=GPU_HELP),
    json_out: bool = JSON_OPTION,
) -> None:
    """Analyse C(MxN) = A(MxK) @ B(KxN): bound, alignment, tiles, waves, predicted time."""
    from tilefit.gemm import analyze_gemm
    from tilefit.hardware import get_device

    with user_errors():
        dims = parse_dims(m=m, n=n, k=k)
        result = analyze_gemm(dims["m"], dims["n"], dims["k"], dtype, get_device(gpu))
    if json_out:
        print_json(result.to_dict())
        return
    render(result)


def parse_dims(**raw: str) -> dict[str, int]:
    """Whole positive numbers from the command line, or a TilefitError naming the bad one."""
    from tilefit.errors import TilefitError

    out: dict[str, int] = {}
    for name, text in raw.items():
        try:
            value = int(str(text).strip())
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise TilefitError(
                f"{name.upper()} must be a positive whole number",
                expected="an integer >= 1",
                given=repr(text),
                fix=f"pass {name.upper()} as a count of elements, e.g. 4096",
            )
        out[name] = value
    return out


def render(a: object) -> None:
    from rich.table import Table

    from tilefit.gemm import GemmAnalysis

    assert isinstance(a, GemmAnalysis)
    t = Table(title=f"GEMM {a.m} x {a.n} x {a.k}, {a.dtype} on {a.gpu}", show_header=False)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("FLOPs", f"{a.flops:.4g}")
    t.add_row("bytes moved", f"{a.bytes:.4g}")
    t.add_row("arithmetic intensity", f"{a.arithmetic_intensity:.2f} FLOP/B")
    t.add_row("device ops:byte", f"{a.ops_per_byte:.2f} FLOP/B")
    t.add_row("bound", a.bound)
    for name, al in a.alignment.items():
        mark = "aligned" if al.aligned else f"NOT aligned -> {al.suggested} ({al.factor:.0%} speed)"
        t.add_row(f"{name} (multiple of {al.multiple})", mark)
    t.add_row("tile (model)", f"{a.tile[0]}x{a.tile[1]}" + (f", split-K {a.split_k}"
                                                            if a.split_k > 1 else ""))
    t.add_row("tile efficiency", f"{a.tile_efficiency:.1%}")
    t.add_row("tiles / waves", f"{a.tiles} / {a.waves}")
    t.add_row("wave efficiency", f"{a.wave_efficiency:.1%}")
    if a.epilogue_time_s > 0:  # a GPU: main loops, then the tiles' stores; operand traffic
        t.add_row("main loops + output stores",
                  f"{a.math_time_s * 1e6:.2f} + {a.epilogue_time_s * 1e6:.2f} us")
        t.add_row("operand traffic", f"{a.memory_time_s * 1e6:.2f} us")
    t.add_row("predicted time", f"{a.predicted_time_s * 1e6:.2f} us")
    t.add_row("predicted TFLOP/s", f"{a.predicted_tflops:.1f} of {a.peak_tflops:.0f} peak")
    console.print(t)
    style = "red" if a.error else ("yellow" if "efficient" not in a.verdict else "green")
    console.print(f"[{style}]{a.verdict}[/]", highlight=False)
