"""`make bench` runs every benchmark driver's quick mode: a driver with ``--quick`` is in the target."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench_target() -> list[str]:
    """The recipe lines of the Makefile's ``bench`` target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("bench:")))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def quick_drivers() -> set[str]:
    """bench/*.py whose argument parser has a ``--quick`` flag."""
    return {
        f"bench/{p.name}"
        for p in (ROOT / "bench").glob("*.py")
        if re.search(r"add_argument\(\s*[\"']--quick[\"']", p.read_text())
    }


def test_every_quick_mode_is_in_make_bench() -> None:
    run = {m.group(1) for line in bench_target() if (m := re.search(r"(bench/\w+\.py) --quick\b", line))}
    assert quick_drivers() <= run, sorted(quick_drivers() - run)


def test_the_training_drivers_have_quick_modes() -> None:
    # issue 29: the 1-bit and big-model drivers run in `make bench` like the others
    assert {"bench/onebit.py", "bench/bigmodel.py", "bench/train.py", "bench/moe.py"} <= quick_drivers()
