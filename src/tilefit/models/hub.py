"""Any model on the Hugging Face Hub by its id (``org/name``): its ``config.json`` alone.

``config_file`` fetches the one file with huggingface_hub's ``hf_hub_download`` into the
Hugging Face cache (``HF_HUB_CACHE``; a cached file is read offline, ``HF_HUB_OFFLINE=1``
included), at ``revision`` (a branch, tag or commit hash; default ``main``), with the token
huggingface_hub finds (``hf auth login`` or ``HF_TOKEN``). No weights are downloaded: the
model is built from the config on fake tensors or the meta device like any config.json.
Each failure huggingface_hub reports becomes a TilefitError saying what to do.
"""

from __future__ import annotations

from pathlib import Path

from tilefit.errors import TilefitError

CONFIG_NAME = "config.json"
LOCAL_CONFIG = "or pass the model's config.json as a local path"


def is_hub_id(source: str) -> bool:
    """True for ``org/name`` as the Hub spells a repository id (huggingface_hub's own check:
    letters, digits, ``-_.``, no ``--`` or ``..``). A bare name is not taken as one: a typo
    of a catalog name keeps its did-you-mean."""
    if source.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def config_file(repo_id: str, revision: str | None = None) -> Path:
    """The path of ``repo_id``'s config.json in the Hugging Face cache, downloaded if it is
    not there (one small file) at ``revision`` (None: the main branch)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, CONFIG_NAME, revision=revision))
    except Exception as exc:  # huggingface_hub's errors, read by hub_error
        error = hub_error(exc, repo_id, revision)
        if error is None:
            raise
        raise error from None


def source_notes(repo_id: str, path: Path) -> dict[str, str]:
    """tilefit's ``_`` notes for a config fetched from the Hub (dropped before transformers):
    its id, the commit it was read at (the cache's snapshot folder) and its address."""
    commit = path.parent.name
    return {"_hub_id": repo_id, "_revision": commit,
            "_source": f"https://huggingface.co/{repo_id}/blob/{commit}/{CONFIG_NAME}"}


def hub_error(exc: BaseException, repo_id: str, revision: str | None) -> TilefitError | None:
    """The TilefitError for an error of ``hf_hub_download`` (None: not one it explains)."""
    from huggingface_hub import errors

    at = f"{repo_id} at revision {revision}" if revision else repo_id
    if isinstance(exc, errors.GatedRepoError):
        return TilefitError(
            f"{repo_id} is a gated model: the Hub gives its config.json only to an account "
            "that accepted its terms, with that account's token",
            expected="a Hugging Face token with access to the model",
            given=f"{repo_id} (no token, or one without access)",
            fix=f"accept the terms at https://huggingface.co/{repo_id}, then log in with "
            f"`hf auth login` or set HF_TOKEN; {LOCAL_CONFIG}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return TilefitError(
            f"there is no model {repo_id!r} on the Hugging Face Hub (or it is private)",
            expected="a catalog name (`tilefit models`), a Hub id org/name, a config.json "
            "path, or package.module:function",
            given=f"{repo_id} (not a catalog name nor a local path either)",
            fix="check the spelling on https://huggingface.co/models; for a private model "
            f"log in with `hf auth login` or set HF_TOKEN; {LOCAL_CONFIG}")
    if isinstance(exc, errors.RevisionNotFoundError):
        return TilefitError(
            f"{repo_id} has no revision {revision!r} on the Hugging Face Hub",
            expected="a branch, tag or commit hash of the repository",
            given=f"load_workload(..., revision={revision!r})",
            fix=f"see https://huggingface.co/{repo_id}/commits/main, or pass "
            "load_workload(..., revision=None) (the main branch)")
    if isinstance(exc, errors.LocalEntryNotFoundError | ConnectionError | TimeoutError):
        return _offline_error(repo_id, at)
    if isinstance(exc, errors.EntryNotFoundError):
        return TilefitError(
            f"{at} has no config.json: it is not a transformers model repository",
            expected="a Hub repository with a transformers config.json",
            given=repo_id, fix=f"use the repository of the original model, {LOCAL_CONFIG}")
    if isinstance(exc, errors.HFValidationError):
        return TilefitError(
            f"huggingface_hub refuses {at}: {exc}", expected="a Hub id org/name and a "
            "revision that is a branch, tag or commit hash", given=at,
            fix="correct the id or load_workload(..., revision=...)")
    if isinstance(exc, errors.HfHubHTTPError):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return TilefitError(
            f"the Hugging Face Hub refused the config.json of {at}: {first}",
            expected="the Hub answering with the file", given=at,
            fix=f"check your token (`hf auth whoami`; HF_TOKEN) and try again, {LOCAL_CONFIG}")
    return None


def _offline_error(repo_id: str, at: str) -> TilefitError:
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    why = ("offline mode is on (HF_HUB_OFFLINE)" if offline
           else "the Hugging Face Hub cannot be reached (no network)")
    return TilefitError(
        f"{why}, and the config.json of {at} is not in the Hugging Face cache",
        expected=f"{repo_id}'s config.json in the cache ({constants.HF_HUB_CACHE}) or the "
        "Hub reachable",
        given=f"{repo_id} offline" if offline else f"{repo_id}, no connection",
        fix=f"run once online to cache it ({'unset HF_HUB_OFFLINE' if offline else 'connect'}"
        f"; only config.json is downloaded), {LOCAL_CONFIG}")
