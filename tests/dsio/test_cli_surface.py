"""``dsio --version``, ``dsio bench --help`` documents every option, bench shows progress, runs on
uvloop, and reads DeepSpeed "aio" blocks through IOConfig.from_deepspeed."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tomllib
from pathlib import Path

import pytest

import dsio
from dsio import cli

ROOT = Path(__file__).resolve().parents[2]


def test_version_matches_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsio {dsio.__version__}"
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["version"] == dsio.__version__


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_bench_help_explains_every_option():
    bench = _subparser("bench")
    assert bench.description and len(bench.description) > 100
    for action in bench._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 15, f"{action.option_strings} has no real help"
    text = bench.format_help()
    for flag in ("--dir", "--size", "--config", "--queue-depth", "--overlap-events", "--reps", "--quiet"):
        assert flag in text


def test_cli_loop_is_uvloop():
    pytest.importorskip("uvloop")

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert cli.run(which()).startswith("uvloop")


def _args(**kw):
    base = dict(
        backend=None,
        block_size=None,
        queue_depth=None,
        intra_op_parallelism=None,
        single_submit=None,
        overlap_events=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_bench_config_is_parsed_by_from_deepspeed(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": 8, "aio": {"thread_count": 2, "use_gds": False}}))
    cfg = cli._load_config(str(p), _args(queue_depth=16))
    assert cfg.intra_op_parallelism == 2 and cfg.queue_depth == 16 and cfg.gpu_backend == "bounce"
    assert cfg.overlap_events is True and cfg.block_size == 1 << 20  # DeepSpeed's defaults
    p.write_text(json.dumps({"aio": {"block_size": 512}}))  # DeepSpeed accepts it; a handle would not
    with pytest.raises(cli.CliError):
        cli._load_config(str(p), _args())
    p.write_text(json.dumps({"aio": {"blocksize": 4096}}))
    with pytest.raises(cli.CliError):
        cli._load_config(str(p), _args())


def test_bench_shows_progress_unless_quiet(tmp_path, capsys):
    # In process (tqdm writes to sys.stderr, captured here as in a pipe): two interpreter starts fewer.
    args = [
        "bench",
        "--dir",
        str(tmp_path),
        "--size",
        "4M",
        "--op-size",
        "4K",
        "--ops",
        "64",
        "--reps",
        "2",
        "--json",
    ]
    assert cli.main(args) == 0
    r = capsys.readouterr()
    assert re.search(r"dsio bench: 100%\|.*\| 10/10", r.err), r.err
    assert json.loads(r.out)["reps"] == 2
    assert cli.main([*args, "--quiet"]) == 0
    q = capsys.readouterr()
    assert "dsio bench" not in q.err and json.loads(q.out)["reps"] == 2, q.err
