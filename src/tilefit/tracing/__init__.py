"""Tracing one real training step on fake tensors (no weights allocated, no GPU needed)."""

from tilefit.tracing.records import OpRecord, StorageRecord, Trace
from tilefit.tracing.step import trace

__all__ = ["OpRecord", "StorageRecord", "Trace", "trace"]
