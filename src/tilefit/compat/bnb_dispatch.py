"""Which kernel bitsandbytes' ``gemm_4bit`` runs, and the dense buffers its fallback holds.

On a CUDA GPU the ``bitsandbytes::gemm_4bit`` kernel (bitsandbytes 0.50.2,
``backends/cuda/ops.py``) runs its fused 4-bit GEMM, which reads the packed weight inside the
GEMM, or ``_dequant_linear_fallback``: the whole weight dequantized into a dense buffer of
A's dtype, then ``F.linear``. The fallback runs past ``_gemm_4bit_custom_max_m`` rows (1536),
for an inner dimension that is not a multiple of the block, and wherever
``_gemm_4bit_use_custom_cuda`` (calibrated per architecture from M, N, K, the dtype and the
GPU's SMs) prefers it -- for most training shapes. On the CPU the default kernel always
dequantizes first (``backends/default/ops.py``, ``_gemm_4bit_default_impl``).

``backends/cuda/ops.py`` imports only on a CUDA build of torch, so its rule (the function
and its two constants) is read from the installed source and run with the target GPU's
properties in place of ``torch.cuda.get_device_properties``. docs/references.md, section 33.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tilefit.compat import probes

__all__ = ["CUSTOM_MAX_M", "dense_buffers", "gemm_4bit_dequantizes", "gpu_props"]

CUSTOM_MAX_M = 1536  # _gemm_4bit_custom_max_m on CUDA, bitsandbytes 0.50.2
_RULE = "_gemm_4bit_use_custom_cuda"
_FLOOR = "_GEMM_4BIT_CUSTOM_FLOOR_M"
_MAX_M = "_gemm_4bit_custom_max_m"
GpuProps = tuple[int, int, int]  # (SMs, compute capability major, minor)


@functools.cache
def _cuda_rule() -> tuple[Callable[..., bool], int] | None:
    """bitsandbytes' own choice of kernel and its M cap, compiled from its source; None
    where that source is absent or no longer has them (the cap alone then decides)."""
    try:
        spec = importlib.util.find_spec("bitsandbytes.backends.cuda.ops")
    except ImportError:  # bitsandbytes is not installed
        return None
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse(Path(spec.origin).read_text())
    rule = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == _RULE),
                None)
    values: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "torch.version.hip is None":
            _assigned(node.body, values)  # the CUDA branch (ROCm's is the else)
        _assigned([node], values)
    if rule is None or _FLOOR not in values or _MAX_M not in values:
        return None
    rule.decorator_list = []  # functools.cache keys on a device index we do not have
    namespace: dict[str, Any] = {"torch": torch, _FLOOR: values[_FLOOR],
                                 "_gpu_dispatch_props": lambda props: props}
    exec(compile(ast.Module([rule], []), spec.origin, "exec"), namespace)
    return namespace[_RULE], values[_MAX_M]


def _assigned(body: list[ast.stmt], values: dict[str, int]) -> None:
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant):
            values.setdefault(node.targets[0].id, node.value.value)


def gpu_props(device: Any) -> GpuProps | None:
    """What bitsandbytes reads of the GPU (tilefit.hardware.Device's SMs and compute
    capability); None for the CPU."""
    if device.kind != "cuda" or device.compute_capability is None:
        return None
    return (device.sms, *device.compute_capability)


def gemm_4bit_dequantizes(m: int, n: int, k: int, dtype: torch.dtype, blocksize: int,
                          gpu: GpuProps | None) -> bool:
    """Whether gemm_4bit of an (m x k) input and an (n x k) 4-bit weight dequantizes the
    weight into a dense buffer first: always on the CPU (``gpu`` None), on a CUDA GPU as
    bitsandbytes decides."""
    if gpu is None:
        return True
    found = _cuda_rule()
    probes.read("bitsandbytes")
    if found is None and probes.installed("bitsandbytes") is not None:
        probes.went_blind("bitsandbytes", "its choice of 4-bit GEMM kernel on CUDA "
                          f"(backends/cuda/ops.py, {_RULE}): a GEMM of at most {CUSTOM_MAX_M} "
                          "rows is traced as its fused kernel, without a dense weight")
    max_m = CUSTOM_MAX_M if found is None else found[1]
    if m > max_m or k % blocksize != 0:
        return True
    return found is not None and not found[0](gpu, dtype, m, n, k)


def dense_buffers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  gpu: GpuProps | None) -> tuple[int, ...]:
    """The bytes of the buffers a ``bitsandbytes::gemm_4bit`` call holds inside the op while
    its ``F.linear`` runs, where it dequantizes first: the dense weight in A's dtype and,
    with double quantization, the fp32 absmax (on CUDA also the dequantized absmax before
    the offset is added; on the CPU that one is freed at once). () for any other op."""
    if not str(func).startswith("bitsandbytes.gemm_4bit"):
        return ()
    schema = func._schema.arguments
    bound = {a.name: args[i] if i < len(args) else kwargs.get(a.name)
             for i, a in enumerate(schema)}
    a, (n, k), blocksize = bound["A"], bound["shapeB"], int(bound["blocksize"])
    m = a.numel() // max(k, 1)
    if not gemm_4bit_dequantizes(m, n, k, a.dtype, blocksize, gpu):
        return ()
    dense = n * k * a.element_size()
    if bound.get("absmax_8bit") is None:  # the fp32 absmax is read as it is
        return (dense,)
    absmax = 4 * math.ceil(n * k / blocksize)
    return (absmax, dense) if gpu is None else (absmax, absmax, dense)
