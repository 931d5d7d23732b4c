"""The collective timeout: ``dstrain.init_distributed(timeout=...)`` and the config's ``dist_timeout``
(seconds), used by every process group dstrain creates (dstrain.dist.groups)."""

from __future__ import annotations

import os
import re
import textwrap
import time
from pathlib import Path
from typing import Any

import _torchrun  # tests/_torchrun.py: torchrun, its launcher forked from the session's fork server
import pytest
import torch
from _dstrain_helpers import spawn

from dstrain.config import DSConfig
from dstrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_config_key_is_parsed_and_checked() -> None:
    assert DSConfig.load({"train_batch_size": 2, "dist_timeout": 7.5}).dist_timeout == 7.5
    assert DSConfig.load({"train_batch_size": 2}).dist_timeout is None
    for bad in (0, -1, "soon"):
        with pytest.raises(ConfigError):
            DSConfig.load({"train_batch_size": 2, "dist_timeout": bad})


def test_every_group_dstrain_creates_goes_through_one_function() -> None:
    """So each gets the timeout: no ``dist.new_group(`` outside dstrain/dist/groups.py."""
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in (ROOT / "dstrain").rglob("*.py")
        if p.name != "groups.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bdist\.new_group\(", line)
    ]
    assert offenders == []


def _stay_out(done: str, most: float = 8.0) -> None:
    """The silent rank: out of every collective until its peer's has ended (``done`` exists), at most
    ``most`` s (a fixed 8 s sleep before: ~6 s of idle waiting a test)."""
    deadline = time.monotonic() + most
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)


def _silent_peer(done: str) -> dict[str, Any]:
    """The config sets 2 s; rank 1 stays out of a collective on a group dstrain made: rank 0 fails fast."""
    import torch.distributed as dist

    import dstrain
    from dstrain.dist.groups import new_group

    cfg = {"train_micro_batch_size_per_gpu": 1, "dist_timeout": 2, "zero_optimization": {"stage": 1}}
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    dstrain.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    group = new_group([0, 1])
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            out["error"] = None
        except RuntimeError as e:
            out["error"] = type(e).__name__
        out["seconds"] = time.monotonic() - start
        open(done, "w").close()
    else:
        _stay_out(done)
    return out


def test_groups_take_the_config_timeout(tmp_path: Path) -> None:
    r0 = spawn(_silent_peer, str(tmp_path / "rank0-done"), world=2, start_method="forkserver")[0]
    assert r0["error"] == "RuntimeError"
    assert 1.5 <= r0["seconds"] < 7, r0  # the 2 s of the config, not torch's 30 min


@pytest.mark.usefixtures("child_tmpdir")  # torchrun's torchelastic_* folder goes with tmp_path
def test_init_distributed_takes_a_timeout(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            import torch, torch.distributed as dist
            import dstrain

            dstrain.init_distributed(timeout=2)  # DeepSpeed's argument, in seconds (or a timedelta)
            if dist.get_rank() == 0:
                start = time.monotonic()
                try:
                    dist.all_reduce(torch.ones(4))
                    print("no error", flush=True)
                except RuntimeError:
                    print(f"timed out after {time.monotonic() - start:.1f} s", flush=True)
                open("rank0-done", "w").close()
            else:  # out of the collective until rank 0's has ended, at most 8 s
                deadline = time.monotonic() + 8
                while not os.path.exists("rank0-done") and time.monotonic() < deadline:
                    time.sleep(0.05)
            os._exit(0)  # the peer is gone or late on purpose: no orderly exit to wait for
            """
        )
    )
    r = _torchrun.run(
        ["--standalone", "--nproc_per_node", "2", str(script)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=120,
    )
    m = re.search(r"timed out after ([\d.]+) s", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert 1.5 <= float(m.group(1)) < 7
