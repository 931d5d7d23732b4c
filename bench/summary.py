"""Collect today's benchmark reports into one page: bench/results/<date>-<host>.md.

    python bench/summary.py          # run by `make bench` after the io, checkpoint and metrics benches

Each section is the newest run of its kind by the date and time recorded inside the report (its title
line, or ``meta.date`` of the JSON beside it), never by file modification time (a checkout or a copy
resets those). Reports keep their own tables of medians and ratios against the baselines measured in the
same run; plots stay beside them and are linked.
"""

from __future__ import annotations

import glob
import json
import os
import re
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


_DATE = re.compile(r"(\d{4}-\d\d-\d\d)(?:[ T](\d\d:\d\d))?")


def recorded_date(path: str) -> str | None:
    """When the run in ``path`` was made, as recorded inside it: "YYYY-MM-DD HH:MM" (UTC), or "YYYY-MM-DD"
    where the run recorded only its day; None when the file records neither.

    The JSON written beside a report (``meta.date``) wins over the report's title line."""
    found: list[str] = []
    sidecar = os.path.splitext(path)[0] + ".json"
    if os.path.isfile(sidecar):
        try:
            with open(sidecar) as f:
                meta = json.load(f).get("meta", {})
            if isinstance(meta, dict) and isinstance(meta.get("date"), str):
                found.append(meta["date"])
        except (OSError, ValueError, AttributeError):
            pass
    with open(path, errors="replace") as f:
        found.append(f.readline())
    for text in found:
        m = _DATE.search(text)
        if m:
            return m[1] + (f" {m[2]}" if m[2] else "")
    return None


def newest(results: str, pattern: str) -> str | None:
    """The report matching ``pattern`` in ``results`` whose recorded run is the latest (ties: by name).
    Reports that record no date are never picked."""
    dated = []
    for f in glob.glob(os.path.join(results, pattern)):
        if os.path.basename(f)[0] == ".":
            continue
        when = recorded_date(f)
        if when is not None:
            dated.append((when, os.path.basename(f), f))
    return max(dated)[2] if dated else None


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
        f = newest(RESULTS, pattern)
        if f is None or os.path.abspath(f) == os.path.abspath(out):
            parts += [f"## {title}", "", "_not run_", ""]
            continue
        with open(f) as fh:
            body = fh.read().split("\n", 1)[-1]  # drop the report's own title
        body = body.replace("\n## ", "\n### ")
        parts += [
            f"## {title}",
            "",
            f"From `{os.path.basename(f)}` (run of {recorded_date(f)}):",
            body.strip(),
            "",
        ]
        png = f[:-3] + ".png"
        if os.path.exists(png):
            parts += [f"![{title}]({os.path.basename(png)})", ""]
    with open(out, "w") as fh:
        fh.write("\n".join(parts))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
