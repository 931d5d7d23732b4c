"""A script that uses dstrain exits 0, promptly, whether or not it calls ``engine.close()``
(dstrain.dist.lifetime): the README's pipeline and MoE blocks and a 2-rank ZeRO-3 run with
parameters and optimizer state on NVMe, each with and without ``close()``, under torchrun; and at
exit the engine is closed and the process group destroyed before the interpreter goes (the abort
at exit, "terminate called without an active exception", came from gloo threads that outlived it).

The scripts, the launch and its verdict are bench/experiments/exit_aborts.py's; its 30-launch counts
(issue 30) are in bench/results (exit-aborts-*.md); here each variant runs once to stay fast, and a
variant that is a README torchrun block as written (pipeline/close) is launched, and judged by the
same verdict, by tests/test_readme_blocks.py::test_block_runs_under_torchrun instead of twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import _readme_blocks as rb  # noqa: E402  (tests/_readme_blocks.py: the README torchrun blocks)
import _torchrun  # noqa: E402  (tests/_torchrun.py: torchrun, its launcher forked from the fork server)

from bench.experiments import exit_aborts  # noqa: E402  (the scripts, and how a launch is judged)

SCRIPTS = exit_aborts.scripts()
README_TORCHRUN = {b.code for b in rb.blocks((ROOT / "README.md").read_text()) if b.mode == "torchrun"}
LAUNCHED_HERE = sorted(v for v, code in SCRIPTS.items() if code not in README_TORCHRUN)

# torchrun's torchelastic_* log folders and its workers' error files go to each test's tmp_path
pytestmark = pytest.mark.usefixtures("child_tmpdir")


def _launch(script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["--standalone", "--nproc_per_node", "2", str(script), *args]
    return _torchrun.run(argv, cwd=script.parent, env=env, timeout=timeout)


@pytest.mark.parametrize("variant", LAUNCHED_HERE)
def test_script_exits_zero_with_and_without_close(variant: str) -> None:
    """bench/experiments/exit_aborts.py --quick: each variant launched once."""
    x = exit_aborts.launch(SCRIPTS[variant], variant, 0, timeout=240, torchrun=_torchrun.run)
    assert x.verdict == "ok", x.output[-4000:]


def test_every_variant_is_launched_here_or_as_a_readme_torchrun_block() -> None:
    """The variants left to tests/test_readme_blocks.py are its torchrun blocks exactly, with the
    same 2 ranks; every no-close variant (never a README block) runs here."""
    by_code = {b.code: b for b in rb.blocks((ROOT / "README.md").read_text()) if b.mode == "torchrun"}
    elsewhere = sorted(set(SCRIPTS) - set(LAUNCHED_HERE))
    assert elsewhere == ["pipeline/close"]  # which one moved is pinned: a README change shows here
    assert all(by_code[SCRIPTS[v]].nproc == 2 for v in elsewhere)
    assert all(v in LAUNCHED_HERE for v in SCRIPTS if v.endswith("/no-close"))


def test_the_no_close_variants_do_not_call_close() -> None:
    for name, code in SCRIPTS.items():
        assert ("engine.close()" in code) == name.endswith("/close"), name


def test_a_script_without_its_close_line_is_refused_not_run_as_is() -> None:
    with pytest.raises(ValueError):
        exit_aborts.without_close("import dstrain\nengine = None\n")
    with pytest.raises(ValueError):
        exit_aborts.readme_block("```python\nprint(1)\n```\n", exit_aborts.MOE_MARKER)


def test_a_rank_dead_of_sigabrt_at_exit_is_counted_as_an_abort() -> None:
    """The detector the 30-launch counts rely on sees a rank that aborts after its work is done."""
    code = textwrap.dedent(
        """
        import os
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
        print("loss 0.0", flush=True)
        if dist.get_rank() == 1:
            os.abort()
        """
    )
    x = exit_aborts.launch(code, "abort-probe", 0, timeout=240, torchrun=_torchrun.run)
    assert x.verdict == "abort" and x.returncode != 0, (x.returncode, x.output[-4000:])


def test_at_exit_the_engine_is_closed_and_the_process_group_destroyed(tmp_path: Path) -> None:
    """An ``atexit`` hook registered before dstrain's runs after it: by then the engine the script
    left open is closed, no process group is left and no gloo thread runs, although the script still
    holds the engine and imported ``torch.distributed.nn`` after the group existed (as the first
    ``torch.optim.Adam(fused=True)`` does: its functions keep the world group in their defaults, whose
    threads then outlived the hook and aborted the README pipeline block at exit)."""
    script = tmp_path / "late_look.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit
            import os

            import torch
            import torch.distributed as dist

            engines = []

            def late_look():  # registered first, so it runs after dstrain's teardown
                engine = engines[0]
                print(f"rank {engine.topology.dp.rank}: pg={dist.is_initialized()}", flush=True)
                names = []
                for t in os.listdir("/proc/self/task"):
                    try:
                        with open(f"/proc/self/task/{t}/comm") as f:
                            names.append(f.read().strip())
                    except OSError:  # the thread ended meanwhile
                        pass
                print(f"gloo threads={sorted(n for n in names if 'gloo' in n)}", flush=True)
                engine.close()  # idempotent: closed already, nothing happens
                print("closed twice ok", flush=True)

            atexit.register(late_look)

            import dstrain

            dstrain.init_distributed()
            import torch.distributed.nn  # after the group: its functions' defaults hold the world group
            model = torch.nn.Linear(8, 8)
            config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": 1}}
            engine, _, _, _ = dstrain.initialize(model=model, config=config)
            engine.backward(engine(torch.randn(2, 8)).sum())
            engine.step()
            engines.append(engine)
            """
        )
    )
    r = _launch(script)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert r.stdout.count("pg=False") == 2 and r.stdout.count("closed twice ok") == 2, out[-4000:]
    assert r.stdout.count("gloo threads=[]") == 2, out[-4000:]
