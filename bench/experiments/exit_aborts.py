"""Does a 2-rank dstrain script exit 0, with and without ``engine.close()``? (issue 30, "Prompt, clean exit")

    python bench/experiments/exit_aborts.py [--launches 30] [--label L] [--pause-while /work/QUIET]
                                            [--resume] [--quick] [--timeout 300] [--jobs 1]

Scripts: the README's pipeline block and MoE block (found by the import line each one alone has,
`PIPELINE_MARKER` / `MOE_MARKER`, not by line number) and `ZERO3_OFFLOAD` (ZeRO-3, parameters and
optimizer state on NVMe), each as written (ending in ``engine.close()``) and with that line removed
(`without_close` raises `ValueError` if the line is not there). Each variant is launched ``--launches``
times under ``torchrun --standalone --nproc_per_node 2`` with ``OMP_NUM_THREADS=1``, in its own empty
directory, one launch at a time (``--jobs 2``: two at once, more load on each; every record says
which), the variants interleaved launch by launch (round i runs every variant's i-th launch), so
load and time of day fall alike on all six.

Per launch: torchrun's exit code, wall time, the load average before it, and the verdict: ``ok``
(exit 0), ``abort`` ("terminate called" in the output, or a rank that died of SIGABRT), ``signal``
(a rank, or torchrun, died of another signal), ``error`` (another non-zero exit), ``timeout``
(killed after ``--timeout`` s: not a prompt exit). The output of every launch that is not ``ok``
is kept in the JSON.

Every launch is appended to a journal (``build/exit-aborts/<label or "run">.jsonl``); ``--resume``
continues a journal (refused if the scripts changed; without one, it starts from today's result
file of that label, so another checkout can complete a committed partial run), and the result files
(bench/results/exit-aborts[-<label>]-<day>.{md,json}) are rewritten after every round, so an
interrupted run leaves its counts so far. ``--until HH:MM`` (UTC) starts no launch after that
time; ``--pause-while PATH`` waits between launches while PATH exists (the lead's quiet window);
the waits are not in any launch's time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import _readme_blocks  # noqa: E402  (the README's one block parser)

from bench import _common  # noqa: E402

PIPELINE_MARKER = "from dstrain.pipe import"
"""The line only the README's pipeline block has."""
MOE_MARKER = "from dstrain.moe import MoE"
"""The line only the README's MoE block has."""
CLOSE_LINE = re.compile(r"^engine\.close\(\)[ \t]*\n", re.M)

ZERO3_OFFLOAD = textwrap.dedent(
    """
    import sys

    import torch
    from torch import nn

    import dstrain

    dstrain.init_distributed()
    torch.manual_seed(0)
    nvme = sys.argv[1]
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }
    engine, _, _, _ = dstrain.initialize(model=model, config=config)
    for _ in range(3):
        loss = engine(torch.randn(4, 64)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print(f"rank {engine.topology.dp.rank}: loss {loss.item():.4f}")
    engine.close()
    """
)
"""2 ranks, ZeRO-3 with parameters and optimizer state on NVMe (``argv[1]``: the swap directory)."""


def readme_block(text: str, marker: str) -> str:
    """The code of the one ```python block of ``text`` that contains ``marker``."""
    found = [b.code for b in _readme_blocks.blocks(text) if marker in b.code]
    if len(found) != 1:
        raise ValueError(f"README: {len(found)} python blocks contain {marker!r}, expected exactly 1")
    return found[0]


def without_close(code: str) -> str:
    """``code`` with its top-level ``engine.close()`` line removed; `ValueError` if it has none."""
    out, n = CLOSE_LINE.subn("", code)
    if n != 1:
        raise ValueError(f"expected exactly one top-level `engine.close()` line, found {n}")
    return out


def scripts(readme: str | None = None) -> dict[str, str]:
    """Every variant's code by name: ``<script>/close`` and ``<script>/no-close``."""
    text = readme if readme is not None else (ROOT / "README.md").read_text()
    base = {
        "pipeline": readme_block(text, PIPELINE_MARKER),
        "moe": readme_block(text, MOE_MARKER),
        "zero3-offload": ZERO3_OFFLOAD,
    }
    out = {}
    for name, code in base.items():
        out[f"{name}/close"] = code
        out[f"{name}/no-close"] = without_close(code)
    return out


@dataclass(frozen=True, slots=True)
class Launch:
    variant: str
    index: int
    """0-based launch number of this variant."""
    verdict: str
    """``ok``, ``abort``, ``signal``, ``error`` or ``timeout``."""
    returncode: int | None
    seconds: float
    load_before: float
    """1-minute load average just before the launch."""
    started: str
    output: str
    """stdout + stderr of a launch that is not ``ok`` (the last 20,000 characters), else ""."""
    jobs: int = 1
    """Launches the run kept going at once (``--jobs``) while this one ran."""
    commit: str = ""
    """The checkout's commit when the run that made this launch started ("" in the first journal)."""


_RANK_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received|exitcode\s*:\s*-(\d+)")


def classify(returncode: int | None, output: str) -> str:
    """The verdict on one launch from torchrun's exit code and its (ranks') output."""
    if returncode is None:
        return "timeout"
    sigs = set()
    for m in _RANK_SIGNAL.finditer(output):
        sigs.add(int(m[1] or m[3]))
    if returncode < 0:
        sigs.add(-returncode)
    if "terminate called" in output or 6 in sigs:
        return "abort"
    if sigs:
        return "signal"
    return "ok" if returncode == 0 else "error"


Torchrun = Callable[..., subprocess.CompletedProcess[str]]
"""``torchrun(args, cwd=, env=, timeout=)``: ``python -m torch.distributed.run *args`` run to its end, as
`subprocess.run` with ``capture_output=True, text=True`` returns it (`subprocess.TimeoutExpired` past
``timeout``)."""


def torchrun_subprocess(python: str = sys.executable) -> Torchrun:
    """A new ``python -m torch.distributed.run`` interpreter per launch (`launch`'s default)."""

    def run(
        args: list[str], *, cwd: str, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [python, "-m", "torch.distributed.run", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)

    return run


def launch(
    code: str,
    variant: str,
    index: int,
    timeout: float,
    python: str = sys.executable,
    jobs: int = 1,
    torchrun: Torchrun | None = None,
) -> Launch:
    """Run ``code`` once under ``torchrun --standalone --nproc_per_node 2`` in a fresh directory.

    ``torchrun``: how the launcher is started (default: `torchrun_subprocess` of ``python``; the tests
    fork it from their fork server, tests/_torchrun.py)."""
    os.makedirs(_common.scratch_dir(), exist_ok=True)  # on disk: the swap files need O_DIRECT
    with tempfile.TemporaryDirectory(prefix="exit-aborts-", dir=_common.scratch_dir()) as d:
        script = Path(d) / "script.py"
        script.write_text(code)
        nvme = Path(d) / "nvme"
        nvme.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        args = ["--standalone", "--nproc_per_node", "2", str(script), str(nvme)]
        run = torchrun if torchrun is not None else torchrun_subprocess(python)
        load = os.getloadavg()[0]
        started = _dt.datetime.now(_dt.timezone.utc).strftime("%H:%M:%S")
        t0 = time.perf_counter()
        try:
            r = run(args, cwd=d, env=env, timeout=timeout)
            rc: int | None = r.returncode
            out = r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            out = _text(e.stdout) + _text(e.stderr)
        seconds = time.perf_counter() - t0
    verdict = classify(rc, out)
    return Launch(
        variant=variant,
        index=index,
        verdict=verdict,
        returncode=rc,
        seconds=seconds,
        load_before=load,
        started=started,
        output="" if verdict == "ok" else out[-20000:],
        jobs=jobs,
    )


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return r.stdout.strip()


def _meta(args: argparse.Namespace, codes: dict[str, str]) -> dict[str, object]:
    import torch

    m: dict[str, object] = dict(_common.machine())
    m.update(
        torch=torch.__version__,
        commit=_git("rev-parse", "--short", "HEAD"),
        # the result files this run rewrites do not count as changes to what is measured
        dirty=bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")),
        launches_per_variant=args.launches,
        timeout_s=args.timeout,
        command=" ".join(["python", *sys.argv]),
        launcher="OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2",
        scripts_sha256=_digest(codes),
    )
    return m


def _digest(codes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(codes, sort_keys=True).encode()).hexdigest()[:16]


def _seed_journal(journal: Path, label: str, meta: dict[str, object]) -> None:
    """Start ``journal`` from the committed result file of ``label`` (another checkout's run)."""
    day = str(meta["date"]).split()[0]
    path = Path(_common.RESULTS) / ("exit-aborts" + (f"-{label}" if label else "") + f"-{day}.json")
    if not path.exists():
        return
    data = json.loads(path.read_text())
    first = data["meta"].get("resumed_from") or data["meta"]
    head = {k: first[k] for k in ("scripts_sha256", "command", "commit", "dirty", "date")}
    lines = [json.dumps(head), *(json.dumps(x) for x in data["launches"])]
    journal.write_text("\n".join(lines) + "\n")


def _past(until: str | None) -> bool:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%H:%M")
    return until is not None and now >= until


def _resumed(meta: dict[str, object]) -> list[str]:
    head = meta.get("resumed_from")
    if not isinstance(head, dict) or "command" not in head:
        return []
    return [
        "",
        f"Resumed: the journal was started at {head['date']} by `{head['command']}` at commit "
        f"{head['commit']}" + (" (with uncommitted changes)" if head["dirty"] else "") + "; the command and "
        "commit above are the last resume's.",
    ]


def _write(args: argparse.Namespace, meta: dict[str, object], done: list[Launch], finished: bool) -> str:
    variants = list(dict.fromkeys(x.variant for x in done)) or []
    loads = [x.load_before for x in done]
    rows = []
    per: dict[str, dict[str, object]] = {}
    for v in variants:
        xs = [x for x in done if x.variant == v]
        counts = {k: sum(x.verdict == k for x in xs) for k in ("ok", "abort", "signal", "error", "timeout")}
        secs = [x.seconds for x in xs]
        per[v] = {"launches": len(xs), **counts, "median_s": statistics.median(secs)}
        other = counts["signal"] + counts["error"] + counts["timeout"]
        rows.append(
            f"| {v} | {len(xs)} | {counts['ok']} | {counts['abort']} | {other} | {_common.fmt(secs, 1)} |"
        )
    state = "complete" if finished else f"partial ({len(done)} launches so far)"
    by_jobs = {j: sum(x.jobs == j for x in done) for j in sorted({x.jobs for x in done})}
    commits = {c: sum(x.commit == c for x in done) for c in dict.fromkeys(x.commit for x in done)}
    first = meta.get("resumed_from")
    first_commit = first.get("commit", "?") if isinstance(first, dict) else meta["commit"]
    at = ", ".join(f"{n} at {c or first_commit}" for c, n in commits.items())
    how = ", ".join(
        f"{n} launched {'one at a time' if j == 1 else f'{j} at a time'}" for j, n in by_jobs.items()
    )
    md = [
        f"# Exit aborts under torchrun (issue 30), {meta['date']}: {state}",
        "",
        f"Machine: {meta['cpu']}, {meta['memory']}, kernel {meta['kernel']}, Python {meta['python']}, "
        f"torch {meta['torch']}, gloo, 2 ranks; commit {meta['commit']}"
        + (" (with uncommitted changes)" if meta["dirty"] else "")
        + f". Under load: 1-minute load average before a launch "
        f"{_common.fmt(loads, 1) if loads else '-'} (median (min-max)).",
        "",
        f"Run: `{meta['command']}`; each launch `{meta['launcher']} script.py NVME_DIR` in a fresh "
        f"directory ({how or 'none yet'}; commits: {at or '-'}), the variants interleaved launch by launch. Verdicts: abort = "
        '"terminate called" in the output or a rank dead of SIGABRT; other = another signal, another '
        f"non-zero exit, or no exit within {meta['timeout_s']:.0f} s.",
        *_resumed(meta),
        "",
        "| script | launches | exit 0 | aborts | other failures | wall s, median (min-max) |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    bad = [x for x in done if x.verdict != "ok"]
    if bad:
        md += ["## Failed launches", ""]
        for x in bad:
            tail = "\n".join(x.output.strip().splitlines()[-15:])
            md += [
                f"- {x.variant} #{x.index} ({x.started} UTC): {x.verdict}, exit {x.returncode}",
                "",
                textwrap.indent(tail, "      "),
                "",
            ]
    os.makedirs(_common.RESULTS, exist_ok=True)
    payload = {"finished": finished, "per_variant": per, "launches": [asdict(x) for x in done]}
    return _common.write_labelled_result("exit-aborts", args.label, meta, "\n".join(md), payload)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=30, help="launches per variant (default 30)")
    p.add_argument("--quick", action="store_true", help="1 launch per variant")
    p.add_argument("--label", default="", help="result file label")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a launch counts as hung")
    p.add_argument("--pause-while", default=None, help="wait between launches while this path exists")
    p.add_argument("--resume", action="store_true", help="continue the journal of this label")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="launches kept going at once (default 1; each launch's record says how many)",
    )
    p.add_argument("--until", default=None, help="HH:MM (UTC): start no launch after it")
    p.add_argument("--only", default=None, help="comma-separated variants (default: all six)")
    args = p.parse_args(argv)
    if args.quick:
        args.launches = 1
    codes = scripts()
    if args.only:
        unknown = set(args.only.split(",")) - set(codes)
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; known: {sorted(codes)}")
        codes = {k: v for k, v in codes.items() if k in args.only.split(",")}
    meta = _meta(args, codes)

    journal = ROOT / "build" / "exit-aborts" / f"{args.label or 'run'}.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    done: list[Launch] = []
    if args.resume and not journal.exists():
        _seed_journal(journal, args.label, meta)
    if args.resume and journal.exists():
        lines = journal.read_text().splitlines()
        head = json.loads(lines[0])
        if head["scripts_sha256"] != meta["scripts_sha256"]:
            p.error(f"{journal}: written for other scripts ({head['scripts_sha256']}); not resuming")
        done = [Launch(**json.loads(line)) for line in lines[1:]]
        meta["resumed_from"] = head
    else:
        head = {k: meta[k] for k in ("scripts_sha256", "command", "commit", "dirty", "date")}
        journal.write_text(json.dumps(head) + "\n")

    from tqdm import tqdm

    have = {v: sum(x.variant == v for x in done) for v in codes}
    # Round i holds every variant's i-th launch: the order is the same with one job or more.
    todo = [(i, v) for i in range(args.launches) for v in codes if have[v] <= i]
    bar = tqdm(total=args.launches * len(codes), initial=len(done), desc="exit-aborts", unit="launch")
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        running: set[concurrent.futures.Future[Launch]] = set()
        since_write = 0
        while todo or running:
            while todo and len(running) < args.jobs:
                while args.pause_while and os.path.exists(args.pause_while):
                    bar.set_postfix_str(f"paused: {args.pause_while} exists")
                    time.sleep(15)
                if _past(args.until):
                    todo.clear()  # start nothing more; the launches under way finish
                    break
                i, v = todo.pop(0)
                running.add(pool.submit(launch, codes[v], v, i, args.timeout, sys.executable, args.jobs))
            if not running:
                break
            finished, running = concurrent.futures.wait(running, return_when="FIRST_COMPLETED")
            for fut in finished:
                x = replace(fut.result(), commit=str(meta["commit"]))
                done.append(x)
                with journal.open("a") as f:
                    f.write(json.dumps(asdict(x)) + "\n")
                bad = sum(y.verdict != "ok" for y in done)
                bar.set_postfix_str(f"{x.variant}: {x.verdict} {x.seconds:.0f}s, not ok {bad}")
                bar.update(1)
                since_write += 1
            if since_write >= len(codes):
                _write(args, meta, done, finished=False)
                since_write = 0
    bar.close()
    have = {v: sum(x.variant == v for x in done) for v in codes}
    _write(args, meta, done, finished=all(n >= args.launches for n in have.values()))
    return 0 if all(x.verdict == "ok" for x in done) else 1


if __name__ == "__main__":
    sys.exit(main())
