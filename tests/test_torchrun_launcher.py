"""tests/_torchrun.py: torchrun with its launcher forked from the session's fork server is the same launch
as ``python -m torch.distributed.run`` (exit status, stdout and stderr apart, the caller's environment,
working directory and TMPDIR, ranks that are new interpreters), and it is forked (what it is for)."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import _torchrun
import pytest

RANK = textwrap.dedent(
    """
    import os, sys, tempfile
    rank = os.environ["RANK"]
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        launcher = f.read().replace(b"\\0", b" ").decode()
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} probe={os.environ.get('TORCHRUN_PROBE')} "
          f"cwd={os.getcwd()} tmp={tempfile.gettempdir()} torch_loaded={'torch' in sys.modules}", flush=True)
    print(f"rank {rank} launcher: {launcher}", flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("TORCHRUN_PROBE_EXIT", "0")) if rank == "1" else 0)
    """
)


def _launch(
    d: Path, exit_code: int, spawn_only: bool, mp: pytest.MonkeyPatch
) -> subprocess.CompletedProcess[str]:
    """``rank.py`` on 2 ranks in ``d``: forked launcher, or (``spawn_only``) ``python -m torch.distributed.run``."""
    d.mkdir()
    (d / "rank.py").write_text(RANK)
    (d / "child-tmp").mkdir()
    if spawn_only:
        mp.setenv("DSTRAIN_TESTS_SPAWN_ONLY", "1")
    else:
        mp.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
    env = dict(os.environ, TORCHRUN_PROBE="from the caller", TORCHRUN_PROBE_EXIT=str(exit_code))
    env["TMPDIR"] = str(d / "child-tmp")
    return _torchrun.run(["--standalone", "--nproc_per_node", "2", "rank.py"], cwd=d, env=env, timeout=120)


def _rank_lines(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith("rank ") and "launcher:" not in line)


def test_the_forked_launcher_launches_as_python_m_torch_distributed_run_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 exits 3: both launches fail alike (status 1, torchrun's ChildFailedError naming exit code 3)."""
    forked = _launch(tmp_path / "forked", 3, False, monkeypatch)
    plain = _launch(tmp_path / "plain", 3, True, monkeypatch)
    assert forked.returncode == plain.returncode == 1, (forked.returncode, plain.returncode)
    for r, d in ((forked, tmp_path / "forked"), (plain, tmp_path / "plain")):
        assert _rank_lines(r.stdout) == [
            f"rank {i} of 2 probe=from the caller cwd={d} tmp={d / 'child-tmp'} torch_loaded=False"
            for i in (0, 1)
        ], r.stdout[-3000:]
        assert sorted(x for x in r.stderr.splitlines() if x.startswith("rank ")) == [
            "rank 0 to stderr",
            "rank 1 to stderr",
        ]
        assert "to stderr" not in r.stdout
        assert "ChildFailedError" in r.stderr and "exitcode  : 3" in r.stderr, r.stderr[-3000:]
    # what it is for: the launcher is a fork of the session's fork server, not a new interpreter
    launchers = {
        p: [x for x in r.stdout.splitlines() if "launcher:" in x] for p, r in (("f", forked), ("p", plain))
    }
    assert len(launchers["f"]) == len(launchers["p"]) == 2
    assert all("multiprocessing.forkserver" in x for x in launchers["f"]), launchers
    assert all("-m torch.distributed.run" in x for x in launchers["p"]), launchers


@pytest.mark.usefixtures("child_tmpdir")  # the launcher killed: its torchelastic_* folder stays with tmp_path
def test_a_launch_past_its_timeout_is_killed_and_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
    (tmp_path / "rank.py").write_text(
        "import os, time\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists('release') and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _torchrun.run(["--standalone", "--nproc_per_node", "1", "rank.py"], cwd=tmp_path, timeout=3)
        assert time.monotonic() - t0 < 30
    finally:
        (tmp_path / "release").touch()  # the orphaned rank leaves too
