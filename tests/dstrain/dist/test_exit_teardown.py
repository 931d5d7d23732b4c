"""A script that uses dstrain exits 0, promptly, whether or not it calls ``engine.close()``
(dstrain.dist.lifetime): the README's pipeline and MoE blocks and a 2-rank ZeRO-3 run with
parameters and optimizer state on NVMe, each with and without ``close()``, under torchrun; and at
exit the engine is closed and the process group destroyed before the interpreter goes (the abort
at exit, "terminate called without an active exception", came from gloo threads that outlived it).

The 30-launch counts of issue 30 are in bench/results (exit-aborts-*.md); here each case runs once
to stay fast.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()

ZERO3_OFFLOAD = textwrap.dedent(
    """
    import os
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


def _readme_block(marker: str) -> str:
    """The README's python block containing ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    return next(b for b in blocks if marker in b)


SCRIPTS = {
    "pipeline": _readme_block("PipelineModule(layers"),
    "moe": _readme_block("MoE(hidden_size"),
    "zero3_offload": ZERO3_OFFLOAD,
}


def _without_close(code: str) -> str:
    out = re.sub(r"^engine\.close\(\)\n", "", code, flags=re.M)
    assert out != code, "the script should call engine.close() at the end"
    return out


def _torchrun(script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run(
        [*cmd, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=script.parent,
    )


@pytest.mark.parametrize("close", [True, False], ids=["close", "no_close"])
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_exits_zero_with_and_without_close(tmp_path: Path, name: str, close: bool) -> None:
    code = SCRIPTS[name] if close else _without_close(SCRIPTS[name])
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = _torchrun(script, str(nvme))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "terminate called" not in out and "loss" in r.stdout, out[-4000:]


def test_at_exit_the_engine_is_closed_and_the_process_group_destroyed(tmp_path: Path) -> None:
    """An ``atexit`` hook registered before dstrain's runs after it: by then the engine the script
    left open is closed and no process group is left."""
    script = tmp_path / "late_look.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit

            import torch
            import torch.distributed as dist

            engines = []

            def late_look():  # registered first, so it runs after dstrain's teardown
                engine = engines[0]
                print(f"rank {engine.topology.dp.rank}: pg={dist.is_initialized()}", flush=True)
                engine.close()  # idempotent: closed already, nothing happens
                print("closed twice ok", flush=True)

            atexit.register(late_look)

            import dstrain

            dstrain.init_distributed()
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
    r = _torchrun(script)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert r.stdout.count("pg=False") == 2 and r.stdout.count("closed twice ok") == 2, out[-4000:]
