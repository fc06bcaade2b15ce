"""The vocabulary: precisions parse from every spelling users write, and each Precision's
facts agree with what PyTorch, Hugging Face and Lightning do with it."""

from __future__ import annotations

import pytest

from tilefit.errors import TilefitError
from tilefit.hardware import get_device
from tilefit.vocab import (
    PRECISION_NAMES,
    check_precision_supported,
    default_precision,
    device_precisions,
    parse_precision,
    precision_from_hf,
)


@pytest.mark.parametrize(("spelling", "name"), [
    ("bf16-mixed", "bf16-mixed"), ("BF16_MIXED", "bf16-mixed"),
    # Lightning's Trainer(precision=...) spellings (lightning.fabric.connector)
    ("16-mixed", "fp16-mixed"), ("bf16-true", "bf16-true"), ("32-true", "fp32"),
    ("32", "fp32"), ("16-true", "fp16-true"), ("tf32", "tf32"),
    # a bare 16-bit name is autocast, as HF's bf16=True, Lightning's legacy "bf16" (which
    # its connector turns into "bf16-mixed") and accelerate's mixed_precision="bf16" mean
    ("bf16", "bf16-mixed"), ("fp16", "fp16-mixed"), ("16", "fp16-mixed")])
def test_spellings(spelling: str, name: str) -> None:
    assert parse_precision(spelling).name == name


def test_unknown_precision_suggests_close_names() -> None:
    with pytest.raises(TilefitError, match="did you mean bf16-mixed"):
        parse_precision("bf16-mixd")


def test_lightning_spellings_round_trip() -> None:
    # each precision's Lightning spelling parses back to a precision with the same math
    for name in PRECISION_NAMES:
        p = parse_precision(name)
        back = parse_precision(p.lightning)
        assert (back.autocast_dtype, back.param_dtype) == (p.autocast_dtype, p.param_dtype)


def test_hf_flags_match_training_arguments() -> None:
    # TrainingArguments: bf16=True is bf16 autocast, fp16=True fp16 autocast with a scaler
    assert precision_from_hf(True, False, None).name == "bf16-mixed"
    assert precision_from_hf(False, True, None).grad_scaler
    assert precision_from_hf(False, False, True).allow_tf32
    for name in PRECISION_NAMES:
        p = parse_precision(name)
        flags = p.hf_flags()
        if p.autocast_dtype:  # the flags select the same autocast dtype again
            back = precision_from_hf(flags["bf16"], flags["fp16"], flags["tf32"])
            # TrainingArguments has no fp8 switch: bf16=True, the model converted by torchao;
            # nor fp16 without its scaler (fp16=True always scales: fp16-mixed)
            assert back == p or (p.float8_linears and back.name == "bf16-mixed") or (
                p.name == "fp16-mixed-unscaled" and back.name == "fp16-mixed")


def test_device_precisions_and_defaults() -> None:
    # V100: fp16 Tensor Cores, no bf16, no TF32 (Volta whitepaper); A100: bf16 and TF32
    assert [p.name for p in device_precisions(get_device("v100"))] == ["fp16-mixed", "fp32"]
    assert [p.name for p in device_precisions(get_device("a100-80gb"))] == ["bf16-mixed",
                                                                          "tf32"]
    assert default_precision(get_device("t4")) == "fp16-mixed"
    with pytest.raises(TilefitError, match="no bf16 math"):
        check_precision_supported("bf16-mixed", get_device("v100"))


def test_recipe_reads_any_spelling_once() -> None:
    from tilefit.recipe import Recipe

    r = Recipe(batch_size=4, accumulation_steps=8)
    assert r.global_batch == 32 and r.with_batch(2).global_batch == 16
    # Lightning's spelling becomes the canonical name; an unambiguous one adds no note
    assert Recipe(precision="16-mixed").precision == "fp16-mixed"
    assert Recipe(precision="16-mixed").notes == ()
    # a bare "bf16" is autocast, and the recipe says how it read it, in one line
    (note,) = Recipe(precision="bf16").notes
    assert Recipe(precision="bf16").precision == "bf16-mixed"
    assert "bf16-mixed" in note and "'bf16-true'" in note and "\n" not in note
    assert Recipe(precision="bf16-true").spec.autocast_dtype is None
    with pytest.raises(TilefitError, match="unknown precision"):
        Recipe(precision="fp12")


def test_mixed_precision_by_its_half_dtype() -> None:
    from tilefit.vocab import mixed_precision

    assert mixed_precision("bf16").name == "bf16-mixed"
    assert mixed_precision("fp16").grad_scaler


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "1.0"])
def test_max_grad_norm_must_be_positive(value: object) -> None:
    from tilefit.vocab import check_max_grad_norm

    with pytest.raises(TilefitError, match=r"Recipe\(max_grad_norm=None\)"):
        check_max_grad_norm(value)  # type: ignore[arg-type]


def test_every_phase_has_one_issuer() -> None:
    # the host model and its calibration count a phase's ops under the same issuer
    from tilefit.hardware.host import issuer_of
    from tilefit.vocab import OPTIMIZER_PHASES, PHASES

    assert {p: issuer_of(p) for p in PHASES} == {
        "forward": "forward", "backward": "backward", "recompute": "backward",
        "loss_check": "forward",  # the training loop's Python, like the model's forward
        **dict.fromkeys(OPTIMIZER_PHASES, "optimizer")}


