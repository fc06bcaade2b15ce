"""The ranks' agreement arithmetic (tuning/ranks.py) without a job: the all-reduce is
replaced by the element-wise MAX / MIN it computes over two ranks' values."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from tilefit.errors import TilefitError
from tilefit.tuning.ranks import DOES_NOT_FIT, FITS, Ranks, rank_share
from tilefit.tuning.search import FitProbe
from tilefit.vocab import PHASES


class TwoRanks(Ranks):
    """Rank 0 of two, the other rank's contribution to each all-reduce given in order."""

    def __init__(self, others: list[list[float]]) -> None:
        super().__init__(0, 2)
        object.__setattr__(self, "others", others)

    def _reduce(self, values: list[float], op: Any, dtype: Any) -> list[float]:
        other = self.others.pop(0)  # type: ignore[attr-defined]
        pick = max if op == dist.ReduceOp.MAX else min
        return [float(pick(a, b)) for a, b in zip(values, other, strict=True)]


def test_the_worst_outcome_and_the_slowest_times_win() -> None:
    ranks = TwoRanks([[DOES_NOT_FIT, 0.0, 0.0], [FITS, 0.5, 0.1]])
    assert ranks.agree(FITS, [0.2, 0.3]) == (DOES_NOT_FIT, [0.2, 0.3])
    assert ranks.agree(FITS, [0.2, 0.3]) == (FITS, [0.5, 0.3])


def test_the_search_sees_the_rank_with_the_least_room() -> None:
    # this rank: budget 100, peak 60 (40 free); the other: budget 80, peak 55 (25 free).
    # The job's probe: the smaller budget, 80, and the smaller room, 25: peak 55. The
    # other's baseline sits 50 below its budget, this one's 70: 80 - 50 = 30.
    mine = FitProbe(True, peak_bytes=60, budget_bytes=100, baseline_bytes=30,
                    phase_peaks={"forward": 50, "backward": 60, "optimizer": 40})
    # [-budget, peak, baseline, one figure per vocab phase] each relative to the budget;
    # the other rank knows no "optimizer" peak: unknown (inf) on any rank is unknown
    inf = float("inf")
    phases = {"forward": -40.0, "backward": -25.0}
    other = [-80.0, -25.0, -50.0, *(phases.get(p, inf) for p in PHASES)]
    probe = TwoRanks([other]).tightest(mine)
    assert probe == FitProbe(True, peak_bytes=55, budget_bytes=80, baseline_bytes=30,
                             phase_peaks={"forward": 40, "backward": 55})
    assert TwoRanks([]).tightest(FitProbe(False, peak_bytes=9)) == FitProbe(False)


def test_first_probe_is_the_smallest_and_none_only_when_no_rank_has_one() -> None:
    assert TwoRanks([[12]]).smallest_probe(20) == 12
    assert TwoRanks([[2**62]]).smallest_probe(None) is None
    assert TwoRanks([[2**62]]).smallest_probe(7) == 7


def test_the_global_batch_splits_evenly_over_the_ranks() -> None:
    assert rank_share(64, Ranks(1, 4)) == 16 and rank_share(None, Ranks(0, 4)) is None
    with pytest.raises(TilefitError, match="global_batch=8"):
        rank_share(10, Ranks(0, 4))
