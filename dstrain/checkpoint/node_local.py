"""`NodeLocalStore`: checkpoints on storage each host has to itself (DeepSpeed's
``checkpoint.use_node_local_storage: true``).

Every host writes its ranks' files into its own copy of ``save_dir`` (the same path, a different
filesystem). Which ranks share a directory is found once per directory (`storage_leaders`: marker
files); each host's first local rank commits that host's directory. The commit is agreed over the
whole process group, in dsio's one commit protocol (``dsio.checkpoint.commit_written``)::

    every rank: write its safetensors file into step-N.tmp, fsynced      -> all report (all-gather)
    rank 0:     manifest of its host's files, rename into step-N, latest  -> its outcome (broadcast)
    each other host's first local rank: the same, for its own directory   -> all report (all-gather)

Nothing is committed anywhere unless every rank's file is durable, and no host commits before rank 0
has. A host that fails or dies after rank 0 committed keeps the previous step: the next load finds the
ranks disagreeing on the committed step and fails every rank with one ``CheckpointRankError`` naming
the step and the rank (`dstrain.checkpoint.agree.agree_step`). Each rank removes its own leftover
``step-*.tmp`` files of a failed or killed save at its next save or load.

A save is synchronous (``async_save`` captures and writes before returning). Loading reads this rank's
file as `DsioStore` does; a checkpoint needs every rank file to be resharded, so node-local checkpoints
load only at the world size they were saved at (`CheckpointRankError` names the missing file).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dstrain.checkpoint.agree import broadcast_object, gather_objects, storage_leaders
from dstrain.checkpoint.pending import PendingSave
from dstrain.checkpoint.sources import release_sources
from dstrain.checkpoint.store import DsioStore, rank_file_name, step_name
from dstrain.dist.comm import Comm
from dstrain.errors import DstrainError

if TYPE_CHECKING:
    from dsio.checkpoint import TouchOrder

__all__ = ["NodeLocalStore", "remove_own_leftovers"]


def remove_own_leftovers(directory: Path, rank: int, suffix: str = ".safetensors") -> list[Path]:
    """Remove this rank's files in ``directory``'s uncommitted ``step-*.tmp`` directories (a failed or
    killed save), and each such directory once it is empty; returns the files removed."""
    removed: list[Path] = []
    try:
        tmps = [directory / n for n in os.listdir(directory) if n.startswith("step-") and n.endswith(".tmp")]
    except FileNotFoundError:
        return removed
    except OSError as e:
        raise OSError(e.errno, f"cannot list the checkpoint directory {directory}: {e.strerror}") from e
    for tmp in tmps:
        own = tmp / rank_file_name(rank, suffix)
        try:
            own.unlink()
            removed.append(own)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OSError(e.errno, f"cannot remove {own}: {e.strerror}") from e
        with contextlib.suppress(OSError):
            tmp.rmdir()  # only once no rank's file is left in it
    return removed


class NodeLocalStore(DsioStore):
    """dsio safetensors rank files, one directory per host (see the module docstring)."""

    def __init__(self, *, allow_pickle: bool = False, keep_last: int | None = None) -> None:
        super().__init__(allow_pickle=allow_pickle, keep_last=keep_last)
        self._leaders: dict[str, list[int]] = {}

    def leaders(self, directory: Path, world: Comm) -> list[int]:
        """Each rank's host leader for ``directory`` (found once; collective the first time)."""
        key = os.path.abspath(directory)
        if key not in self._leaders:
            self._leaders[key] = storage_leaders(world, directory)
        return self._leaders[key]

    def save(
        self,
        directory: Path,
        step: int,
        state: dict[str, Any],
        world: Comm,
        *,
        background: bool,
        touch_order: TouchOrder | None = None,
    ) -> PendingSave:
        import dsio.checkpoint

        remove_own_leftovers(directory, world.rank, self.suffix)
        leaders = self.leaders(directory, world)
        mine = [r for r in range(world.world_size) if leaders[r] == leaders[world.rank]]
        name = rank_file_name(world.rank, self.suffix)
        error = None
        try:
            tmp = Path(dsio.checkpoint.step_tmp_dir(directory, step))
            self._run(dsio.checkpoint.save(state, tmp / name, allow_pickle=self.allow_pickle))
        except Exception as e:  # reported to every rank below: nobody commits
            error = f"rank {world.rank} could not write {directory / (step_name(step) + '.tmp') / name}: {e}"
        finally:
            release_sources(state)
        failures = [v for v in gather_objects(world, error) if v is not None]

        def commit() -> str | None:
            try:
                dsio.checkpoint.commit_written(
                    directory,
                    step,
                    [rank_file_name(r, self.suffix) for r in mine],
                    failures=failures,  # with failures: the partial step goes
                    keep_last=self.keep_last,
                    ranks=mine,
                    world_size=world.world_size,
                )
            except OSError as e:
                return f"rank {world.rank} could not commit step {step} in {directory}: {e}"
            return None

        first = commit() if world.rank == 0 else None  # rank 0's host commits first
        first = broadcast_object(world, first)
        later = None
        if world.rank != 0 and leaders[world.rank] == world.rank:
            # a host commits only after rank 0 has; if rank 0 could not, it removes its partial step
            if first is not None and not failures:
                failures = [first]
            later = commit()
        outcomes = [v for v in gather_objects(world, later) if v is not None]
        if error is not None or failures or first is not None or outcomes:
            raise DstrainError(
                f"checkpoint step {step} not committed: {'; '.join(failures + ([first] if first else []) + outcomes)}"
            )
        path = directory / step_name(step) / name
        return PendingSave(path, lambda: path)

    def load(
        self, directory: Path, step: int, world: Comm, *, lazy: tuple[str, ...] = ()
    ) -> tuple[Path, dict[str, Any]]:
        remove_own_leftovers(directory, world.rank, self.suffix)
        return super().load(directory, step, world, lazy=lazy)
