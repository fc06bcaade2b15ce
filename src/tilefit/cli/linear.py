"""`tilefit linear --in I --out O --batch B[,B2,...]`: a linear layer's three training GEMMs."""

from __future__ import annotations

import typer

from tilefit.cli.common import GPU_HELP, JSON_OPTION, console, err_console, print_json, user_errors


def register(app: typer.Typer) -> None:
    app.command("linear", help=HELP)(linear)


HELP = (
    "A linear layer's three training GEMMs per batch size and the batch to choose.\n\n"
    "For each batch size (tokens T = batch x seq): forward (M=T, N=out, K=in), activation "
    "gradient (M=T, N=in, K=out) and weight gradient (M=out, N=in, K=T), their totals, the "
    "smallest batch from which all three are math-bound, and which batch sizes are aligned."
)


def linear(
    in_features: str = typer.Option(..., "--in", help="Input features (K of forward)."),
    out_features: str = typer.Option(..., "--out", help="Output features (N of forward)."),
    batch: str = typer.Option(..., "--batch", help="Batch size(s), comma-separated: 8,64,256."),
    seq: str = typer.Option("1", "--seq", help="Tokens per sample: T = batch x seq."),
    dtype: str = typer.Option("fp16", "--dtype", help="fp16, bf16, tf32, fp32, fp8 or int8."),
    gpu: str = typer.Option("a100-80gb", "--gpu", help=GPU_HELP),
    json_out: bool = JSON_OPTION,
    plot: str | None = typer.Option(
        None, "--plot", help="Write a PNG of predicted TFLOP/s against batch size to this file."
    ),
) -> None:
    """A linear layer's three training GEMMs per batch size and the batch to choose."""
    from tilefit.hardware import get_device
    from tilefit.linear import analyze_linear, plot_batches

    with user_errors():
        in_f = parse_positive("--in", in_features)
        out_f = parse_positive("--out", out_features)
        seq_n = parse_positive("--seq", seq)
        batches = parse_batches(batch)
        device = get_device(gpu)
        result = analyze_linear(in_f, out_f, batches, seq=seq_n, dtype=dtype, device=device)
        if plot is not None:
            from tilefit.report.plots import plot_linear

            sweep = analyze_linear(in_f, out_f, plot_batches(result), seq=seq_n, dtype=dtype,
                                   device=device)
            written = plot_linear(sweep, plot, highlight=result.batches)
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)
    if plot is not None:
        (err_console if json_out else console).print(f"plot written to {written}", highlight=False)


def parse_positive(option: str, text: str) -> int:
    """A whole number >= 1 from the command line, or a TilefitError naming the option."""
    from tilefit.errors import TilefitError

    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise TilefitError(
            f"{option} must be a positive whole number",
            expected="an integer >= 1",
            given=repr(text),
            fix=f"pass {option} as a count, e.g. {option} 4096" if option != "--seq"
            else "pass --seq as tokens per sample, e.g. --seq 2048 (1 for plain batches)",
        )
    return value


def parse_batches(text: str) -> list[int]:
    """``"8,64,128"`` -> [8, 64, 128]; each must be a positive whole number."""
    from tilefit.errors import TilefitError

    parts = [p.strip() for p in str(text).split(",")]
    out: list[int] = []
    for p in parts:
        try:
            value = int(p)
        except ValueError:
            value = 0
        if value <= 0:
            raise TilefitError(
                "--batch must be positive whole numbers separated by commas",
                expected="e.g. --batch 8,64,256",
                given=repr(text) + (f" (bad item {p!r})" if p != text else ""),
                fix="list batch sizes >= 1 with commas and no other characters",
            )
        out.append(value)
    return out


_PHASE_NAMES = {"forward": "fwd", "activation_grad": "dgrad", "weight_grad": "wgrad"}


def render(a: object) -> None:
    from rich import box
    from rich.table import Table

    from tilefit.linear import LinearAnalysis

    assert isinstance(a, LinearAnalysis)
    recs = a.recommendations
    seq_note = f", seq {a.seq}" if a.seq > 1 else ""
    t = Table(
        title=f"Linear {a.in_features} -> {a.out_features}{seq_note}, {a.dtype} on {a.gpu}\n"
        f"peak {a.rows[0].gemm.peak_tflops:.0f} TFLOP/s, math-bound above "
        f"{recs.ops_per_byte:.0f} FLOP/B",
        box=box.SIMPLE_HEAD, pad_edge=False, padding=0,
    )
    cols = ["batch", *(["tokens"] if a.seq > 1 else []), "GEMM", "M x N x K", "align",
            "tile", "wave", "time us", "TFLOP/s"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("GEMM", "M x N x K") else "right",
                     no_wrap=True)
    for total in a.totals:
        rows = a.rows_for(total.batch)
        for i, r in enumerate(rows):
            g = r.gemm
            first = [str(r.batch), *([str(r.tokens)] if a.seq > 1 else [])]
            t.add_row(
                *(first if i == 0 else [""] * len(first)),
                _PHASE_NAMES[r.phase], f"{g.m}x{g.n}x{g.k}",
                "[red]ERROR[/]" if g.error else
                (f"{g.alignment_efficiency:.0%}" if g.alignment_efficiency < 1 else "ok"),
                f"{g.tile_efficiency:.0%}", f"{g.wave_efficiency:.0%}",
                f"{g.predicted_time_s * 1e6:.1f}", f"{g.predicted_tflops:.1f}",
            )
        # the three GEMMs share one arithmetic intensity (see tilefit.linear), so one bound
        intensity = rows[0].gemm.arithmetic_intensity
        style = "green" if total.bound == "math" else "yellow"
        blank = [""] * (1 + (a.seq > 1))
        t.add_row(*blank, "[bold]total[/]", f"[{style}]{intensity:.1f} FLOP/B, {total.bound}[/]",
                  "", "", "", f"[bold]{total.predicted_time_s * 1e6:.1f}[/]",
                  f"[bold]{total.predicted_tflops:.1f}[/]", end_section=True)
    console.print(t)
    console.print(
        "fwd: y = x W^T (M=T, N=out, K=in); dgrad: dx (M=T, N=in, K=out); "
        "wgrad: dW (M=out, N=in, K=T). align: modelled speed factor of the worst-aligned "
        "dimension; tile, wave: tile and wave quantization efficiency.",
        style="dim", highlight=False,
    )
    for e in sorted({r.gemm.error for r in a.rows if r.gemm.error}):
        console.print(f"[red]error:[/] {e}", highlight=False)
    for note in recs.notes:
        console.print(f"- {note}", highlight=False)
