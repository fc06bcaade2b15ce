"""tune_trainer against the real transformers.Trainer (with accelerate), on the CPU.

Tiny models built from configs (GPT-2, Llama, BERT), a simulated device (memory_limit_bytes)
and, for the end-to-end cases, trainer.train() at the chosen batch under the same simulated
device: the tuned batch must train without running out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from tilefit.errors import TilefitError
from tilefit.tuning.integrations import adapter, hf, hf_data
from tilefit.tuning.integrations.hf import (
    precision_of,
    split_effective_batch,
    train_with_memory_limit,
    tune_trainer,
)
from tilefit.tuning.simulate import MemoryLimitMode

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEQ_TOKENS = 32
VOCAB = 256
CAP_BYTES = 20_000_000  # the simulated device
# Many divisors, so the chosen micro-batch (the largest divisor of the effective batch that
# fits, when untimed) sits right at the largest fitting batch: a tight end-to-end check.
EFFECTIVE = 120


@pytest.fixture(autouse=True)
def _quiet_single_threaded() -> Iterator[None]:
    """transformers' warnings off; one torch thread: these steps are tiny, and on a shared
    machine several threads per step cost far more in waiting than they gain."""
    logger = logging.getLogger("transformers")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def plain_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The reference: the tiny GPT-2 in train mode with the stock Trainer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tune_untimed(make_trainer(gpt2(), TokenData(), tmp_path_factory.mktemp("ref")))
    finally:
        torch.set_num_threads(threads)


class TokenData(Dataset):
    """Fixed-length causal-LM samples (input_ids == labels) plus a column the model ignores."""

    def __init__(self, n: int = 64, seq: int = SEQ_TOKENS, label_seq: int | None = None,
                 key: str = "input_ids") -> None:
        self.n, self.seq, self.label_seq, self.key = n, seq, label_seq or seq, key

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = (torch.arange(self.seq) * 7 + i) % VOCAB
        return {self.key: ids, "labels": ids[: self.label_seq].clone(), "text": "unused"}


class StreamedTokens(IterableDataset):
    """A streaming dataset (no len, no indexing), like datasets' streaming=True."""

    def __init__(self, n: int = 200) -> None:
        self.n = n
        self.read = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.n):
            self.read += 1
            ids = (torch.arange(SEQ_TOKENS) * 3 + i) % VOCAB
            yield {"input_ids": ids, "labels": ids.clone()}


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def make_trainer(model: Any, dataset: Any, tmp_path: Path, trainer_cls: Any = None,
                 **args: Any) -> Any:
    defaults = {"per_device_train_batch_size": EFFECTIVE, "gradient_accumulation_steps": 1,
                "max_steps": 2}
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_strategy="no", **{**defaults, **args})
    return (trainer_cls or transformers.Trainer)(model=model, args=targs, train_dataset=dataset)


def tune_untimed(trainer: Any, **kw: Any) -> Any:
    return tune_trainer(trainer, memory_limit_bytes=CAP_BYTES, measure_throughput=False, **kw)


def trains_within_cap(trainer: Any) -> int:
    """trainer.train() for its max_steps under the simulated device; its peak bytes."""
    out = train_with_memory_limit(trainer, CAP_BYTES)
    assert trainer.state.global_step == trainer.args.max_steps
    return int(out.metrics["tilefit_peak_bytes"])


def args_besides_batch(trainer: Any) -> dict[str, Any]:
    d = trainer.args.to_dict()
    for k in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        d.pop(k)
    return d


# ---- 5: an eval-mode model (from_pretrained leaves it so) tunes in train mode --------------


def test_eval_mode_model_is_tuned_in_train_mode_and_its_batch_trains(tmp_path: Path,
                                                                     plain_gpt2: Any) -> None:
    train_mode = plain_gpt2
    model = gpt2().eval()  # dropout off: fewer saved masks than training has
    trainer = make_trainer(model, TokenData(), tmp_path)
    args_before = args_besides_batch(trainer)
    weights_before = [p.detach().clone() for p in model.parameters()]
    result = tune_untimed(trainer)
    # the same batch as the train-mode model: tuned as train() runs it, not in eval mode
    assert result.max_fitting_batch_size == train_mode.max_fitting_batch_size
    assert not any(m.training for m in model.modules())  # the user's mode is back
    assert all(torch.equal(a, b) for a, b in zip(weights_before, model.parameters(),
                                                 strict=True))
    args = trainer.args
    assert args.per_device_train_batch_size == result.batch_size
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == EFFECTIVE
    assert args_besides_batch(trainer) == args_before  # only the two documented fields
    assert result.batch_size == max(d for d in range(1, EFFECTIVE + 1)
                                    if EFFECTIVE % d == 0 and d <= result.max_fitting_batch_size)
    assert trains_within_cap(trainer) <= CAP_BYTES


# ---- 2: the Trainer subclass's own compute_loss ---------------------------------------------


class HeavyLossTrainer(transformers.Trainer):
    """A custom loss that keeps extra activations (4 copies of the logits) for backward."""

    calls: list[Any]

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        self.calls.append(num_items_in_batch)
        outputs = model(**inputs)
        wide = outputs.logits.repeat(1, 1, 4)
        loss = outputs.loss + 1e-4 * (wide * wide).mean()
        return (loss, outputs) if return_outputs else loss


def test_custom_compute_loss_is_what_is_tuned(tmp_path: Path, plain_gpt2: Any) -> None:
    plain = plain_gpt2
    trainer = make_trainer(gpt2(), TokenData(), tmp_path, trainer_cls=HeavyLossTrainer)
    trainer.calls = []
    result = tune_untimed(trainer)
    assert trainer.calls, "the subclass's compute_loss was not called"
    # Trainer passes num_items_in_batch (GPT-2 takes loss kwargs): so does tuning
    assert all(n is not None for n in trainer.calls)
    assert result.max_fitting_batch_size < plain.max_fitting_batch_size
    assert trains_within_cap(trainer) <= CAP_BYTES


def test_compute_loss_with_the_old_signature_is_called_without_num_items() -> None:
    seen: list[tuple[Any, ...]] = []

    class OldStyle:
        args = SimpleNamespace(device=torch.device("cpu"))

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False) -> Any:
            seen.append((model, inputs, return_outputs))
            return torch.tensor(2.0), {"logits": None}  # a tuple: the loss is its first item

    model = torch.nn.Linear(2, 2)
    loss = hf.loss_fn_of(OldStyle())(model.eval(), {"x": torch.zeros(1)})
    assert loss.item() == 2.0 and seen[0][2] is False
    assert model.training  # as Trainer.training_step: model.train() first


# ---- 1: gradient checkpointing from the arguments -------------------------------------------


def checkpointing_state(model: Any) -> list[tuple[str, tuple[str, ...], int]]:
    return [(name, tuple(sorted(k for k in vars(m) if "checkpointing" in k or "require_grads"
                                in k)), len(m._forward_hooks))
            for name, m in model.named_modules()]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_gradient_checkpointing_is_tuned_then_put_back(tmp_path: Path) -> None:
    plain = tune_untimed(make_trainer(llama(), TokenData(), tmp_path))
    model = llama()
    before = checkpointing_state(model)
    trainer = make_trainer(model, TokenData(), tmp_path, gradient_checkpointing=True)
    result = tune_untimed(trainer)
    # recomputing the layers in backward frees their activations: a larger batch fits
    assert result.max_fitting_batch_size > plain.max_fitting_batch_size * 1.3
    assert not model.is_activation_checkpointing
    assert checkpointing_state(model) == before  # attributes and input-grad hooks removed
    assert trains_within_cap(trainer) <= CAP_BYTES  # train() turns checkpointing on itself


def test_checkpointing_arguments_old_and_new_names() -> None:
    assert hf.checkpointing_requested(SimpleNamespace(gradient_checkpointing=True)) == (True, {})
    new = SimpleNamespace(activation_checkpointing=True,
                          activation_checkpointing_kwargs={"every_n_layers": 2})
    assert hf.checkpointing_requested(new) == (True, {"every_n_layers": 2})
    assert hf.checkpointing_requested(SimpleNamespace()) == (False, {})


# ---- 4: precision from the arguments --------------------------------------------------------


def test_bf16_arguments_tune_with_bf16_autocast(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    real_tune = adapter.tune  # the one call of tune, for every framework

    def spy(*a: Any, **kw: Any) -> Any:
        seen.update(kw)
        return real_tune(*a, **kw)

    monkeypatch.setattr(adapter, "tune", spy)
    trainer = make_trainer(gpt2(), TokenData(), tmp_path, bf16=True)
    result = tune_untimed(trainer)
    assert seen["recipe"].precision == "bf16-mixed" and seen["search"].global_batch == EFFECTIVE
    # the Trainer's loop runs in each trial: clipping at its max_grad_norm, its loss read
    assert seen["recipe"].max_grad_norm == trainer.args.max_grad_norm == 1.0
    assert seen["recipe"].loss_sync is trainer.args.logging_nan_inf_filter is True
    assert result.batch_size * result.accumulation_steps == EFFECTIVE
    assert trains_within_cap(trainer) <= CAP_BYTES


def test_precision_of_training_arguments() -> None:
    assert precision_of(SimpleNamespace(bf16=True, fp16=False)) == "bf16-mixed"
    assert precision_of(SimpleNamespace(bf16=False, fp16=True)) == "fp16-mixed"
    assert precision_of(SimpleNamespace(bf16=False, fp16=False, tf32=True)) == "tf32"
    assert precision_of(SimpleNamespace(bf16=False, fp16=False, tf32=None)) == "fp32"
    bf16_weights = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert precision_of(SimpleNamespace(bf16=False, fp16=False), bf16_weights) == "bf16-true"


def test_split_effective_batch_keeps_the_product() -> None:
    assert split_effective_batch(32, 8) == (8, 4)  # 8 * 4 = 32
    assert split_effective_batch(96, 24) == (24, 4)  # 24 * 4 = 96
    with pytest.raises(TilefitError, match="does not divide"):
        split_effective_batch(32, 12)


# ---- 3: batches from the Trainer's own data --------------------------------------------------


def test_streaming_dataset_is_read_lazily_and_its_batch_trains(tmp_path: Path) -> None:
    stream = StreamedTokens()
    trainer = make_trainer(gpt2(), stream, tmp_path, per_device_train_batch_size=8,
                           gradient_accumulation_steps=8)
    result = tune_untimed(trainer)
    assert 64 % result.batch_size == 0
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps \
        == 64
    assert stream.read == 64  # read once, as far as one optimizer step's samples
    assert trains_within_cap(trainer) <= CAP_BYTES


def test_short_streams_wrap_around_and_empty_ones_are_an_error() -> None:
    pool = hf.read_samples(StreamedTokens(n=3), 64)
    assert len(pool) == 3
    batch = hf_data._pick(pool, 0, 7)
    assert len(batch) == 7 and torch.equal(batch[3]["input_ids"], batch[0]["input_ids"])
    with pytest.raises(TilefitError, match="no samples"):
        hf.read_samples(StreamedTokens(n=0), 2)


def test_the_trainer_collator_and_column_removal_make_the_batches(tmp_path: Path) -> None:
    trainer = make_trainer(gpt2(), TokenData(n=5), tmp_path)
    registered = len(trainer.accelerator._dataloaders)
    batch = hf.make_batch_fn(trainer, 7)(7)  # more than the dataset holds: wraps around
    assert set(batch) == {"input_ids", "labels"}  # "text" removed as Trainer removes it
    assert batch["input_ids"].shape == (7, SEQ_TOKENS)
    assert len(trainer.accelerator._dataloaders) == registered  # the Trainer is unchanged


def test_the_other_micro_batches_of_a_step_are_held_as_train_holds_them(tmp_path: Path) -> None:
    # Trainer fetches all gradient_accumulation_steps micro-batches of an optimizer step onto
    # the device before the first forward: a batch of 8 with an effective batch of 40 has
    # the other 32 samples in memory too, until the next batch is made.
    trainer = make_trainer(gpt2(), TokenData(n=16), tmp_path)
    make_batch = hf.make_batch_fn(trainer, 40)
    sample_bytes = 2 * SEQ_TOKENS * 8  # input_ids and labels, int64
    with MemoryLimitMode(None) as mode:
        small = make_batch(8)
        assert mode.live_bytes == 40 * sample_bytes
        del small
        whole = make_batch(40)  # the whole step in one micro-batch: nothing else held
        assert mode.live_bytes == 40 * sample_bytes
        assert whole["input_ids"].shape == (40, SEQ_TOKENS)


@pytest.mark.parametrize(("dataset", "words"), [
    (TokenData(key="input_idz"), ["input_ids", "remove_unused_columns", "labels: int64[2, 32]"]),
    (TokenData(label_seq=29), ["labels: int64[2, 29]", "input_ids: int64[2, 32]"]),
], ids=["wrong-key", "shape-mismatch"])
def test_bad_batches_are_explained(dataset: Any, words: list[str], tmp_path: Path,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(gpt2(), dataset, tmp_path)
    with pytest.raises(TilefitError) as info:
        tune_untimed(trainer, predicted_max_batch=2)
    err = info.value
    assert err.expected and err.given and err.fix
    for word in words:
        assert word in str(err)
    assert "FakeTensor" not in capfd.readouterr().err  # no fake-tensor log on the way


def test_errors_in_the_fake_prediction_are_clean_too(tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(gpt2(), TokenData(label_seq=29), tmp_path)
    with pytest.raises(TilefitError, match="compute_loss failed") as info:
        tune_untimed(trainer)  # the estimator's fake-tensor trace runs first
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "FakeTensor" not in capfd.readouterr().err


def test_a_collator_that_cannot_stack_is_explained(tmp_path: Path) -> None:
    class Ragged(TokenData):
        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = torch.arange(8 + i % 3)
            return {"input_ids": ids, "labels": ids}

    trainer = make_trainer(gpt2(), Ragged(), tmp_path)
    with pytest.raises(TilefitError, match="collator could not batch") as info:
        tune_untimed(trainer, predicted_max_batch=2)
    assert "DataCollatorWithPadding" in str(info.value.fix)
