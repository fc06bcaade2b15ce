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
