"""`tilefit snapshot FILE`: a real run's PyTorch memory snapshot replayed through tilefit's
model of the caching allocator, and what it would hold under other allocator settings."""

from __future__ import annotations

from typing import Any

import typer

from tilefit.cli.common import JSON_OPTION, console, print_json, user_errors


def register(app: typer.Typer) -> None:
    app.command("snapshot")(snapshot)


def snapshot(
    path: str = typer.Argument(..., help="A pickle written by "
                               "torch.cuda.memory._dump_snapshot after "
                               "_record_memory_history (what pytorch.org/memory_viz reads)."),
    alloc_conf: str = typer.Option(
        "expandable_segments:True", "--alloc-conf",
        help="The PYTORCH_CUDA_ALLOC_CONF to replay the run's requests under."),
    recorded_conf: str = typer.Option(
        "", "--recorded-conf", help="The PYTORCH_CUDA_ALLOC_CONF the run itself used "
        "(default: PyTorch's defaults)."),
    device: int = typer.Option(0, "--device", help="The CUDA device index in the snapshot."),
    gpu: str | None = typer.Option(
        None, "--gpu", help="Also replay against this GPU's memory less the CUDA context: "
        "would the run fit there under --alloc-conf (see `tilefit gpus`)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Replay a real run's memory snapshot under other allocator settings.

    The recorded requests give the reserved memory tilefit's model computes beside the
    snapshot's own segments, and under --alloc-conf (default expandable_segments:True) what
    the same run would reserve."""
    from tilefit.estimator.allocator_history import replay_snapshot

    with user_errors():
        data = _load(path)
        target = None if gpu is None else _gpu(gpu)
        # the recorded requests already include cuBLAS's workspace: the context alone
        limit = None if target is None else target.memory_bytes - target.cuda_context_bytes
        result = replay_snapshot(data, alloc_conf, device, recorded_conf=recorded_conf,
                                 limit_bytes=limit)
    if json_out:
        print_json(result.to_dict())
        return
    mib = 2**20
    console.print(f"{path}, device {device}: {result.requests:,} allocations recorded")
    console.print(f"  reserved as recorded   {result.recorded_reserved_bytes / mib:10.1f} MiB "
                  "(the snapshot's segments)")
    console.print(f"  tilefit's replay       {result.replayed_reserved_bytes / mib:10.1f} MiB "
                  f"({result.recorded_conf or 'PyTorch defaults'})")
    change = result.whatif_reserved_bytes / max(result.replayed_reserved_bytes, 1) - 1
    console.print(f"  with {result.alloc_conf or 'PyTorch defaults'}: "
                  f"{result.whatif_reserved_bytes / mib:.1f} MiB in {result.whatif_segments} "
                  f"segments ({change:+.1%})", highlight=False)
    if target is not None:
        console.print(_line_text(result, target.display_name), highlight=False)
    if not result.complete:
        console.print(f"[yellow]note:[/] the trace begins mid-run ({result.frees_before_trace} "
                      "frees of blocks allocated before it: a late start or the recording's "
                      "max_entries): the replay misses what those blocks held", highlight=False)


def _gpu(name: str) -> Any:
    from tilefit.hardware import get_device

    device = get_device(name)
    if device.kind != "cuda":
        from tilefit.errors import TilefitError

        raise TilefitError("--gpu names the GPU to replay the run against",
                           expected="a CUDA GPU of the catalog (tilefit gpus)", given=name,
                           fix="pass e.g. --gpu rtx-4090")
    return device


def _line_text(result: Any, gpu_name: str) -> str:
    gib = 2**30
    where = (f"  on {gpu_name} ({result.limit_bytes / gib:.2f} GiB for the allocator), with "
             f"{result.alloc_conf or 'PyTorch defaults'}: ")
    if not result.fits:
        return (where + f"OUT OF MEMORY at allocation {result.failed_request:,} of "
                f"{result.requests:,} ({result.failed_bytes / 2**20:.1f} MiB requested)")
    if result.alloc_retries:
        return where + (f"fits only by releasing its cache ({result.alloc_retries} "
                        "allocations retried after a release, each a synchronization)")
    return where + "fits"


def _load(path: str) -> dict:  # type: ignore[type-arg]
    """The snapshot's dict (PyTorch writes it with pickle: load only your own files)."""
    import pickle

    from tilefit.errors import TilefitError

    try:
        with open(path, "rb") as f:
            data = pickle.load(f)  # the user's own snapshot, as memory_viz reads it
    except (OSError, pickle.UnpicklingError, EOFError) as err:
        raise TilefitError(f"cannot read the snapshot {path!r}: {err}",
                           expected="a pickle from torch.cuda.memory._dump_snapshot",
                           given=path, fix="pass the path of the .pickle file") from None
    if not isinstance(data, dict) or "segments" not in data:
        raise TilefitError(f"{path!r} is not a PyTorch memory snapshot",
                           expected="a dict with 'segments' and 'device_traces' "
                           "(torch.cuda.memory._dump_snapshot)",
                           given=type(data).__name__, fix="pass the snapshot's .pickle file")
    return data
