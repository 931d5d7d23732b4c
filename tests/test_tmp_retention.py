"""The suite's pytest configuration removes a passing test's ``tmp_path`` when the test ends.

Our tests write swap files and checkpoints into ``tmp_path`` (~7 GB a whole run); pytest's default keeps
every test's directory for three sessions, which filled this machine's disk after three runs. The
setting lives in pyproject's ``[tool.pytest.ini_options]``: run pytest with that file on two tiny tests,
one passing and one failing, and look at what stays.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TESTS = """
def test_passes(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 4096)
    with open(r"{out}", "a") as f:
        f.write(f"pass {{tmp_path}}\\n")

def test_fails(tmp_path):
    with open(r"{out}", "a") as f:
        f.write(f"fail {{tmp_path}}\\n")
    assert False
"""


def test_a_passing_tests_tmp_path_is_removed_and_a_failing_ones_kept(tmp_path: Path) -> None:
    out = tmp_path / "paths.txt"
    (tmp_path / "test_sample.py").write_text(TESTS.format(out=out))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "--basetemp", str(tmp_path / "base"), str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # one test fails, on purpose
    paths = dict(line.split(" ", 1) for line in out.read_text().splitlines())
    assert not Path(paths["pass"]).exists()
    assert Path(paths["fail"]).is_dir()
