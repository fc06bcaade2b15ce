"""Plain PyTorch models from a ``package.module:function`` factory.

The function is called with no arguments and must return an ``nn.Module``. The module is
imported with the current directory first on ``sys.path``, so ``mymodel:build`` finds
``./mymodel.py``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError

if TYPE_CHECKING:
    import torch


def split_factory(source: str) -> tuple[str, str]:
    module, _, fn = source.rpartition(":")
    if not module or not fn or not fn.isidentifier():
        raise TilefitError(
            f"{source!r} is not a factory reference",
            expected="package.module:function, e.g. mymodels.resnet:build",
            given=source,
            fix="write the module's import path, a colon, and the function's name",
        )
    return module, fn


def load_factory(source: str) -> Callable[[], Any]:
    """Import the module of ``pkg.mod:fn`` (current directory on sys.path) and return ``fn``."""
    module_name, fn_name = split_factory(source)
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TilefitError(
            f"cannot import module {module_name!r} of {source!r}: {exc}",
            expected=f"an importable module {module_name} (a .py file or package under the "
            "current directory or on PYTHONPATH)",
            given=source,
            fix=f"run tilefit from the folder that holds {module_name.replace('.', '/')}.py, "
            "or add its folder to PYTHONPATH",
        ) from None
    finally:
        if added:
            sys.path.remove(cwd)
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise TilefitError(
            f"module {module_name} has no function {fn_name!r}",
            expected=f"a callable {fn_name} in {module_name} that returns an nn.Module",
            given=source,
            fix=("name one of its callables: " + ", ".join(public[:10]))
            if public
            else f"define def {fn_name}() -> nn.Module in {module_name}",
        )
    return fn


def build_module(source: str) -> torch.nn.Module:
    """A fresh module from the factory, in train mode."""
    import torch

    fn = load_factory(source)
    model = fn()
    if not isinstance(model, torch.nn.Module):
        raise TilefitError(
            f"{source} returned {type(model).__name__}, not an nn.Module",
            expected="a function that takes no arguments and returns a torch.nn.Module",
            given=f"{source}() -> {type(model).__name__}",
            fix=f"make {source.rpartition(':')[2]} return the model (an nn.Module instance)",
        )
    model.train()
    return model


def check_input_shape(source: str, input_shape: Any) -> tuple[int, ...]:
    if input_shape is None:
        raise TilefitError(
            f"{source} needs the shape of one input sample",
            expected="input_shape without the batch dimension, e.g. (3, 224, 224)",
            given="no input_shape",
            fix="pass load_workload(..., input_shape=(3, 224, 224)) (the batch is float32 of "
            "shape (B, *input_shape))",
        )
    import operator

    try:
        shape = tuple(operator.index(d) for d in input_shape)
    except TypeError:
        shape = ()
    if not shape or any(d < 1 or isinstance(d, bool) for d in shape):
        raise TilefitError(
            "input_shape must be positive whole numbers",
            expected="e.g. (3, 224, 224) or (784,)",
            given=repr(input_shape),
            fix="give each dimension of one sample, without the batch dimension",
        )
    return shape


def stand_in_loss(output: Any) -> torch.Tensor:
    """The mean of the model's output: a STAND-IN for the user's real loss.

    A factory says nothing about its loss, so this scalar makes backward reach every parameter
    that influences the output; the real loss (cross-entropy, ...) costs one more small
    elementwise/reduction pass, which this does not model.
    """
    import torch

    if isinstance(output, torch.Tensor):
        return output.float().mean() if not output.is_floating_point() else output.mean()
    if hasattr(output, "loss") and isinstance(output.loss, torch.Tensor):
        return output.loss
    values = output.values() if isinstance(output, dict) else output
    if isinstance(values, list | tuple) or isinstance(output, dict):
        for value in values:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.mean()
    raise TilefitError(
        "the model's output has no floating-point tensor to build a stand-in loss from",
        expected="a tensor, or a tuple/dict whose first floating tensor is the prediction",
        given=type(output).__name__,
        fix="make forward return the prediction tensor",
    )
