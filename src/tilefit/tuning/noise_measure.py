"""``noise_scale``: the gradient noise scale measured on the live device with the user's data.

One measurement draws B_big / B_small micro-batches of B_small samples. The gradient of each
micro-batch gives |G_Bsmall|^2 (their mean is the measurement's small-batch value); their
average, accumulated as gradient accumulation does, is the gradient of the big batch,
|G_Bbig|^2. No optimizer step is taken and no per-sample gradient is formed; the extra
memory is one fp32 copy of the trainable parameters (the accumulator). The estimator is in
``noise.py`` (docs/references.md, section 18). Everything a backward pass changes
(gradients, buffers such as batch-norm statistics, module attributes), the modes and the
RNG streams are restored bit for bit afterwards, as tune restores them (``state.py``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.loop import Hooks, autocast_for, default_loss, micro_batch
from tilefit.old_keywords import refuses_old_keywords
from tilefit.recipe import Recipe
from tilefit.tuning.executor import LossFn, _to_device
from tilefit.tuning.noise import Measurement, NoiseScale, from_measurements
from tilefit.tuning.options import DEFAULT_BATCH_SIZES as DEFAULT_BATCH_SIZES  # re-exported
from tilefit.tuning.options import DEFAULT_MEASUREMENTS as DEFAULT_MEASUREMENTS  # re-exported
from tilefit.tuning.options import NoiseMeasure
from tilefit.tuning.request import live_recipe
from tilefit.tuning.state import restore, snapshot, train_mode
from tilefit.vocab import mixed_precision, parse_precision

# one micro-batch's forward and backward, nothing else of the loop (its autocast is the hook's)
PLAIN_STEP = Recipe(precision="fp32")


@refuses_old_keywords
def noise_scale(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    recipe: Recipe | None = None,
    precision: str | None = None,
    device: str | torch.device | None = None,
    measure: NoiseMeasure | None = None,
) -> NoiseScale:
    """The simple gradient noise scale B_simple = tr(Sigma) / |G|^2 of the model on its data.

    make_batch(b) must draw b fresh samples at random from the training data on every call
    (a fixed batch has no noise to measure). loss_fn(model, batch) the mean loss of the
    batch (default model(**batch).loss). optimizer: not stepped; given, its state is kept
    intact and its class and lr are reported for the learning-rate advice. recipe (or
    precision alone, default fp32): its precision, as tune takes it. precision: runs
    under bf16 autocast as training does; fp16 with a loss scaler is measured in fp32.
    device: where the model is (default: its parameters' device).

    measure (``NoiseMeasure``): batch_sizes=(B_small, B_big): B_small >= 2, B_big a larger
    multiple of it, accumulated from micro-batches of B_small (so only B_small must fit in
    memory); how many big batches, the interval's confidence; checkpoint: a state dict file
    or a Hugging Face checkpoint folder loaded for the measurement only (the noise scale
    grows as training proceeds: measure after warm-up, and again from later checkpoints).
    Runs in train mode unless ``keep_modes``; parameters, buffers, gradients, module
    attributes, optimizer state, modes and RNG states are restored bit for bit. 0.1.0's
    keywords (``batch_sizes=``, ...) are refused with their new spelling (tilefit.old_keywords).
    """
    measure = measure or NoiseMeasure()
    (b_small, b_big), dev = measure.sizes, _device_of(model, device)
    autocast = _autocast_of(live_recipe(recipe, precision, "noise_scale").precision, dev)
    start_s = time.perf_counter()
    snap = snapshot(model, optimizer)
    run: _Run | None = None
    try:
        if measure.checkpoint is not None:
            load_checkpoint(model, measure.checkpoint)
        if not measure.keep_modes:
            train_mode(model)
        params = _trainable(model)
        run = _Run(model, make_batch, loss_fn or default_loss, params, dev, autocast)
        found = [run.measure(b_small, b_big // b_small, i) for i in range(measure.measurements)]
    except BaseException:
        gc.collect()  # an error's traceback can hold activations (as tune's executor frees)
        raise
    finally:
        if run is not None:
            run.acc.clear()  # the accumulator's memory back before the restore
        restore(snap)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    lr = None if optimizer is None else float(optimizer.param_groups[0]["lr"])
    return from_measurements(
        found, b_small, b_big, time_s=time.perf_counter() - start_s,
        confidence=measure.confidence, loss=run.loss_sum / max(1, run.micro_batches),
        optimizer=None if optimizer is None else type(optimizer).__name__, learning_rate=lr)


def _device_of(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """The device noise_scale runs on (default: the model's parameters'), the model on it."""
    from tilefit.tuning.request import check_on_device, resolve_device

    first = next(model.parameters(), None)
    dev = resolve_device(device if device is not None or first is None else first.device)
    check_on_device(model, dev)
    return dev


def _autocast_of(precision: str, device: torch.device) -> Callable[[], Any]:
    """The measurement's forward context: the precision's autocast, none for fp16 with a
    loss scaler (measured in fp32)."""
    spec = parse_precision(precision)
    if spec.grad_scaler:
        return contextlib.nullcontext
    return lambda: autocast_for(device.type, spec)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise TilefitError("the model has no trainable parameters",
                           expected="parameters with requires_grad=True",
                           given=f"{type(model).__name__}: every parameter frozen",
                           fix="unfreeze the parameters you train (p.requires_grad_(True))")
    return params


class _Run:
    """The measuring loop's state: the accumulator and running loss."""

    def __init__(self, model: nn.Module, make_batch: Callable[[int], Any], loss_fn: LossFn,
                 params: list[tuple[str, nn.Parameter]], device: torch.device,
                 autocast: Callable[[], Any]) -> None:
        self.model = model
        self.make_batch = make_batch
        self.loss_fn = loss_fn
        self.params = params
        self.device = device
        self.autocast = autocast
        self.acc = [torch.zeros_like(p, dtype=torch.float32) for _, p in params]
        self.loss_sum = 0.0
        self.micro_batches = 0

    def measure(self, b_small: int, k: int, index: int) -> Measurement:
        """k micro-batches of b_small: the mean of their |G|^2, and |G|^2 of their mean."""
        for a in self.acc:
            a.zero_()
        small_sq = 0.0
        for _ in range(k):
            small_sq += self._micro(b_small, index)
        with torch.no_grad():
            big_sq = float(torch.stack([a.square().sum() for a in self.acc]).double().sum())
        big_sq /= k**2
        return Measurement(small_sq / k, big_sq)

    def _micro(self, b_small: int, index: int) -> float:
        """One micro-batch's backward: its |G|^2 (checked), its gradient added to acc."""
        for _, p in self.params:
            p.grad = None
        batch = _to_device(self.make_batch(b_small), self.device)
        # tilefit.loop's micro-batch of plain PyTorch's loop (no accumulation, no scaler: the
        # gradient of this batch alone), under the measurement's autocast
        loss = micro_batch(lambda b=batch: self.loss_fn(self.model, b), PLAIN_STEP,
                           hooks=Hooks(forward=self.autocast))
        value = float(loss.detach().float())
        if not math.isfinite(value):
            raise TilefitError(
                f"the loss is {value} (measurement {index + 1}, a batch of {b_small})",
                expected="a finite loss", given=f"loss = {value}",
                fix="check the data and the model on this batch (a learning rate that "
                "diverged, log of zero, labels out of range); a checkpoint from before it "
                "diverged can be measured with checkpoint=...")
        del loss, batch
        sq = grad_sq_norm(self.params, b_small, index)
        with torch.no_grad():
            for a, (_, p) in zip(self.acc, self.params, strict=True):
                if p.grad is not None:
                    a.add_(p.grad.float())
                p.grad = None
        self.loss_sum += value
        self.micro_batches += 1
        return sq


def grad_sq_norm(params: list[tuple[str, nn.Parameter]], b_small: int, index: int) -> float:
    """sum of |grad|^2 over the parameters (one device sync), or a TilefitError naming the
    parameters whose gradient is non-finite, or saying that it is exactly zero."""
    with torch.no_grad():
        sums = [(name, p.grad.float().square().sum()) for name, p in params
                if p.grad is not None]
        total = float(torch.stack([s for _, s in sums]).double().sum()) if sums else 0.0
    where = f"measurement {index + 1}, a batch of {b_small}"
    if not math.isfinite(total):
        bad = [name for name, s in sums if not math.isfinite(float(s))]
        raise TilefitError(
            f"the gradient is not finite (nan or inf) in {len(bad)} parameter(s) ({where})",
            expected="finite gradients",
            given=", ".join(bad[:5]) + (", ..." if len(bad) > 5 else ""),
            fix="find the op that overflows (torch.autograd.set_detect_anomaly(True)); in "
            f"fp16 measure in {mixed_precision('bf16').name} or fp32")
    if total == 0.0:
        raise TilefitError(
            f"the gradient is exactly zero ({where})",
            expected="a loss that depends on the trainable parameters",
            given="|G_B|^2 = 0 for every parameter",
            fix="check that loss_fn uses the model's output and is not detached or constant")
    return total


# ---- checkpoints ---------------------------------------------------------------------------

_NESTED_KEYS = ("state_dict", "model_state_dict", "model")  # Lightning, common loops


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights in a checkpoint: a .safetensors file, a torch file (a state dict, or a
    dict holding one under state_dict / model_state_dict / model: Lightning's .ckpt and
    common loops), or a folder with model.safetensors or pytorch_model.bin (Hugging Face)."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (p / name).is_file():
                return read_state_dict(p / name)
        raise _bad_checkpoint(p, "a folder without model.safetensors or pytorch_model.bin")
    if not p.is_file():
        raise _bad_checkpoint(p, "no such file or folder")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p))
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors have no common type
        raise _bad_checkpoint(p, f"torch.load failed: {type(exc).__name__}") from None
    for key in _NESTED_KEYS:
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise _bad_checkpoint(p, f"a {type(data).__name__} that is not a state dict")
    return data


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a checkpoint's weights into the model. Every key must match, except a tied
    parameter saved once (Hugging Face drops lm_head.weight when it is the embedding)."""
    state = read_state_dict(path)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that differ
        raise TilefitError(
            f"the checkpoint {path} does not match the model",
            expected=f"the state dict of {type(model).__name__}",
            given=" ".join(str(exc).split())[:300],
            fix="pass a checkpoint of this model (the same class and configuration)") from None
    by_name = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(by_name[k]) for k in state if k in by_name}
    missing = [k for k in result.missing_keys if k not in by_name or id(by_name[k]) not in loaded]
    if missing or result.unexpected_keys:
        raise TilefitError(
            f"the checkpoint {path} does not match the model",
            expected=f"the state dict of {type(model).__name__}",
            given=f"missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}",
            fix="pass a checkpoint of this model (the same class and configuration)")


def _bad_checkpoint(path: Path, why: str) -> TilefitError:
    return TilefitError(f"cannot read the checkpoint {path}",
                        expected="a .safetensors or torch state-dict file (.pt, .bin, .ckpt) "
                        "or a Hugging Face checkpoint folder", given=why,
                        fix="pass the path of a checkpoint your training saved")
