"""Tracing one real training step on fake tensors (no weights allocated, no GPU needed)."""

from tilefit.trace.records import OpRecord, StorageRecord, Trace
from tilefit.trace.step import trace

__all__ = ["OpRecord", "StorageRecord", "Trace", "trace"]
