"""Workers of the dist tests (topology): run inside spawned gloo ranks (once _seams_helpers.py)."""

from __future__ import annotations

from typing import Any

import torch

from dstrain.dist import Layout, Topology


def topology_run(pp: int, ep: int) -> dict[str, Any]:
    """Build the topology on the real world and sum each rank's global rank over each of its groups."""
    topo = Topology.from_world(pp=pp, ep=ep)
    out: dict[str, Any] = {"coords": topo.coords, "sizes": {}, "sums": {}}
    for kind in ("dp", "pp", "ep", "edp"):
        comm = getattr(topo, kind)
        t = torch.tensor([float(topo.world.rank)])
        comm.all_reduce(t)
        out["sizes"][kind] = comm.world_size
        out["sums"][kind] = t.item()
        out[f"{kind}_rank"] = comm.rank
    # broadcast from group rank 0 goes to the right global source
    b = torch.tensor([float(topo.world.rank) + 10])
    topo.dp.broadcast(b, src=0)
    out["dp_bcast"] = b.item()
    out["layout_dp"] = Layout(world=topo.world.world_size, pp=pp, ep=ep).dp
    return out
