"""Any Hugging Face Hub id (models/hub.py): its config.json alone, read through the Hugging
Face cache by huggingface_hub itself, at a pinned --revision; every failure huggingface_hub
reports is an exit 2 that says what to do. Nothing here reaches the network: the cache is
written in the test in the layout huggingface_hub reads (models--org--name/snapshots/<commit>,
refs/main), offline; the Hub's answers (gated, not found) are huggingface_hub's own exception
classes raised by a stand-in download."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import huggingface_hub
import typer
from huggingface_hub import constants, errors
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.models import load_workload

MAIN = "a" * 40  # the commit refs/main points at
PINNED = "b" * 40  # an older commit, read only with --revision
REPO = "tiny-org/tiny-gpt2"


def _gpt2(layers: int) -> dict[str, Any]:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": layers,
            "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 128,
            "bos_token_id": 0, "eos_token_id": 0}


# GPT-2's parameters by hand (tied output head): wte 128x64 + wpe 128x64 = 16384; per layer
# ln_1 128, c_attn 64x192+192 = 12480, attn c_proj 64x64+64 = 4160, ln_2 128,
# c_fc 64x256+256 = 16640, mlp c_proj 256x64+64 = 16448: 49984; ln_f 128.
PARAMS = {2: 16384 + 2 * 49984 + 128, 4: 16384 + 4 * 49984 + 128}


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding REPO's config.json at two commits (main: 2 layers, the
    pinned one: 4), offline; for this process (huggingface_hub reads its constants once, at
    import) and for a CLI subprocess (the environment)."""
    cache = tmp_path / "hf-cache"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    for commit, layers in ((MAIN, 2), (PINNED, 4)):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(json.dumps(_gpt2(layers)))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a test of the Hub ids tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _download_raises(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def download(*args: object, **kwargs: object) -> str:
        raise exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)


def _http_error(cls: type[errors.HfHubHTTPError], message: str) -> errors.HfHubHTTPError:
    """One of huggingface_hub's HTTP errors, as hf_raise_for_status raises it (the response
    only lends its headers and request)."""
    return cls(message, response=SimpleNamespace(headers={}, request=None))  # type: ignore[arg-type]


def _run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


# --- a Hub id read from the cache -----------------------------------------------------------

def test_hub_id_estimates_from_its_cached_config_in_a_fresh_cli(hub_cache: Path, cli) -> None:
    """The command as a user types it, huggingface_hub set up by the environment alone."""
    proc = cli("estimate", REPO, "--gpu", "cpu", "--json", "--no-ops", "--batch", "2",
               "--seq", "32", timeout_s=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["model"], out["task"], out["seq_len"]) == (REPO, "causal-lm", 32)
    assert out["param_count"] == PARAMS[2]


def test_revision_reads_the_pinned_commit(hub_cache: Path) -> None:
    main = load_workload(REPO)
    pinned = load_workload(REPO, revision=PINNED)
    assert (main.config["n_layer"], main.config["_revision"]) == (2, MAIN)
    assert (pinned.config["n_layer"], pinned.config["_revision"]) == (4, PINNED)
    assert pinned.config["_source"] == f"https://huggingface.co/{REPO}/blob/{PINNED}/config.json"
    assert load_workload(REPO, revision="main").config["_revision"] == MAIN


@pytest.mark.parametrize("command", ["estimate", "audit", "tune"])
def test_cli_revision_is_passed_through(command: str, hub_cache: Path) -> None:
    """A commit the cache lacks: the offline error names it, so --revision reached
    huggingface_hub (the pinned commit's own config is read in the test above)."""
    absent = "c" * 40
    text = _fails(command, REPO, "--revision", absent, "--gpu", "cpu")
    assert f"config.json of {REPO} at revision {absent} is not in the Hugging Face cache" \
        in text


def test_catalog_names_never_call_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    _download_raises(monkeypatch, AssertionError("the catalog called hf_hub_download"))
    assert load_workload("gpt2").name == "gpt2"
    assert load_workload("openai-community/gpt2").name == "gpt2"  # the catalog's own hub id


# --- what huggingface_hub reports, as exit 2 with the way out --------------------------------

def _fails(*args: str) -> str:
    result = _run(*args)
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_a_repo_not_in_the_cache_offline_says_so(hub_cache: Path) -> None:
    text = _fails("estimate", "tiny-org/absent", "--gpu", "cpu")
    assert "offline mode is on (HF_HUB_OFFLINE)" in text
    assert "config.json of tiny-org/absent is not in the Hugging Face cache" in text
    assert "pass the model's config.json as a local path" in text
    assert "run once online" in text


def test_no_network_without_offline_mode_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _download_raises(monkeypatch, errors.LocalEntryNotFoundError("cannot find it"))
    text = _fails("audit", "tiny-org/x", "--gpu", "cpu")
    assert "the Hugging Face Hub cannot be reached (no network)" in text
    assert "run once online" in text


def test_gated_model_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    _download_raises(monkeypatch, _http_error(errors.GatedRepoError, "403 gated"))
    text = _fails("estimate", "meta-llama/Llama-4-Tiny", "--gpu", "cpu")
    assert "meta-llama/Llama-4-Tiny is a gated model" in text
    assert "`hf auth login`" in text and "HF_TOKEN" in text
    assert "https://huggingface.co/meta-llama/Llama-4-Tiny" in text


def test_repo_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    _download_raises(monkeypatch, _http_error(errors.RepositoryNotFoundError, "404"))
    text = _fails("plan", "tiny-org/nope", "--gpu", "cpu", "--global-batch", "8")
    assert "there is no model 'tiny-org/nope' on the Hugging Face Hub" in text


def test_revision_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    _download_raises(monkeypatch, _http_error(errors.RevisionNotFoundError, "404"))
    text = _fails("estimate", "tiny-org/x", "--revision", "v9", "--gpu", "cpu")
    assert "tiny-org/x has no revision 'v9'" in text and "--revision v9" in text


def test_repo_without_config_json(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
    exc = _http_error(cls, "404") if issubclass(cls, errors.HfHubHTTPError) else cls("404")
    _download_raises(monkeypatch, exc)
    text = _fails("estimate", "tiny-org/gguf-only", "--gpu", "cpu")
    assert "tiny-org/gguf-only has no config.json" in text


def test_another_hub_answer_says_what_the_hub_said(monkeypatch: pytest.MonkeyPatch) -> None:
    _download_raises(monkeypatch, _http_error(errors.HfHubHTTPError, "401 Invalid token"))
    text = _fails("estimate", "tiny-org/x", "--gpu", "cpu")
    assert "the Hugging Face Hub refused the config.json of tiny-org/x: 401 Invalid token" \
        in text


@pytest.mark.parametrize("source", ["gtp2", "a/b/c", "org--x/name", "org/na..me"])
def test_neither_catalog_path_factory_nor_repo_id_keeps_did_you_mean(
        source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _download_raises(monkeypatch, AssertionError("not a repo id: no download"))
    with pytest.raises(TilefitError, match="unknown model") as err:
        load_workload(source)
    if source == "gtp2":
        assert "did you mean gpt2" in str(err.value)


def test_revision_applies_to_hub_ids_only() -> None:
    with pytest.raises(TilefitError, match="a revision pins a Hugging Face Hub id"):
        load_workload("gpt2", revision="main")


# --- every command takes the same model options ----------------------------------------------

MODEL_OPTIONS = {"--seq", "--input-shape", "--task", "--target-seq", "--image-size",
                 "--revision"}


@pytest.mark.parametrize("command", ["estimate", "audit", "plan", "tune", "noise-scale"])
def test_every_model_command_takes_the_model_options(command: str) -> None:
    group = typer.main.get_command(app)
    params = group.commands[command].params  # type: ignore[attr-defined]
    options = {o for p in params for o in p.opts if o.startswith("--")}
    assert options >= MODEL_OPTIONS, MODEL_OPTIONS - options


@pytest.mark.parametrize("args", [
    ("audit", "gpt2", "--gpu", "cpu"),
    ("plan", "gpt2", "--gpu", "cpu", "--global-batch", "8"),
    ("tune", "gpt2", "--gpu", "cpu"),
])
def test_image_size_reaches_the_workload(args: tuple[str, ...]) -> None:
    """GPT-2 is no image model: the error comes from load_workload, so the flag got there."""
    assert "gpt2 (causal-lm) is not an image model" in _fails(*args, "--image-size", "64")
