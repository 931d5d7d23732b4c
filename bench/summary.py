"""Collect today's benchmark reports into one page: bench/results/<date>-<host>.md.

    python bench/summary.py          # run by `make bench` after the io, checkpoint and metrics benches

Each section is the newest report of its kind (their own tables of medians and ratios against the
baselines measured in the same run); plots stay beside them and are linked.
"""

from __future__ import annotations

import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import RESULTS, machine, result_path  # noqa: E402

KINDS = [
    ("I/O engine vs fio and DeepSpeed", "*-io.md"),
    ("Checkpoints", "checkpoint-*.md"),
    ("Metrics exporter overhead", "metrics-*.md"),
    ("Training (dstrain)", "train-*.md"),
    ("GPU <-> disk (H200)", "*gpu_io*.md"),
]


def newest(pattern: str) -> str | None:
    files = [f for f in glob.glob(os.path.join(RESULTS, pattern)) if os.path.basename(f)[0] != "."]
    return max(files, key=os.path.getmtime) if files else None


def main() -> None:
    meta = machine()
    out = result_path("summary").replace("-summary.md", ".md")
    parts = [
        f"# Benchmarks, {meta['date']}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in meta.items()),
        "",
    ]
    for title, pattern in KINDS:
        f = newest(pattern)
        if f is None or os.path.abspath(f) == os.path.abspath(out):
            parts += [f"## {title}", "", "_not run_", ""]
            continue
        with open(f) as fh:
            body = fh.read().split("\n", 1)[-1]  # drop the report's own title
        body = body.replace("\n## ", "\n### ")
        parts += [f"## {title}", "", f"From `{os.path.basename(f)}`:", body.strip(), ""]
        png = f[:-3] + ".png"
        if os.path.exists(png):
            parts += [f"![{title}]({os.path.basename(png)})", ""]
    with open(out, "w") as fh:
        fh.write("\n".join(parts))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
