"""Batch-size tuning on the live device: exact largest fitting batch, fastest aligned batch,
global batch kept by accumulation, all state restored. See ``tuner.tune``."""

from tilefit.tuning.executor import Trial, is_oom
from tilefit.tuning.noise import NoiseScale
from tilefit.tuning.noise_measure import noise_scale
from tilefit.tuning.options import NoiseMeasure, TuneSearch
from tilefit.tuning.outlook import Outlook
from tilefit.tuning.search import FitProbe, FitSearch, candidate_sizes, choose_batch, find_max_batch
from tilefit.tuning.tuner import DEFAULT_MARGIN, TuneResult, tune

__all__ = [
    "DEFAULT_MARGIN",
    "FitProbe",
    "FitSearch",
    "NoiseMeasure",
    "NoiseScale",
    "Outlook",
    "Trial",
    "TuneResult",
    "TuneSearch",
    "candidate_sizes",
    "choose_batch",
    "find_max_batch",
    "is_oom",
    "noise_scale",
    "tune",
]

