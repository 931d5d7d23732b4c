"""`accelerate launch` as the launcher of a dstrain script: 2 processes form one gloo group through
dstrain.initialize and train like plain PyTorch on the global batch. On a machine with 2 GPUs
``accelerate launch --num_processes 2`` picks this launcher by itself; on this CPU machine
``--multi_gpu`` asks for it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate (the hf extra) is not installed")

SCRIPT = Path(__file__).with_name("accelerate_script.py")


def _reference() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model[0].weight.detach()


@pytest.mark.usefixtures("child_tmpdir")  # the launcher's torchelastic_* folder goes with tmp_path
def test_accelerate_launch_runs_a_dstrain_script(tmp_path: Path) -> None:
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    assert launcher is not None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["weight"] == ranks[1]["weight"]  # one model over both ranks
    assert ranks[0]["weight"] == pytest.approx(_reference().sum().item(), rel=1e-5)
