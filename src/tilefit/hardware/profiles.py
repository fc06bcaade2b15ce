"""Where profiles live: <user cache dir>/profiles/<device>.json (TILEFIT_CACHE_DIR overrides).

The on-disk side of ``tilefit.hardware.profile.Profile``: `tilefit calibrate` saves what it
fitted with ``save_profile``; device lookup (tilefit.hardware.lookup) applies it through
``stored_profile``, which reads each profile file once per process. ``load_profile`` reads the
file now, every call.

No torch import: device lookup reads profiles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tilefit.errors import TilefitError
from tilefit.hardware.profile import Profile

CACHE_ENV = "TILEFIT_CACHE_DIR"
NO_PROFILE_ENV = "TILEFIT_NO_PROFILE"  # set to 1 to ignore stored profiles (datasheet/probe only)


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("tilefit"))


def profile_path(device: str) -> Path:
    return cache_dir() / "profiles" / f"{device}.json"


def save_profile(profile: Profile) -> Path:
    path = profile_path(profile.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = profile.to_dict()
    data.pop("path", None)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file
    _STORED.pop(path, None)  # the next lookup in this process sees the new profile
    return path


def _profiles_off() -> bool:
    """True when TILEFIT_NO_PROFILE asks for datasheet/probe figures only."""
    return os.environ.get(NO_PROFILE_ENV, "") not in ("", "0")


def load_profile(device: str) -> Profile | None:
    """The stored profile of ``device``, read from disk now; None when there is none (or
    profiles are off)."""
    if _profiles_off():
        return None
    return _read(device, profile_path(device))


# stored_profile's answers, by profile file path (a new TILEFIT_CACHE_DIR is a new key).
_STORED: dict[Path, Profile | None] = {}


def stored_profile(device: str) -> Profile | None:
    """The profile device lookup applies to ``device``: ``load_profile``'s answer, read from
    disk the first time this process asks for it (an absent file is remembered too).
    ``save_profile`` and ``clear_profile_cache`` make the next call read again."""
    if _profiles_off():
        return None
    path = profile_path(device)
    if path not in _STORED:
        _STORED[path] = _read(device, path)  # an unreadable file raises and is not cached
    return _STORED[path]


def clear_profile_cache() -> None:
    """Forget what ``stored_profile`` read, so that the next lookup reads the files again."""
    _STORED.clear()


def _read(device: str, path: Path) -> Profile | None:
    if not path.is_file():
        return None
    try:
        return Profile.from_dict(json.loads(path.read_text()), path=str(path))
    except (ValueError, TypeError, KeyError) as exc:
        raise TilefitError(
            f"the calibration profile {str(path)!r} is unreadable",
            expected="a JSON file written by `tilefit calibrate`",
            given=f"{type(exc).__name__}: {exc}",
            fix=f"delete it and run `tilefit calibrate --device {device}` again",
        ) from None
