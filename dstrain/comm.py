"""Moved to `dstrain.dist.comm`; this name stays importable."""

from dstrain.dist.comm import Comm, CommStatistics

__all__ = ["Comm", "CommStatistics"]
