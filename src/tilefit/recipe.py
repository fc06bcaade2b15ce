"""The one description of a training step: ``Recipe`` (its grouped parts live in
tilefit.recipe_parts and are re-exported here).

Everything about a step but the model, the batch's contents and the GPU: the micro-batch,
precision, optimizer, checkpointing, accumulation, attention, the training loop's clipping and
loss read, the fused loss, ``Compile`` (torch.compile's mode and graph breaks),
``Parallelism`` (GPUs, engine, offload, DeepSpeed's buckets) and ``Lora`` (adapters as
peft.LoraConfig takes them). ``tilefit.trace``, ``estimate``, ``audit`` and ``plan`` take one
as ``recipe=``; the CLI builds one from its flags through ``Recipe.for_model``, so Python and
the command line describe the same step by construction.

Torch-free, like tilefit.vocab, whose names it uses and never re-maps.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tilefit.alloc_conf import parse_alloc_conf
from tilefit.errors import TilefitError
from tilefit.recipe_parts import ALL_LINEAR as ALL_LINEAR  # re-exported: the parts' home
from tilefit.recipe_parts import DEEPSPEED_DEFAULTS as DEEPSPEED_DEFAULTS
from tilefit.recipe_parts import ONE_GPU as ONE_GPU
from tilefit.recipe_parts import Compile as Compile
from tilefit.recipe_parts import Lora as Lora
from tilefit.recipe_parts import Parallelism as Parallelism
from tilefit.recipe_parts import ZeroConfig as ZeroConfig
from tilefit.recipe_parts import whole
from tilefit.vocab import (
    ATTENTIONS,
    OPTIMIZER_NAMES,
    PRECISIONS,
    QUANTIZATIONS,
    Precision,
    check_max_grad_norm,
    default_precision,
    mixed_precision,
    parse_precision,
    parse_routing,
    precision_reading,
)

# the precision a Recipe resolves against its GPU: mixed bf16 where the part has bf16,
# fp16-mixed before (V100, T4), fp32 on the CPU (vocab.default_precision)
AUTO = "auto"
# the GPU tilefit predicts for when none is named (the CLI's --gpu default)
DEFAULT_GPU = "a100-80gb"
# tilefit's micro-batch when none is given: the CLI's --batch default and Hugging Face
# TrainingArguments' per_device_train_batch_size default
DEFAULT_BATCH = 8


@dataclass(frozen=True)
class Recipe:
    """How a model is trained: everything but the model, the batch's contents and the GPU.

    Validated once, here: a precision in any accepted spelling becomes its canonical name
    (an ambiguous one, such as "bf16", adds a line to ``notes`` saying how it was read);
    ``precision="auto"`` is the GPU's own default, fixed by ``on(device)``. ``compile``
    takes a Compile (True: Compile()); ``lora`` a Lora (True: Lora()). ``optimizer`` is a
    name of vocab.OPTIMIZER_NAMES or your own factory ``params -> torch.optim.Optimizer``.
    """

    batch_size: int = DEFAULT_BATCH  # the micro-batch: samples per forward/backward (per GPU)
    precision: str = AUTO  # a vocab.PrecisionName, any accepted spelling, or "auto"
    optimizer: str | Callable[..., Any] = "adamw"
    grad_checkpointing: bool = False
    accumulation_steps: int = 1
    attention: str = "auto"  # a vocab.Attention
    max_grad_norm: float | None = None  # gradient clipping (HF Trainer's default: 1.0)
    # the loop reads the loss on the host after each micro-batch, waiting for the GPU (HF
    # Trainer's default logging_nan_inf_filter=True; a loss printed or logged each step)
    loss_sync: bool = False
    # how the loop clears the gradients after the optimizer step: optimizer.zero_grad() frees
    # them (set_to_none=True, PyTorch 2's default and the HF Trainer's); False keeps them
    # allocated and zeroed (set_to_none=False, PyTorch 1.x's default), so they are held
    # through the next forward
    zero_grad_to_none: bool = True
    # a causal LM's loss as fused linear cross-entropy (Liger Kernel): the logits never whole
    fused_ce: bool = False
    compile: Compile | None = None
    parallel: Parallelism = ONE_GPU
    lora: Lora | None = None
    # the frozen base's linear layers quantized by bitsandbytes (a vocab.Quantization: "nf4",
    # "fp4", "int8"), as transformers' BitsAndBytesConfig loads them; needs lora (QLoRA)
    quantize: str | None = None
    # the quantized base as the user's BitsAndBytesConfig and peft calls make it: double
    # quantization of a 4-bit base's scales (bnb_4bit_use_double_quant; QLoRA's), the dtype
    # its layers compute in (bnb_4bit_compute_dtype: "bf16", "fp16", "fp32"; None: the
    # precision's 16-bit dtype, else fp32), and whether peft's
    # prepare_model_for_kbit_training runs (it casts what stays unquantized to fp32; without
    # it those weights stay in the compute dtype they were loaded in)
    double_quant: bool = True
    quant_compute_dtype: str | None = None
    prepare_kbit: bool = True
    # PyTorch's CUDA caching allocator settings (PYTORCH_CUDA_ALLOC_CONF's text, e.g.
    # "expandable_segments:True"); None: the environment's, read when the step is estimated
    alloc_conf: str | None = None
    # a mixture-of-experts layer's tokens per expert (vocab.parse_routing): "balanced" or
    # "skewed:F", the busiest expert's share F of the routed tokens
    routing: str = "balanced"
    # a Hugging Face model's KV cache in the training step (config.use_cache): None keeps the
    # config's; the HF Trainer sets False (TrainingArguments.use_cache, transformers 5.x:
    # docs/references.md, section 47), so a causal LM keeps no cache copy of its keys and
    # values; a plain loop calling model(**batch) builds it when the config says so
    use_cache: bool | None = None
    notes: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        notes = list(self.notes)
        _check_precision_object(self.precision)
        if self.precision != AUTO:
            reading = precision_reading(self.precision)
            object.__setattr__(self, "precision", parse_precision(self.precision).name)
            if reading and reading not in notes:
                notes.append(reading)
        object.__setattr__(self, "notes", tuple(notes))
        if self.compile is True or isinstance(self.compile, str):
            mode = "default" if self.compile is True else self.compile
            object.__setattr__(self, "compile", Compile(mode))  # type: ignore[arg-type]
        elif self.compile is False:
            object.__setattr__(self, "compile", None)
        if self.lora is True or self.lora is False:
            object.__setattr__(self, "lora", Lora() if self.lora else None)
        self._check()

    def _check(self) -> None:
        if not whole(self.batch_size, 1):
            raise TilefitError("the batch size must be a whole number >= 1",
                               expected="1, 2, 8, ...", given=repr(self.batch_size),
                               fix="pass Recipe(batch_size=8)")
        if not whole(self.accumulation_steps, 1):
            raise TilefitError("accumulation_steps must be a whole number >= 1",
                               expected="1, 2, 4, ...", given=repr(self.accumulation_steps),
                               fix="pass Recipe(accumulation_steps=4): micro-batches per "
                               "optimizer step")
        check_optimizer(self.optimizer)
        if self.attention not in ATTENTIONS:
            raise TilefitError(f"unknown attention implementation {self.attention!r}",
                               expected="one of " + ", ".join(ATTENTIONS),
                               given=repr(self.attention),
                               fix="pass Recipe(attention='sdpa') (PyTorch's fused "
                               "kernels) unless you need eager")
        check_max_grad_norm(self.max_grad_norm)
        if self.use_cache not in (None, True, False):
            raise TilefitError("use_cache is the model config's KV-cache switch in training",
                               expected="None (the config's), True or False",
                               given=repr(self.use_cache), fix="Recipe(use_cache=False)")
        if not isinstance(self.zero_grad_to_none, bool):
            raise TilefitError("zero_grad_to_none says how the loop clears the gradients",
                               expected="True (zero_grad() frees them) or False (kept, zeroed)",
                               given=repr(self.zero_grad_to_none),
                               fix="Recipe(zero_grad_to_none=False) for zero_grad(set_to_none="
                               "False)")
        if self.alloc_conf is not None:
            parse_alloc_conf(self.alloc_conf)  # an unknown key is an error naming the known
        for name, kind in (("compile", Compile), ("lora", Lora)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TilefitError(f"Recipe({name}=...) takes a {kind.__name__}",
                                   expected=f"{kind.__name__}(...), True or None",
                                   given=repr(value), fix=f"Recipe({name}={kind.__name__}())")
        if not isinstance(self.parallel, Parallelism):
            raise TilefitError("Recipe(parallel=...) takes a Parallelism",
                               expected="Parallelism(world_size=8, strategy='fsdp2')",
                               given=repr(self.parallel), fix="wrap it in Parallelism(...)")
        check_quantize(self)
        object.__setattr__(self, "routing", parse_routing(self.routing).name)
        if self.fused_ce and self.compile is not None:
            raise TilefitError(
                "fused linear cross-entropy is not predicted under torch.compile",
                expected="Recipe(fused_ce=True) or Recipe(compile=Compile()), not both",
                given="Recipe(fused_ce=True, compile=Compile())",
                fix="pass Recipe(compile=None) to predict Liger's fused loss in eager mode, "
                "or Recipe(fused_ce=False) to predict the compiled step (Inductor fuses the "
                "loss's softmax itself); docs/references.md, section 17 says why")

    @classmethod
    def for_model(cls, model: Any, **fields_: Any) -> Recipe:
        """The recipe the model's usual training loop runs, with ``fields_`` set on top:
        for a Hugging Face model (a catalog name, a config.json, a transformers or peft
        module) the Trainer's defaults (``HF_TRAINER``: fused AdamW, clipping at 1.0, the
        loss read after each micro-batch), for anything else plain PyTorch's
        (``PLAIN_PYTORCH``: foreach AdamW, no clipping, no read)."""
        unknown = sorted(set(fields_) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"Recipe.for_model() got unexpected fields {unknown}")
        loop = HF_TRAINER if is_hugging_face(model) else PLAIN_PYTORCH
        return cls(**{**loop, **fields_})

    def on(self, device: Any) -> Recipe:
        """This recipe with ``precision="auto"`` resolved for ``device`` (a hardware.Device;
        None: this machine's CPU, fp32), the precision checked against what the device
        supports."""
        from tilefit.vocab import check_precision_supported

        if self.precision == AUTO:
            return replace(self, precision="fp32" if device is None
                           else default_precision(device))
        if device is not None:
            check_precision_supported(self.precision, device)
        return self

    @property
    def spec(self) -> Precision:
        if self.precision == AUTO:
            raise TilefitError("the recipe's precision is 'auto', the GPU's default",
                               expected="a recipe resolved for its GPU",
                               given="precision='auto'",
                               fix="call recipe.on(get_device(gpu)) first")
        return parse_precision(self.precision)

    @property
    def peft(self) -> bool:
        """Whether LoRA adapters are trained on a frozen base (peft)."""
        return self.lora is not None

    @property
    def adapters_text(self) -> str:
        """The adapters and their base in words for a report's title (", LoRA r=16 alpha=32
        on all linear layers of a frozen nf4 base"), "" for full fine-tuning."""
        return "" if self.lora is None else f", {self.lora.label(self.quantize)}"

    @property
    def compile_mode(self) -> str:
        return "default" if self.compile is None else self.compile.mode

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation_steps

    def with_batch(self, batch_size: int, accumulation_steps: int | None = None) -> Recipe:
        return replace(self, batch_size=batch_size, accumulation_steps=(
            self.accumulation_steps if accumulation_steps is None else accumulation_steps))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "notes"}
        if callable(self.optimizer):
            out["optimizer"] = getattr(self.optimizer, "__name__", type(self.optimizer).__name__)
        for name in ("compile", "parallel", "lora"):
            value = out[name]
            out[name] = None if value is None else asdict(value)
        return out


def variant(recipe: Recipe, **changes: Any) -> Recipe | None:
    """``recipe`` with ``changes``, or None where the Recipe refuses them together (a
    quantized base or the fused loss under torch.compile): for a caller that only looks
    ahead (an audit starting a what-if early), the rule that applies the change notes why."""
    try:
        return replace(recipe, **changes)
    except TilefitError:
        return None


def check_optimizer(optimizer: Any) -> None:
    """A name of vocab.OPTIMIZER_NAMES (close spellings suggested) or a factory."""
    if callable(optimizer):
        return
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_NAMES:
        return
    key = str(optimizer).lower().replace("_", "-")
    close = difflib.get_close_matches(key, OPTIMIZER_NAMES, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise TilefitError(f"unknown optimizer {optimizer!r}{hint}",
                       expected="one of " + ", ".join(OPTIMIZER_NAMES)
                       + ", or a factory params -> torch.optim.Optimizer",
                       given=repr(optimizer), fix="pass one of the names above")


# The Hugging Face Trainer's training loop, as transformers' TrainingArguments defaults it:
# optim="adamw_torch_fused" (its default with torch >= 2.8), max_grad_norm=1.0,
# logging_nan_inf_filter=True (the loss read on the host after each micro-batch).
HF_TRAINER: dict[str, Any] = {"optimizer": "adamw-fused", "max_grad_norm": 1.0,
                              "loss_sync": True, "use_cache": False}
# A plain PyTorch loop: torch.optim.AdamW as torch defaults it (foreach on a GPU), no
# clipping, no read of the loss.
PLAIN_PYTORCH: dict[str, Any] = {"optimizer": "adamw", "max_grad_norm": None,
                                 "loss_sync": False}


def is_hugging_face(model: Any) -> bool:
    """Whether ``model`` trains in the Hugging Face Trainer by default: a catalog name or
    config.json (a Workload that is not a factory), a transformers or peft module, or a
    factory that builds one (built on the meta device to see)."""
    if isinstance(model, str):
        return not looks_like_factory(model.strip())
    if hasattr(model, "is_factory"):  # a tilefit Workload
        return not model.is_factory
    peft = sys.modules.get("peft")  # not imported: the model cannot be one of its own
    if peft is not None and isinstance(model, peft.PeftModel):
        return True
    from tilefit.compat.transformers import hugging_face_module

    return hugging_face_module(model) is not None


def looks_like_factory(source: str) -> bool:
    """``pkg.mod:fn`` (a colon, no path separator before it, not a Windows drive letter)."""
    if ":" not in source or source.endswith(".json"):
        return False
    module, _, fn = source.rpartition(":")
    has_separator = "/" in module or "\\" in module
    return bool(module) and bool(fn) and not has_separator and len(module) > 1


def is_named_model(model: Any) -> bool:
    """A catalog name, config.json path, ``package.module:function`` or tilefit Workload
    (which tilefit builds, and can re-build at any batch size), not a user's module."""
    return isinstance(model, str) or hasattr(model, "make_batch")


def batch_recipe(recipe: Recipe, batch: Any) -> Recipe:
    """The recipe at a named model's ``batch``: None keeps recipe.batch_size, an int sets it."""
    if batch is None:
        return recipe
    if whole(batch, 1):
        return recipe.with_batch(batch)
    raise TilefitError("a named model takes a batch size, not a batch",
                       expected="batch=8 (or recipe=Recipe(batch_size=8)); an example batch "
                       "only with an nn.Module", given=type(batch).__name__,
                       fix="pass the micro-batch size as an int")


def training_loop_note(recipe: Recipe) -> str:
    """What an estimate of a Hugging Face model assumed of its training loop."""
    clip = (f"gradients clipped at {recipe.max_grad_norm}" if recipe.max_grad_norm
            else "no clipping")
    sync = "the loss read each micro-batch" if recipe.loss_sync else "no loss read"
    optimizer = recipe.to_dict()["optimizer"]
    return (f"note: the training loop as assumed: {clip}, {optimizer}, {sync} (the "
            "Hugging Face Trainer's defaults are max_grad_norm=1.0, optim='adamw_torch_fused', "
            "logging_nan_inf_filter=True; Recipe(max_grad_norm=...), Recipe(optimizer=...) "
            "and Recipe(loss_sync=True) change them)")


def check_quantize(recipe: Recipe) -> None:
    """A quantized base: a name of vocab.QUANTIZATIONS, under LoRA adapters (its 4- and
    8-bit weights take no gradient), on one GPU or replicated by DDP on several, eager or
    (4-bit) compiled, outside fp8-mixed."""
    q = recipe.quantize
    _check_quant_settings(recipe)
    if q is None:
        return
    if q not in QUANTIZATIONS:
        close = difflib.get_close_matches(str(q).lower(), QUANTIZATIONS, n=1, cutoff=0.5)
        raise TilefitError(f"unknown quantization {q!r}"
                           + (f" (did you mean {close[0]}?)" if close else ""),
                           expected="one of " + ", ".join(QUANTIZATIONS), given=repr(q),
                           fix="pass Recipe(quantize='nf4') (QLoRA's 4-bit NormalFloat)")
    clash = ("lora" if recipe.lora is None
             else "compile" if recipe.compile is not None and q == "int8"
             else "gpus" if recipe.parallel.engine not in (None, "ddp")
             else "fp8" if recipe.precision == "fp8-mixed" else None)
    if clash is None:
        return
    problem, fix = {
        "lora": ("a quantized base is frozen: bitsandbytes' 4- and 8-bit weights take no "
                 "gradient, so something else must train", "pass Recipe(lora=True) (QLoRA)"),
        "compile": ("an int8 base is not predicted under torch.compile (bitsandbytes' "
                    "Linear8bitLt keeps per-layer state the capture does not lift; its 4-bit "
                    "layers compile in one graph)",
                    "pass Recipe(compile=None), or Recipe(quantize='nf4')"),
        "gpus": (f"a quantized base is predicted on one GPU or replicated on several by DDP, "
                 f"not sharded by {recipe.parallel.engine} (sharding bitsandbytes' packed "
                 "weights needs quant_storage set to the compute dtype: not modelled)",
                 "pass Parallelism(strategy='ddp') (every GPU holds the whole 4-bit base; "
                 "only the adapters' gradients are all-reduced), or "
                 "Parallelism(world_size=1)"),
        "fp8": ("bitsandbytes' layers compute in bf16, fp16 or fp32, not fp8 (torchao's "
                "float8 training would swap the same linear layers)",
                f"pass Recipe(precision={mixed_precision('bf16').name!r}) (QLoRA trains "
                "under bf16 autocast)"),
    }[clash]
    raise TilefitError(problem, expected=f"Recipe(quantize={q!r}, lora=Lora()), on one "
                       "GPU (or Parallelism(strategy='ddp')), in a 16-bit or fp32 precision "
                       "(int8: eager)",
                       given=f"Recipe(quantize={q!r}) with " + {
                           "lora": "Recipe(lora=None)", "compile": "Recipe(compile=Compile())",
                           "gpus": f"Parallelism(world_size={recipe.parallel.world_size}, "
                                   f"strategy={recipe.parallel.engine!r})",
                           "fp8": "Recipe(precision='fp8-mixed')"}[clash],
                       fix=fix)


def _check_quant_settings(recipe: Recipe) -> None:
    """double_quant and prepare_kbit are booleans; quant_compute_dtype a 16-bit or fp32
    dtype name (stored as its canonical name), for a 4-bit base."""
    for name in ("double_quant", "prepare_kbit"):
        if not isinstance(getattr(recipe, name), bool):
            raise TilefitError(f"{name} is True or False", expected="True or False",
                               given=repr(getattr(recipe, name)), fix=f"Recipe({name}=False)")
    dtype = recipe.quant_compute_dtype
    if dtype is None:
        return
    from tilefit.dtypes import parse_dtype

    name = parse_dtype(dtype).name
    if name not in ("bf16", "fp16", "fp32") or recipe.quantize == "int8":
        raise TilefitError("quant_compute_dtype is the dtype a 4-bit base's layers compute in",
                           expected="bf16, fp16 or fp32, with quantize nf4 or fp4",
                           given=f"{dtype!r} with quantize {recipe.quantize!r}",
                           fix="Recipe(quantize='nf4', quant_compute_dtype='bf16')")
    object.__setattr__(recipe, "quant_compute_dtype", name)


def _check_precision_object(precision: Any) -> None:
    """A Precision object is accepted when it is the vocabulary's own (the Recipe holds its
    name); one with other fields would be reduced to its name and lose them silently."""
    if not isinstance(precision, Precision):
        return
    named = next((p for p in PRECISIONS if p.name == precision.name), None)
    if named != precision:
        raise TilefitError(
            "Recipe(precision=...) takes a precision of tilefit's vocabulary: a Precision "
            "with other fields would be traced as its name's",
            expected="a name of vocab.PRECISIONS (fp16 autocast without a GradScaler is "
                     "'fp16-mixed-unscaled')",
            given=f"Precision(name={precision.name!r}, grad_scaler={precision.grad_scaler}, "
                  f"autocast_dtype={precision.autocast_dtype!r}, ...)",
            fix="Recipe(precision='fp16-mixed-unscaled') (or another name of the vocabulary)")
