"""dstrain's Hugging Face Trainer on 2 gloo ranks under torchrun: losses equal to the same Trainer
without dstrain (DDP) within summation-order tolerance at ZeRO-2 and at ZeRO-3 with parameters and
optimizer state on NVMe, resume from a checkpoint, and from_pretrained of save_model's output."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import _torchrun  # tests/_torchrun.py: torchrun, its launcher forked from the session's fork server
import pytest

# found, not imported: a collection that does not run these tests skips the ~2.5 CPU-s import
if importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra (transformers) is not installed", allow_module_level=True)

WORKER = Path(__file__).with_name("hf_trainer_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf")
    (out / "tmp").mkdir()  # torchrun's torchelastic_* folder and error files: with the run's files
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TMPDIR": str(out / "tmp"),
    }
    proc = _torchrun.run(
        ["--standalone", "--nproc_per_node", "2", str(WORKER), str(out)], env=env, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def test_zero2_losses_equal_plain_trainer(results: list[dict]) -> None:
    r = results[0]
    assert len(r["zero2"]) == len(r["ref_gpt2"]) == 4
    # same data, same AdamW groups and schedule: only the order of gradient sums differs (fp32)
    assert r["zero2"] == pytest.approx(r["ref_gpt2"], rel=1e-4)
    assert r["zero2_eval"] == pytest.approx(r["ref_eval"], rel=1e-4)


def test_zero3_nvme_losses_equal_plain_trainer(results: list[dict]) -> None:
    r = results[0]
    assert r["zero3"] == pytest.approx(r["ref_llama"], rel=1e-4)
    assert results[1]["zero3"] == r["zero3"]  # logged losses are gathered over the ranks


def test_resume_continues_the_run(results: list[dict]) -> None:
    r = results[0]
    # trainer_state.json brings the first two steps' log; steps 3-4 are trained after the resume
    assert len(r["resumed"]) == 4 and r["resumed"][:2] == r["zero3"][:2]
    assert r["resumed"][2:] == pytest.approx(r["zero3"][2:], rel=1e-6)


def test_save_model_loads_with_from_pretrained(results: list[dict]) -> None:
    r = results[0]
    assert r["from_pretrained_equal"] is True
    assert r["from_pretrained_keys"] == []
    # a generative model's generation config is saved beside its config (Llama can_generate)
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(r["saved_files"])
