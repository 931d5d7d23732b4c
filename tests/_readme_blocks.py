"""README's ```python blocks: extraction, and a runner that executes blocks in one fresh interpreter.

A block may be preceded (on the line right above its fence) by a marker:

    <!-- readme-test: torchrun 2 (why) -->   run it as a script under torchrun with 2 local ranks
    <!-- readme-test: skip (why) -->         not run; the reason is required and such blocks must stay few

Every other block runs as is, in its own empty working directory and its own namespace
(``python tests/_readme_blocks.py README.md OUT.json WORKDIR [INDEX...]``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```python\n(?P<body>.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!-- readme-test: (?P<mode>torchrun (?P<n>\d+)|skip) \((?P<why>[^)]+)\) -->\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    index: int
    line: int
    """1-based line of the block's first code line in the Markdown file."""
    code: str
    mode: str
    """``"run"``, ``"torchrun"`` or ``"skip"``."""
    nproc: int
    reason: str


def blocks(text: str) -> list[Block]:
    """Every ```python block of ``text`` with its marker (if any)."""
    out = []
    for i, m in enumerate(FENCE.finditer(text)):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mk = MARKER.search(before)
        mode = "run" if mk is None else ("skip" if mk["mode"] == "skip" else "torchrun")
        out.append(
            Block(
                index=i,
                line=text.count("\n", 0, m.start("body")) + 1,
                code=m["body"],
                mode=mode,
                nproc=int(mk["n"]) if mk is not None and mk["n"] else 1,
                reason=mk["why"] if mk is not None else "",
            )
        )
    return out


def run_blocks(
    markdown: Path, workdir: Path, indices: list[int] | None = None
) -> dict[int, dict[str, object]]:
    """Execute the selected "run" blocks one after another in this interpreter; never raises."""
    results: dict[int, dict[str, object]] = {}
    home = os.getcwd()
    for b in blocks(markdown.read_text()):
        if b.mode != "run" or (indices is not None and b.index not in indices):
            continue
        d = workdir / f"block-{b.index}"
        d.mkdir(parents=True, exist_ok=True)
        os.chdir(d)
        t0 = time.perf_counter()
        try:
            exec(compile(b.code, f"{markdown.name}:{b.line}", "exec"), {"__name__": "__main__"})
            results[b.index] = {"ok": True, "seconds": time.perf_counter() - t0}
        except BaseException:  # noqa: BLE001 (a block's SystemExit or KeyboardInterrupt is its failure too)
            results[b.index] = {
                "ok": False,
                "error": traceback.format_exc(),
                "seconds": time.perf_counter() - t0,
            }
        finally:
            os.chdir(home)
    return results


if __name__ == "__main__":
    md, out, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    wanted = [int(x) for x in sys.argv[4:]] or None
    res = run_blocks(md, work, wanted)
    out.write_text(json.dumps({str(k): v for k, v in res.items()}))
