"""Process groups: `Comm` (collectives on one group, with counters) and `Topology` (dp x pp x ep groups)."""

from dstrain.dist.comm import Comm, CommStatistics
from dstrain.dist.topology import Coordinates, Layout, Topology

__all__ = ["Comm", "CommStatistics", "Coordinates", "Layout", "Topology"]
