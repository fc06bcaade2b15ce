"""Batch-size tuning on the live device: exact largest fitting batch, fastest aligned batch,
global batch kept by accumulation, all state restored. See ``tuner.tune``."""

from tilefit.tune.executor import Trial, is_oom
from tilefit.tune.search import FitProbe, FitSearch, candidate_sizes, choose_batch, find_max_batch
from tilefit.tune.tuner import DEFAULT_MARGIN, TuneResult, tune

__all__ = [
    "DEFAULT_MARGIN",
    "FitProbe",
    "FitSearch",
    "Trial",
    "TuneResult",
    "candidate_sizes",
    "choose_batch",
    "find_max_batch",
    "is_oom",
    "tune",
]


class _CallableModule(__import__("types").ModuleType):
    """``tilefit.tune`` is both this package and the function: once the package is imported,
    Python binds the attribute ``tilefit.tune`` to the module, so the module forwards calls
    to ``tune`` and ``tilefit.tune(model, make_batch, ...)`` works either way."""

    def __call__(self, *args: object, **kwargs: object) -> TuneResult:
        return tune(*args, **kwargs)  # type: ignore[arg-type]


__import__("sys").modules[__name__].__class__ = _CallableModule
