"""Topology: the layout arithmetic for big shapes (no processes), and 2x1 / 1x2 on real gloo ranks."""

from __future__ import annotations

import pytest
from _dstrain_helpers import spawn
from _dist_helpers import topology_run

from dstrain.dist import Layout, Topology
from dstrain.errors import TopologyError


def test_layout_8_ranks_pp2_ep2_matches_the_documented_picture() -> None:
    lay = Layout(world=8, pp=2, ep=2)
    assert (lay.dp, lay.edp) == (4, 2)
    assert lay.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    c = lay.coordinates(6)
    assert (c.stage, c.dp_rank, c.ep_rank, c.edp_rank) == (1, 2, 0, 1)


@pytest.mark.parametrize(
    "world,pp,ep",
    [(1, 1, 1), (2, 2, 1), (2, 1, 2), (12, 3, 2), (16, 2, 4), (16, 4, 1), (24, 2, 3), (8, 8, 1)],
)
def test_layout_invariants(world: int, pp: int, ep: int) -> None:
    lay = Layout(world=world, pp=pp, ep=ep)
    sizes = {"dp": lay.dp, "pp": pp, "ep": ep, "edp": lay.dp // ep}
    for kind, size in sizes.items():
        groups = lay.groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), kind  # a partition of the world
        assert all(len(g) == size for g in groups), kind
    for rank in range(world):
        c = lay.coordinates(rank)
        assert lay.rank_of(c.stage, c.dp_rank) == rank
        assert lay.group_of("dp", rank).index(rank) == c.dp_rank
        assert lay.group_of("pp", rank).index(rank) == c.stage
        assert lay.group_of("ep", rank).index(rank) == c.ep_rank
        assert lay.group_of("edp", rank).index(rank) == c.edp_rank
        # an ep group and an edp group meet in exactly this rank
        assert set(lay.group_of("ep", rank)) & set(lay.group_of("edp", rank)) == {rank}
        # every group of a kind other than pp stays inside one stage
        for kind in ("dp", "ep", "edp"):
            assert {lay.coordinates(r).stage for r in lay.group_of(kind, rank)} == {c.stage}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world": 6, "pp": 4},
        {"world": 8, "pp": 2, "ep": 3},
        {"world": 0},
        {"world": 4, "pp": 0},
        {"world": 4, "ep": True},
        {"world": 4, "pp": 1.0},
    ],
)
def test_layout_rejects_shapes_that_do_not_divide(kwargs: dict[str, object]) -> None:
    with pytest.raises(TopologyError):
        Layout(**kwargs)  # type: ignore[arg-type]


def test_layout_rejects_rank_and_kind_outside() -> None:
    lay = Layout(world=4, pp=2)
    with pytest.raises(TopologyError):
        lay.coordinates(4)
    with pytest.raises(TopologyError):
        lay.groups("tp")


def test_single_process_topology_is_all_local() -> None:
    topo = Topology.from_world()
    assert topo.coords.rank == 0
    assert all(getattr(topo, k).world_size == 1 for k in ("dp", "pp", "ep", "edp"))
    with pytest.raises(TopologyError):
        Topology.from_world(pp=2)


def test_2x1_and_1x2_on_two_gloo_ranks() -> None:
    # 2x1: two pipeline stages, one data-parallel rank each; 1x2 with ep=2: one stage, dp 2, experts split
    pipe = spawn(topology_run, 2, 1, start_method="forkserver")
    data = spawn(topology_run, 1, 2, start_method="forkserver")
    for rank in (0, 1):
        p, d = pipe[rank], data[rank]
        assert (p["coords"].stage, p["coords"].dp_rank) == (rank, 0)
        assert p["sizes"] == {"dp": 1, "pp": 2, "ep": 1, "edp": 1}
        assert p["sums"] == {"dp": rank, "pp": 1.0, "ep": rank, "edp": rank}  # pp sums 0 + 1
        assert p["pp_rank"] == rank and p["dp_bcast"] == rank + 10  # dp of one: broadcast is local
        assert p["layout_dp"] == 1
        assert (d["coords"].stage, d["coords"].dp_rank, d["coords"].ep_rank) == (0, rank, rank)
        assert d["sizes"] == {"dp": 2, "pp": 1, "ep": 2, "edp": 1}
        assert d["sums"] == {"dp": 1.0, "pp": rank, "ep": 1.0, "edp": rank}
        assert d["dp_bcast"] == 10.0  # rank 0's value everywhere
        assert d["layout_dp"] == 2
