"""0.1.0's keywords (``estimate(model, batch, optimizer="sgd", device="h100")``) are refused
with a one-line TypeError naming their new spelling, before anything runs; each spelling
names a parameter and fields that exist."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any

import pytest
import torch

import tilefit
from tilefit.old_keywords import OLD_KEYWORDS

# the classes a spelling may build, by the name it writes
CLASSES = {name: getattr(tilefit, name) for name in (
    "Recipe", "Compile", "Parallelism", "Lora", "PlanSearch", "TuneSearch", "NoiseMeasure")}
CASES = [(function, keyword) for function, old in OLD_KEYWORDS.items() for keyword in old]


class _Untouched:
    """A model and batch source that fails the test if the call uses it."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def model(self) -> torch.nn.Module:
        self.used.append("model built")
        return torch.nn.Linear(2, 2)

    def batch(self, b: int) -> torch.Tensor:
        self.used.append("batch drawn")
        return torch.zeros(b, 2)


def _call(function: str, keyword: str, value: Any, probe: _Untouched) -> None:
    fn = getattr(tilefit, function)
    if function in ("tune", "noise_scale"):
        fn(probe.model, probe.batch, optimizer="sgd", **{keyword: value})
    elif function == "plan":
        fn(probe.model, torch.zeros(4, 2), global_batch=8, **{keyword: value})
    else:
        fn(probe.model, torch.zeros(4, 2), **{keyword: value})


@pytest.mark.parametrize(("function", "keyword"), CASES)
def test_each_old_keyword_is_refused_with_its_new_spelling_before_anything_runs(
        function: str, keyword: str) -> None:
    probe = _Untouched()
    with pytest.raises(TypeError) as err:
        _call(function, keyword, 3, probe)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"tilefit.{function}() no longer takes {keyword}=: write ")
    assert message.endswith(OLD_KEYWORDS[function][keyword].format("3"))
    assert probe.used == []


def test_the_message_writes_the_values_given() -> None:
    probe = _Untouched()
    with pytest.raises(TypeError) as err:
        tilefit.estimate(probe.model, torch.zeros(4, 2), optimizer="sgd", device="h100")
    assert str(err.value) == ("tilefit.estimate() no longer takes optimizer=, device=: write "
                              "recipe=Recipe(optimizer='sgd'); gpu='h100'")
    with pytest.raises(TypeError) as err:
        tilefit.tune(probe.model, probe.batch, optimizer="sgd", max_batch=64)
    assert str(err.value) == ("tilefit.tune() no longer takes max_batch=: write "
                              "search=TuneSearch(max_batch=64)")
    with pytest.raises(TypeError) as err:  # an object's repr is not written out
        tilefit.plan(probe.model, global_batch=8, zero_config=object(), allow_peft=True)
    assert str(err.value) == (
        "tilefit.plan() no longer takes zero_config=, allow_peft=: write "
        "recipe=Recipe(parallel=Parallelism(zero=...)); search=PlanSearch(allow_lora=True)")
    assert probe.used == []


def test_a_misspelt_keyword_is_pythons_own_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'presicion'"):
        tilefit.estimate("gpt2", presicion="fp32")


def test_no_old_keyword_shadows_a_current_parameter() -> None:
    # tune's own precision= and device= are not 0.1.0's recipe keywords
    for function, old in OLD_KEYWORDS.items():
        params = inspect.signature(getattr(tilefit, function)).parameters
        assert not set(old) & set(params), function
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), function


@pytest.mark.parametrize(("function", "keyword"), CASES)
def test_each_new_spelling_names_a_parameter_and_fields_that_exist(function: str,
                                                                    keyword: str) -> None:
    spelling = OLD_KEYWORDS[function][keyword].format("1")
    if spelling.startswith("tilefit.load_workload("):  # a model built from its options
        call = ast.parse(spelling.split(" as ")[0]).body[0].value  # type: ignore[attr-defined]
        params = inspect.signature(tilefit.load_workload).parameters
        assert all(k.arg in params for k in call.keywords)
        return
    (kw,) = ast.parse(f"f({spelling})").body[0].value.keywords  # type: ignore[attr-defined]
    assert kw.arg in inspect.signature(getattr(tilefit, function)).parameters
    _check_fields(kw.value)


def _check_fields(node: ast.expr) -> None:
    if not isinstance(node, ast.Call):
        return
    kind = CLASSES[node.func.id]  # type: ignore[attr-defined]
    names = {f.name for f in dataclasses.fields(kind)}
    for kw in node.keywords:
        assert kw.arg in names, (kind.__name__, kw.arg)
        _check_fields(kw.value)
