"""Auditing a training step: findings (what is slow or too big, where it comes from, the fix in
the user's terms) with gains predicted by re-estimating the step with the fix applied."""

from __future__ import annotations

from tilefit.advise.audit import Audit, audit
from tilefit.advise.findings import Finding

__all__ = ["Audit", "Finding", "audit"]
