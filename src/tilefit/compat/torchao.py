"""torchao's float8 training: its import, its float8 tensor subclass (whose module moved
between torchao releases) and the fp8 data it holds (the private ``_data``), its
Float8Linear's module."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from tilefit.compat.fake import tree_leaves, tree_map
from tilefit.errors import TilefitError
from tilefit.quiet_imports import quiet_imports

__all__ = ["TORCHAO_PIP", "float8_linear_module", "float8_payload", "holds_float8",
           "is_float8_tensor", "torchao_float8", "unwrap_float8"]

TORCHAO_PIP = "pip install 'tilefit[fp8]' (or: pip install torchao)"
_FLOAT8_TENSOR: list[type] = []  # Float8TrainingTensor, once torchao.float8 is imported


def torchao_float8() -> Any:
    """torchao.float8, or an error with the command that installs it."""
    try:
        with quiet_imports():
            module = importlib.import_module("torchao.float8")
    except ImportError:
        raise TilefitError(
            "precision fp8-mixed traces torchao's float8 training, and torchao is not "
            "installed", expected="the torchao package (tilefit's fp8 extra)",
            given="no module named torchao", fix=TORCHAO_PIP) from None
    if not _FLOAT8_TENSOR:
        training = importlib.import_module("torchao.float8.float8_training_tensor")
        _FLOAT8_TENSOR.append(training.Float8TrainingTensor)
    return module


def float8_linear_module() -> Any:
    """torchao.float8.float8_linear: Float8Linear and its autograd function
    ``matmul_with_hp_or_float8_args``."""
    return importlib.import_module("torchao.float8.float8_linear")


def is_float8_tensor(t: Any) -> bool:
    return bool(_FLOAT8_TENSOR) and isinstance(t, _FLOAT8_TENSOR[0])


def float8_payload(t: torch.Tensor) -> torch.Tensor:
    """The fp8 data of a torchao Float8TrainingTensor (what the GPU kernel reads), or ``t``."""
    return t._data if is_float8_tensor(t) else t  # type: ignore[attr-defined, no-any-return]


def holds_float8(tree: Any) -> bool:
    """Whether an op's arguments include a Float8TrainingTensor (free until torchao is
    loaded)."""
    if not _FLOAT8_TENSOR:
        return False
    return any(is_float8_tensor(t) for t in tree_leaves(tree))


def unwrap_float8(tree: Any) -> Any:
    """``tree`` with each Float8TrainingTensor replaced by its fp8 data."""
    if not _FLOAT8_TENSOR:
        return tree
    return tree_map(float8_payload, tree)
