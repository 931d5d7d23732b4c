"""README's Python code blocks run (issue 15): the guide cannot rot.

The plain blocks run in one fresh interpreter, each in its own empty directory; blocks marked
``<!-- readme-test: torchrun 2 (why) -->`` run under torchrun with 2 gloo ranks. See tests/_readme_blocks.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _readme_blocks as rb  # noqa: E402
import _torchrun  # noqa: E402  (torchrun, its launcher forked from the session's fork server)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.experiments import exit_aborts  # noqa: E402  (how a torchrun launch is judged)

README = ROOT / "README.md"
RUNNER = Path(rb.__file__)
BLOCKS = rb.blocks(README.read_text())


def _run(markdown: Path, work: Path, timeout: float = 420) -> dict[str, dict[str, object]]:
    out = work / "results.json"
    (work / "tmp").mkdir(exist_ok=True)  # what the blocks make with tempfile (a user's scratch): with work
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        DSIO_METRICS_PORT=os.environ.get("DSIO_METRICS_PORT", "10464"),
        TMPDIR=str(work / "tmp"),
    )
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(markdown), str(out), str(work)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    return _run(README, tmp_path_factory.mktemp("readme-blocks"))


def test_the_guide_has_a_runnable_block_per_topic_and_few_exceptions() -> None:
    code = "\n".join(b.code for b in BLOCKS if b.mode != "skip")
    for needle in ("await h.pwrite(", "Checkpointer(", "DsioStorageWriter(", "load_file(", "dstrain.initialize(",
                   "offload_optimizer", "PipelineModule(", "MoE(", "OneBitAdam", "dsio.metrics.serve(",
                   "AsyncIOBuilder()"):  # fmt: skip
        assert needle in code, f"README has no runnable block using {needle}"
    not_plain = [b for b in BLOCKS if b.mode != "run"]
    assert len(not_plain) <= 2 and all(b.reason for b in not_plain), not_plain
    assert not [b for b in BLOCKS if b.mode == "skip"], "a skipped block: run it (torchrun marker) instead"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode == "run"], ids=lambda b: f"README.md:{b.line}")
def test_block_runs(block: rb.Block, results: dict[str, dict[str, object]]) -> None:
    r = results.get(str(block.index))
    assert r is not None, "the runner did not reach this block"
    assert r["ok"], r.get("error")


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.mode == "torchrun"], ids=lambda b: f"README.md:{b.line}"
)
@pytest.mark.usefixtures("child_tmpdir")  # torchrun's torchelastic_* folder goes with tmp_path
def test_block_runs_under_torchrun(block: rb.Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    proc = _torchrun.run(
        ["--standalone", "--nproc_per_node", str(block.nproc), str(script)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # and judged as bench/experiments/exit_aborts.py judges a launch: no rank aborted at exit (its
    # "pipeline/close" variant is this very block: tests/dstrain/dist/test_exit_teardown.py leaves it here)
    assert exit_aborts.classify(proc.returncode, proc.stdout + proc.stderr) == "ok", proc.stderr[-4000:]


def test_a_broken_block_fails_and_markers_are_read(tmp_path: Path) -> None:
    md = tmp_path / "doc.md"
    md.write_text(
        "intro\n\n```python\nx = 1\nassert x == 1\n```\n\n```python\nraise ValueError('rotted')\n```\n\n"
        "<!-- readme-test: torchrun 2 (needs two ranks) -->\n```python\nimport torch.distributed\n```\n"
        "```bash\nnot python\n```\n"
    )
    found = rb.blocks(md.read_text())
    assert [(b.mode, b.nproc, b.line) for b in found] == [("run", 1, 4), ("run", 1, 9), ("torchrun", 2, 14)]
    assert found[2].reason == "needs two ranks"
    res = _run(md, tmp_path, timeout=120)
    assert res["0"]["ok"] and not res["1"]["ok"] and "rotted" in res["1"]["error"]
    assert "2" not in res  # torchrun blocks are not run in-process
