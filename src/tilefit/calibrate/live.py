"""The live device a calibration or a bench measures: ``--device cpu|cuda``, checked (cuda
only where there is a CUDA GPU), uncalibrated or with its stored profile."""

from __future__ import annotations

from tilefit.errors import TilefitError
from tilefit.hardware.device import Device


def live_device(kind: str) -> Device:
    """The uncalibrated live device of ``kind`` ("cpu" or "cuda"); a clear error otherwise."""
    from tilefit.hardware.cpu import cpu_device
    from tilefit.hardware.lookup import detect_live_device

    if kind == "cpu":
        return cpu_device()  # no profile: the probe's figures
    if kind == "cuda":
        require_cuda()
        return detect_live_device(use_profile=False)
    raise TilefitError(f"unknown device kind {kind!r}", expected="cpu or cuda", given=kind,
                       fix="pass --device cpu or --device cuda")


def device_kind(text: str) -> str:
    """"cpu" or "cuda" from --device, or a clear error (and cuda only where there is one)."""
    kind = str(text).strip().lower()
    if kind not in ("cpu", "cuda"):
        from tilefit.errors import close_matches

        near = close_matches(kind, ["cpu", "cuda"])
        raise TilefitError(f"unknown --device {text!r}", expected="cpu or cuda",
                           given=repr(text), fix=(f"did you mean {near[0]}? " if near else "")
                           + "pass --device cpu or --device cuda")
    if kind == "cuda":
        require_cuda()
    return kind


def live_kind_device(text: str) -> Device:
    """The live device for --device cpu|cuda, with its calibration profile when stored."""
    from tilefit.hardware.lookup import get_device

    return get_device(device_kind(text))


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise TilefitError(
            "--device cuda needs a CUDA GPU, and this machine has none",
            expected="a machine with an NVIDIA GPU and a CUDA build of PyTorch",
            given=f"torch {torch.__version__}, torch.cuda.is_available() is False",
            fix="run on the GPU machine, or use --device cpu",
        )
