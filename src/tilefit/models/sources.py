"""Workload: what to train (a model source) and the shape of one sample, ready to trace.

``load_workload`` turns a model source into a Workload:

- a catalog name (``gpt2``, ``llama-3-8b``; see ``catalog_names()``) or its hub id,
- a path to a Hugging Face ``config.json`` (the user's own; ``model_type`` required),
- ``package.module:function`` returning a plain ``nn.Module`` (with ``input_shape``),
- any Hugging Face Hub id ``org/name`` (``hub.py``: its config.json alone, cached).

``build()`` makes a fresh module in whatever FakeTensorMode / default device is active, so the
tracer can build a 70B model without allocating it; no weights are ever downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError, close_matches
from tilefit.models import catalog, factory, hf, hub, inputs, tasks
from tilefit.recipe import looks_like_factory

if TYPE_CHECKING:
    import torch

MODULE_TASK = "module"


@dataclass(frozen=True)
class Workload:
    """A model source plus the shape of one sample.

    ``config`` is the Hugging Face config as a read-only mapping (tilefit's ``_source`` notes
    included; None for plain factories). ``seq_len`` is tokens per sample (None when inputs are
    not tokens; the encoder's for seq2seq-lm). ``input_shape`` is one sample's shape for plain
    factories and the audio samples of a CTC model (None otherwise: an image's or log-mel
    input's shape is its config's). ``target_seq_len`` is the labels' length of a decoder
    (seq2seq-lm, speech-seq2seq) or a CTC transcript (None for other tasks).
    """

    name: str
    task: str
    config: Mapping[str, Any] | None
    seq_len: int | None
    input_shape: tuple[int, ...] | None = None
    target_seq_len: int | None = None

    def __hash__(self) -> int:  # the config mapping is not hashable; its JSON text is
        config = None if self.config is None else json.dumps(dict(self.config), sort_keys=True)
        return hash((self.name, self.task, self.seq_len, self.input_shape, self.target_seq_len,
                     config))

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len

    @property
    def loss_is_stand_in(self) -> bool:
        """True when ``loss_fn`` is a stand-in (plain factories: the mean of the output)."""
        return self.config is None

    @property
    def model_type(self) -> str | None:
        return None if self.config is None else str(self.config["model_type"])

    @property
    def is_factory(self) -> bool:
        return self.task == MODULE_TASK

    def build(self, attention: str = "auto") -> torch.nn.Module:
        """A fresh module in train mode, on the current default device / active fake mode.

        Hugging Face models are built fp32 with ``attn_implementation=attention`` ("auto":
        transformers' choice for the architecture, "eager" or "sdpa"); plain factories ignore
        ``attention`` (their code chooses).
        """
        if self.config is None:
            return factory.build_module(self.name)
        return hf.build_model(self.config, self.task, attention)

    def make_batch(self, batch_size: int, device: str | torch.device = "cpu") -> Any:
        """A synthetic batch of ``batch_size`` samples (deterministic; no RNG is used).

        Hugging Face tasks: a dict of tensors the model's forward takes, labels included (see
        ``inputs.make_hf_batch``). Factories: float32 zeros of shape (B, *input_shape).
        """
        import torch

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise TilefitError(
                "batch size must be a positive whole number",
                expected="an integer >= 1",
                given=repr(batch_size),
                fix="pass e.g. Recipe(batch_size=8)",
            )
        if self.config is None:
            assert self.input_shape is not None
            return torch.zeros(batch_size, *self.input_shape, device=device)
        return inputs.make_hf_batch(self.config, self.task, batch_size, self.seq_len, device,
                                    target_seq_len=self.target_seq_len,
                                    input_shape=self.input_shape)

    def loss_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of one forward.

        Hugging Face models: ``model(**batch).loss`` (the head's own loss; a CTC head's as
        ``inputs.ctc_loss`` computes it with static shapes). Factories: the mean of the output,
        a STAND-IN for the user's loss (see ``factory.stand_in_loss``).
        """
        if self.config is None:
            return factory.stand_in_loss(model(batch))
        if self.task == "ctc":
            return inputs.ctc_loss(model, batch)
        return model(**batch).loss

    def loss_for(self, fused_ce: bool) -> Any:
        """The loss function a recipe trains with: the head's own, or (``fused_ce``) a
        causal LM's loss as fused linear cross-entropy (tilefit.models.fused_loss)."""
        if not fused_ce:
            return self.loss_fn
        if self.task != "causal-lm":
            raise TilefitError(
                "fused linear cross-entropy applies to a causal LM's loss",
                expected="a Hugging Face causal LM (task causal-lm)",
                given=f"{self.name} ({self.task})", fix="pass Recipe(fused_ce=False)")
        from tilefit.models.fused_loss import fused_causal_lm_loss

        return fused_causal_lm_loss

    def with_config(self, **changes: Any) -> Workload:
        """The same workload with config fields replaced (a what-if: vocab_size=50304, ...).

        Aliases are stored under the config's own key (GPT-2: hidden_size -> n_embd,
        intermediate_size -> n_inner). Unknown fields raise TilefitError.
        """
        if self.config is None:
            raise TilefitError(
                f"{self.name} is a plain nn.Module factory; it has no config to change",
                expected="a catalog model or a config.json",
                given=f"with_config({', '.join(changes)})",
                fix="change the factory's arguments in your own code instead",
            )
        known = hf.known_fields(self.config)
        new = dict(self.config)
        for key, value in changes.items():
            if key not in known and key not in hf._FIELD_ALIASES.get(self.model_type or "", {}):
                hints = close_matches(key, sorted(known))
                raise TilefitError(
                    f"{self.model_type} configs have no field {key!r}",
                    expected=f"a field of the {self.model_type} config, e.g. "
                    + ", ".join(sorted(k for k in hf.transformers_config_dict(self.config))[:8]),
                    given=key,
                    fix=(f"did you mean {', '.join(hints)}?" if hints else "check the spelling")
                    + " (`tilefit models --json` shows each config)",
                )
            new[hf.canonical_field(self.config, key)] = value
        if "num_labels" in changes:  # id2label would otherwise win over num_labels
            new.pop("id2label", None)
            new.pop("label2id", None)
        return hf_workload(self.name, new, task=self.task, seq_len=self.seq_len,
                           input_shape=self.input_shape, target_seq_len=self.target_seq_len)

    def with_seq_len(self, seq_len: int) -> Workload:
        """The same workload with another sequence length (checked against the model's limit)."""
        if self.seq_len is None:
            raise TilefitError(
                f"{self.name} does not take token sequences",
                expected="a text model (causal-lm, masked-lm, seq-cls)",
                given=f"seq_len={seq_len}",
                fix="change the input shape instead",
            )
        assert self.config is not None
        return hf_workload(self.name, dict(self.config), task=self.task, seq_len=seq_len,
                           input_shape=self.input_shape, target_seq_len=self.target_seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "model_type": self.model_type,
            "seq_len": self.seq_len,
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "target_seq_len": self.target_seq_len,
            "loss_is_stand_in": self.loss_is_stand_in,
            "config": None if self.config is None else dict(self.config),
        }


def load_workload(
    source: str,
    *,
    seq_len: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    task: str | None = None,
    target_seq_len: int | None = None,
    image_size: int | None = None,
    revision: str | None = None,
) -> Workload:
    """A Workload from a catalog name, a config.json path, ``pkg.mod:function``, or any
    Hugging Face Hub id ``org/name`` (its config.json alone, through the Hugging Face cache).

    ``seq_len`` defaults per task (``tasks.DEFAULT_SEQ_LEN``: 2048 for causal LMs, 512 for
    encoders and encoder-decoders, capped by the model's positions); ``task`` defaults to the
    config's architecture, read through transformers' auto mappings (``tasks.TASKS``:
    causal-lm, masked-lm, seq-cls, image-cls, seq2seq-lm, speech-seq2seq, ctc).
    ``target_seq_len``: the labels of a decoder or a CTC transcript (``inputs.resolve_target``
    says the defaults); ``image_size``: an image model's size (default: its config's).
    ``input_shape``: a factory's sample, or a CTC model's audio samples (default 20 s at 16 kHz).
    ``revision``: a Hub id's branch, tag or commit (default main). Catalog names (and the
    catalog's Hub ids without ``revision``) are read offline, before anything else.
    """
    if not isinstance(source, str) or not source.strip():
        raise TilefitError(
            "no model given",
            expected="a catalog name, a Hub id org/name, a config.json path, or "
            "package.module:function",
            given=repr(source),
            fix="e.g. tilefit estimate gpt2",
        )
    source = source.strip()
    named = _named_config(source, revision)
    if named is not None:
        return hf_workload(named[0], named[1], task=task, seq_len=seq_len,
                           input_shape=input_shape, target_seq_len=target_seq_len,
                           image_size=image_size)
    if looks_like_factory(source):
        if target_seq_len is not None or image_size is not None:
            raise TilefitError(
                f"{source} is a plain nn.Module factory; target_seq_len and image_size apply "
                "to Hugging Face configs",
                expected="load_workload(..., input_shape=...) for a factory",
                given=f"target_seq_len={target_seq_len}, image_size={image_size}",
                fix="pass load_workload(..., target_seq_len=None, image_size=None) and give "
                "load_workload(..., input_shape=...)")
        return _factory_workload(source, seq_len=seq_len, input_shape=input_shape, task=task)
    raise catalog.unknown_model_error(source)


def _named_config(source: str, revision: str | None) -> tuple[str, dict[str, Any]] | None:
    """The name and config of a catalog model, a config.json path or a Hub id (None: a
    factory or an unknown name). A revision pins a Hub id, so it skips the catalog."""
    is_hub = hub.is_hub_id(source)
    if revision is not None and not is_hub:
        raise TilefitError(
            f"a revision pins a Hugging Face Hub id's config; {source!r} is not one",
            expected="a Hub id org/name with load_workload(..., revision=...)",
            given=f"load_workload({source!r}, revision={revision!r})",
            fix="pass load_workload(..., revision=None) (catalog models ship their config; a "
            "local config.json is read as it is), or give the model's Hub id")
    name = None if revision is not None else catalog.resolve_name(source)
    if name is not None:
        return name, catalog.catalog_entry(name)
    path = Path(os.path.expanduser(source))
    if path.suffix == ".json" or path.is_file() or path.is_dir():
        return source, _read_config(path)
    if not is_hub:
        return None
    fetched = hub.config_file(source, revision)
    return source, {**_read_config(fetched), **hub.source_notes(source, fetched)}


def _read_config(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise TilefitError(
            f"config file {str(path)!r} does not exist",
            expected="the path of a Hugging Face config.json",
            given=str(path),
            fix="check the path (a folder holding config.json also works)",
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TilefitError(
            f"cannot read {path} as JSON: {exc}",
            expected="a Hugging Face config.json",
            given=str(path),
            fix="pass the model's config.json (JSON object with model_type, hidden_size, ...)",
        ) from None
    if not isinstance(config, dict):
        raise TilefitError(
            f"{path} is not a JSON object",
            expected="a Hugging Face config.json (a JSON object)",
            given=type(config).__name__,
            fix="pass the model's config.json",
        )
    from tilefit.compat.transformers import decode_special_floats

    return decode_special_floats(config)


def hf_workload(
    name: str,
    config: dict[str, Any],
    *,
    task: str | None,
    seq_len: int | None,
    input_shape: tuple[int, ...] | None = None,
    target_seq_len: int | None = None,
    image_size: int | None = None,
) -> Workload:
    hf.check_model_type(config, repr(name))
    task = task or tasks.default_task(config)
    tasks.check_task(config, task)
    if image_size is not None:
        if task != "image-cls":
            raise TilefitError(f"{name} ({task}) is not an image model; it takes no image size",
                               expected="load_workload(..., image_size=...) for image "
                               "classification", given=f"image_size={image_size}",
                               fix="pass load_workload(..., image_size=None)")
        inputs.check_image_size(image_size)
        config = _with_image_size(config, image_size)
    try:
        cfg = hf.make_config(config)
    except hf.config_rejections() as exc:
        raise TilefitError(
            f"transformers rejects the config of {name}: {exc}",
            expected="a config.json whose fields transformers accepts",
            given=name,
            fix="compare the fields with the model's published config.json",
        ) from None
    shape = inputs.resolve_input_shape(name, cfg, task, input_shape)
    return Workload(
        name=name,
        task=task,
        config=MappingProxyType(config),
        seq_len=(resolved := _resolve_seq_len(name, cfg, task, seq_len)),
        input_shape=shape,
        target_seq_len=inputs.resolve_target(cfg, task, resolved, target_seq_len, shape),
    )


def _with_image_size(config: dict[str, Any], image_size: int) -> dict[str, Any]:
    """The config built for ``image_size`` (ViT's position table): its own field, or its
    vision tower's in a vision-language config (CLIP's vision_config)."""
    vision = config.get("vision_config")
    if "image_size" not in config and isinstance(vision, dict):
        return {**config, "vision_config": {**vision, "image_size": image_size}}
    return {**config, "image_size": image_size}


def _resolve_seq_len(name: str, cfg: Any, task: str, seq_len: int | None) -> int | None:
    """Tokens per sample: as given (within the model's positions) or the task's default; None
    for inputs that are not tokens (images, log-mel features, audio)."""
    if task not in tasks.TOKEN_INPUT_TASKS:
        if seq_len is not None:
            what = "an image" if task == "image-cls" else "a speech"
            raise TilefitError(
                f"{name} is {what} model; it takes no seq_len",
                expected=f"load_workload(..., seq_len=None) for {task}",
                given=f"seq_len={seq_len}",
                fix="pass load_workload(..., seq_len=None) (the input's size comes from the "
                "config, or load_workload(..., image_size=...); "
                "load_workload(..., target_seq_len=...) sets the labels' length)",
            )
        return None
    resolved = hf.choose_seq_len(task, cfg) if seq_len is None else seq_len
    hf.check_seq_len(name, cfg, resolved)
    return resolved


def _factory_workload(
    source: str, *, seq_len: int | None, input_shape: Any, task: str | None
) -> Workload:
    if task not in (None, MODULE_TASK):
        raise TilefitError(
            f"task {task!r} does not apply to a plain nn.Module factory",
            expected=f"no task (or {MODULE_TASK!r}) for package.module:function",
            given=task,
            fix="pass load_workload(..., task=None); the stand-in loss is the mean of the "
            "output",
        )
    if seq_len is not None:
        raise TilefitError(
            f"{source} is a plain nn.Module factory; seq_len does not apply",
            expected="load_workload(..., input_shape=...) giving one sample's shape",
            given=f"seq_len={seq_len}",
            fix="pass load_workload(..., input_shape=(3, 224, 224)) instead of seq_len; the "
            "batch is float32",
        )
    factory.load_factory(source)  # fail now, not at trace time, if it cannot be imported
    shape = factory.check_input_shape(source, input_shape)
    return Workload(name=source, task=MODULE_TASK, config=None, seq_len=None, input_shape=shape)

