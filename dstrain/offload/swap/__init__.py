"""The swap mechanism: slots of one swap file <-> a bounded pinned pool, through one dsio handle.

- `swapper`: `Swapper` (fetch / store / discard of slots and ranges on dsio's loop thread), `Lease`;
- `slots`: `SlotTable`, the copy-on-write slot versions an async save pins (`SwapPin`).
"""

from dstrain.offload.swap.slots import SlotTable, SlotTableStatistics, SwapPin
from dstrain.offload.swap.swapper import Lease, Swapper, SwapperStatistics

__all__ = ["Lease", "SlotTable", "SlotTableStatistics", "SwapPin", "Swapper", "SwapperStatistics"]
