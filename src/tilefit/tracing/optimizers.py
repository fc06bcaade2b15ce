"""Optimizers by name, built the way the target device would run them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tilefit.errors import TilefitError
from tilefit.vocab import OPTIMIZER_NAMES, PAGED_OPTIMIZERS

__all__ = [
    "BNB_CLASSES",
    "OPTIMIZER_NAMES",
    "OptimizerSpec",
    "bnb_optimizer",
    "host_step_counters",
    "make_optimizer",
    "optimizer_state_tensors",
    "paged_note",
]

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

# bitsandbytes' optimizers by name (vocab.BNB_OPTIMIZERS): the library's own classes
BNB_CLASSES = {"adamw-8bit": "AdamW8bit", "paged-adamw-8bit": "PagedAdamW8bit",
               "paged-adamw": "PagedAdamW"}


def bnb_optimizer(name: str, params: list[torch.nn.Parameter], lr: float
                  ) -> torch.optim.Optimizer:
    """bitsandbytes' own optimizer, its 8-bit quantization maps built on the real CPU first
    (it builds them with ``.tolist()``, which fake tensors cannot answer; 256 values each).
    Its state, as init_state allocates it: two uint8 moments and one fp32 absmax per 256
    values for a tensor of at least min_8bit_size = 4096 values, two fp32 moments below; on
    fake (CPU) tensors the paged variants allocate the same state with zeros_like, as
    bitsandbytes does on a CPU (tilefit.tracing.step notes where it would be paged)."""
    from tilefit.compat.bitsandbytes import quiet_paged_fallback, require_bitsandbytes
    from tilefit.compat.fake import unset_fake_temporarily

    bnb = require_bitsandbytes(f"optimizer {name!r}")
    with unset_fake_temporarily():  # its constructor reads its maps' values too
        opt = getattr(bnb.optim, BNB_CLASSES[name])(params, lr=lr)
        if hasattr(opt, "fill_qmap"):
            opt.fill_qmap()
    quiet_paged_fallback(opt)
    return opt  # type: ignore[no-any-return]


# bitsandbytes pages a state buffer (cudaMallocManaged) only for tensors of 1e5 values or more
# (bitsandbytes 0.50.2, optim/optimizer.py Optimizer8bit.get_state_buffer)
BNB_PAGED_MIN_NUMEL = 100_000


def paged_note(name: object, opt: torch.optim.Optimizer) -> str | None:
    """What a paged optimizer's state means for the memory line, or None."""
    if name not in PAGED_OPTIMIZERS:
        return None
    paged = sum(t.nbytes for p, state in opt.state.items() if p.numel() >= BNB_PAGED_MIN_NUMEL
                for t in state.values() if isinstance(t, torch.Tensor))
    return (f"{name}: {paged / 2**20:.1f} MiB of optimizer state is paged (CUDA unified "
            "memory, outside PyTorch's caching allocator): it is counted in the peak as if "
            "resident, but under memory pressure the driver evicts it to host memory "
            "instead of failing, so a step over the line by up to that much still runs, "
            "paging over PCIe")


def make_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter], *,
                   foreach: bool | None) -> torch.optim.Optimizer:
    """The optimizer a name stands for, with tilefit's default hyper-parameters (they do not
    change what the step allocates or moves), or the factory's product."""
    if callable(spec) and not isinstance(spec, str):
        return spec(params)
    name = str(spec).lower()
    lr = 1e-4
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if name == "adamw-fused":  # one multi-tensor kernel for the whole update
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise TilefitError(
                "optimizer 'adafactor' needs torch.optim.Adafactor (PyTorch 2.5 or later)",
                expected="torch >= 2.5", given=f"torch {torch.__version__}",
                fix="upgrade PyTorch, or pass a factory: optimizer=lambda ps: MyAdafactor(ps)")
        return torch.optim.Adafactor(params, lr=1e-2, foreach=foreach)
    if name in BNB_CLASSES:
        return bnb_optimizer(name, params, lr)
    raise TilefitError(
        f"unknown optimizer {spec!r}",
        expected="one of " + ", ".join(OPTIMIZER_NAMES) + ", or a factory params -> Optimizer",
        given=repr(spec),
        fix="pass one of the names above",
    )


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def host_step_counters(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The step counters a CUDA run of ``opt`` keeps in host memory: torch.optim keeps each
    parameter's ``step`` as a CPU scalar unless the group is fused or capturable (its
    ``_init_group``), so incrementing and reading it launches no kernel and never waits
    for the GPU."""
    out: list[torch.Tensor] = []
    for group in opt.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                out.append(step)
    return out
