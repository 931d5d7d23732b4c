"""`Topology`: the process groups of one training job and this rank's place in them.

Like torchtitan's ``ParallelDims``, one object owns every group; the parts of the engine receive the
`Comm` they communicate on and never build groups themselves.

Layout of ``world = pp x dp`` ranks (``dp`` divisible by ``ep``), pipeline outermost::

    rank = stage * dp + dp_rank

    world 8, pp 2, ep 2  ->  dp 4, edp 2
    stage 0: ranks 0 1 2 3      dp group [0 1 2 3]   ep groups [0 1] [2 3]   edp groups [0 2] [1 3]
    stage 1: ranks 4 5 6 7      dp group [4 5 6 7]   ep groups [4 5] [6 7]   edp groups [4 6] [5 7]
    pp groups (same dp_rank in every stage): [0 4] [1 5] [2 6] [3 7]

- ``dp``: the ranks of one pipeline stage. Batch sizes resolve against its size and ZeRO partitions
  (and reduces) over it.
- ``pp``: the ranks holding the same data-parallel slice in every stage (the pipeline's p2p partners).
- ``ep``: ``ep`` consecutive dp ranks of a stage; experts are split over it (all-to-all of tokens).
- ``edp``: the dp ranks with the same position inside their expert group, i.e. the replicas of the same
  experts; expert gradients are reduced (and expert optimizer state partitioned) over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dstrain.dist.comm import Comm
from dstrain.dist.groups import new_group
from dstrain.errors import TopologyError

__all__ = ["Coordinates", "Layout", "Topology"]

_KINDS = ("dp", "pp", "ep", "edp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Coordinates:
    """Where one rank sits in a `Layout`."""

    rank: int
    """Global rank."""
    stage: int
    """Pipeline stage, 0 .. pp - 1 (also this rank's index in its pp group)."""
    dp_rank: int
    """Index in the stage's data-parallel group."""
    ep_rank: int
    """Index in its expert-parallel group (``dp_rank % ep``)."""
    edp_rank: int
    """Index in its expert-data-parallel group (``dp_rank // ep``)."""


def _check(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """The arithmetic of a topology: degrees, group members, coordinates. No process group needed."""

    world: int
    """Number of ranks."""
    pp: int = 1
    """Pipeline stages; must divide ``world``."""
    ep: int = 1
    """Expert-parallel size; must divide the data-parallel size ``world // pp``."""

    def __post_init__(self) -> None:
        _check("world", self.world)
        _check("pp", self.pp)
        _check("ep", self.ep)
        if self.world % self.pp:
            raise TopologyError(f"pp ({self.pp} pipeline stages) must divide the world size ({self.world})")
        if self.dp % self.ep:
            raise TopologyError(
                f"ep ({self.ep}) must divide the data-parallel size ({self.dp} = world {self.world} / pp {self.pp})"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks per pipeline stage."""
        return self.world // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert."""
        return self.dp // self.ep

    def rank_of(self, stage: int, dp_rank: int) -> int:
        """The global rank at (stage, dp_rank)."""
        return stage * self.dp + dp_rank

    def coordinates(self, rank: int) -> Coordinates:
        """Where global rank ``rank`` sits."""
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} is outside a world of {self.world}")
        stage, dp_rank = divmod(rank, self.dp)
        return Coordinates(
            rank=rank, stage=stage, dp_rank=dp_rank, ep_rank=dp_rank % self.ep, edp_rank=dp_rank // self.ep
        )

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (``"dp"``, ``"pp"``, ``"ep"``, ``"edp"``) as sorted global ranks.

        Each rank is in exactly one group of each kind; the order is the same on every rank (groups are
        created collectively in this order).
        """
        if kind == "dp":
            return [[self.rank_of(s, d) for d in range(self.dp)] for s in range(self.pp)]
        if kind == "pp":
            return [[self.rank_of(s, d) for s in range(self.pp)] for d in range(self.dp)]
        if kind == "ep":
            return [
                [self.rank_of(s, e * self.ep + j) for j in range(self.ep)]
                for s in range(self.pp)
                for e in range(self.edp)
            ]
        if kind == "edp":
            return [
                [self.rank_of(s, e * self.ep + j) for e in range(self.edp)]
                for s in range(self.pp)
                for j in range(self.ep)
            ]
        raise TopologyError(f"unknown group kind {kind!r}; expected one of {', '.join(_KINDS)}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The members of ``rank``'s group of ``kind``."""
        return next(g for g in self.groups(kind) if rank in g)


class Topology:
    """Every process group of the job as a `Comm`, and this rank's `Coordinates`.

    Construction is collective (it creates process groups): every rank builds the same `Layout` at the
    same point. A group of one rank needs no process group (`Comm.single`); a group equal to the whole
    world reuses the world's `Comm`; equal groups of two kinds (e.g. ``dp`` and ``edp`` when ``ep == 1``)
    are one `Comm`.
    """

    def __init__(self, layout: Layout, world: Comm | None = None) -> None:
        world = world if world is not None else Comm()
        if world.world_size != layout.world:
            raise TopologyError(
                f"layout is for {layout.world} ranks, the process group has {world.world_size}"
            )
        self.layout = layout
        self.world = world
        self.coords = layout.coordinates(world.rank)
        made: dict[tuple[int, ...], Comm] = {tuple(range(layout.world)): world}
        mine: dict[str, Comm] = {}
        for kind in _KINDS:
            for members in layout.groups(kind):
                key = tuple(members)
                if key not in made:
                    if len(members) == 1:
                        made[key] = Comm.single()
                    else:
                        # new_group is collective over the world: every rank calls it for every group
                        group = new_group(members)
                        made[key] = Comm(group) if world.rank in members else Comm.single()
                if world.rank in members:
                    mine[kind] = made[key]
        self.dp: Comm = mine["dp"]
        """This rank's data-parallel group (its pipeline stage)."""
        self.pp: Comm = mine["pp"]
        """This rank's pipeline group (one rank per stage)."""
        self.ep: Comm = mine["ep"]
        """This rank's expert-parallel group."""
        self.edp: Comm = mine["edp"]
        """This rank's expert-data-parallel group (replicas of the same experts)."""

    @classmethod
    def from_world(cls, *, pp: int = 1, ep: int = 1) -> Topology:
        """The topology of the current process group (world size 1 without one)."""
        world = Comm()
        return cls(Layout(world=world.world_size, pp=pp, ep=ep), world)

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"Topology(world={self.layout.world}, pp={self.layout.pp}, dp={self.layout.dp}, ep={self.layout.ep}; "
            f"rank {c.rank} = stage {c.stage}, dp_rank {c.dp_rank}, ep_rank {c.ep_rank}, edp_rank {c.edp_rank})"
        )
