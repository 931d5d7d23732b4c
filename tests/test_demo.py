"""`make demo` (demo/train_demo.py): its checks can fail, its config is honest, and its tiny mode runs end to end.

The end-to-end test runs the real thing at the tiny size: 3 torchruns of 2 gloo ranks (reference, a run whose
rank 1 is SIGKILLed, a resume), NVMe optimizer offload through dsio, async checkpoints, live metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demo"))

import model as demo_model  # noqa: E402
import train_demo  # noqa: E402
from launch import Phase  # noqa: E402


def _phase(name: str, losses: dict[tuple[int, int], float]) -> Phase:
    return Phase(
        name=name,
        events=[
            {"event": "step", "rank": r, "step": s, "loss_hex": v.hex(), "t": float(s)}
            for (r, s), v in sorted(losses.items())
        ],
    )


def test_compare_is_bitwise_and_catches_one_ulp() -> None:
    ref = {(r, s): 1.0 + s / 10 for r in (0, 1) for s in range(1, 7)}
    crash = _phase("crash", {k: v for k, v in ref.items() if k[1] <= 3})
    good = _phase("resume", {k: v for k, v in ref.items() if k[1] > 2})
    assert train_demo.compare(_phase("reference", ref), crash, good)["bitwise_equal"]

    off = {k: v for k, v in ref.items() if k[1] > 2}
    off[(1, 5)] = float.fromhex(off[(1, 5)].hex()) + 2**-50  # one ulp-ish: still a mismatch
    verdict = train_demo.compare(_phase("reference", ref), crash, _phase("resume", off))
    assert not verdict["bitwise_equal"]
    assert verdict["mismatches_after_resume"] == [(1, 5)]
    # a resume that ran no step proves nothing
    assert not train_demo.compare(_phase("reference", ref), crash, _phase("resume", {}))["bitwise_equal"]


def test_config_asks_for_param_offload_only_when_dstrain_takes_it(tmp_path: Path) -> None:
    from dstrain import DSConfig, NotImplementedConfigError

    off, active_off = train_demo.build_config(tmp_path, micro=2, dtype="fp32", param_offload="off")
    assert "offload_param" not in off["zero_optimization"]
    assert not any("parameters -> NVMe" in a for a in active_off)
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert off["zero_optimization"]["stage"] == 3

    auto, active = train_demo.build_config(tmp_path, micro=2, dtype="bf16", param_offload="auto")
    probe = dict(auto, zero_optimization=dict(auto["zero_optimization"], offload_param={"device": "nvme",
                 "nvme_path": str(tmp_path)}))  # fmt: skip
    try:
        DSConfig.load(probe, world_size=2)
        accepted = True
    except NotImplementedConfigError:
        accepted = False
    assert ("offload_param" in auto["zero_optimization"]) is accepted
    assert any("parameters -> NVMe" in a for a in active) is accepted  # never claimed when not on
    assert auto["bf16"]["enabled"] is True
    if not accepted:
        with pytest.raises(NotImplementedConfigError):
            train_demo.build_config(tmp_path, micro=2, dtype="fp32", param_offload="on")
    with pytest.raises(ValueError):
        train_demo.build_config(tmp_path, micro=2, dtype="fp32", param_offload="maybe")


def test_cuda_without_cuda_is_a_clear_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: DEVICE=cuda would run")
    assert train_demo.main(["--device", "cuda", "--work", str(tmp_path / "w")]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before touching anything


def test_a_work_folder_not_made_by_the_demo_is_never_wiped(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    assert train_demo.main(["--tiny", "--work", str(tmp_path)]) == 2
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_bad_schedule_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        train_demo.main(["--tiny", "--ckpt-every", "5", "--kill-after", "3", "--work", str(tmp_path)])


def test_model_shape_is_validated_and_batches_are_a_function_of_step_and_rank() -> None:
    with pytest.raises(ValueError):
        demo_model.GPTShape(dim=65, heads=2)
    with pytest.raises(ValueError):
        demo_model.GPTShape(layers=0)
    text = demo_model.corpus(1 << 16)
    a = demo_model.batch(text, 7, 1, 2, 16)
    b = demo_model.batch(text, 7, 1, 2, 16)
    c = demo_model.batch(text, 7, 0, 2, 16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the inputs shifted by one


def test_report_table_from_a_result(tmp_path: Path) -> None:
    """The table is computed from events (tokens/s, swap rates) and says MISMATCH when there is one."""
    import report

    def ph(name: str, t0: float) -> Phase:
        events = [
            {"event": "start", "rank": r, "t": t0, "step": 0, "params": 1000, "steps": 4} for r in (0, 1)
        ]
        for s in range(1, 5):
            for r in (0, 1):
                events.append({"event": "step", "rank": r, "step": s, "t": t0 + s, "loss": 1.0, "tokens": 100,
                               "swap_read": 1e9 * s, "swap_written": 5e8 * s})  # fmt: skip
        events += [{"event": "save", "rank": r, "step": 2, "t": t0 + 2.5, "blocked_seconds": 0.01 * (r + 1)}
                   for r in (0, 1)]  # fmt: skip
        events += [{"event": "summary", "rank": r, "t": t0 + 5, "peak_rss_kib": 2048,
                    "checkpoint": {"dsio_checkpoint_bytes_written_total": 2e9, "dsio_checkpoint_saves_total": 2,
                                   "dsio_checkpoint_staging_seconds_total": 0.5,
                                   "dsio_checkpoint_write_seconds_total": 0.5}} for r in (0, 1)]  # fmt: skip
        return Phase(name=name, events=events, seconds=5.0, returncode=0)

    verdict = {"steps_compared_after_resume": 4, "steps_compared_before_crash": 2, "mismatches_after_resume": [(0, 3)],
               "mismatches_before_crash": [], "bitwise_equal": False}  # fmt: skip
    r = report.summarize(reference=ph("reference", 0), crash=ph("crash", 10), resume=ph("resume", 20),
                         verdict=verdict, active=["optimizer state -> NVMe"], config={"train_micro_batch_size_per_gpu": 2},
                         shape={"dim": 8}, device="cpu", dtype="fp32", wall_seconds=30.0)  # fmt: skip
    ref = r["reference"]
    assert ref["tokens_per_s"] == pytest.approx(600 / 3)  # 3 steps x 2 ranks x 100 tokens in 3 s
    assert ref["swap_read_gbps"] == pytest.approx(2.0)  # both ranks: 2 x 1 GB per second
    assert ref["checkpoints"]["per_rank"][0]["save_gbps"] == pytest.approx(2.0)
    assert ref["checkpoints"]["blocked_ms_median"] == pytest.approx(20.0)  # the slower rank's block
    table = report.table(r)
    assert "MISMATCH" in table and "bitwise equal" not in table

    # README's `<!-- numbers:demo source=... -->` block renders the same table from the JSON (scripts/readme_numbers.py)
    sys.path.insert(0, str(ROOT / "scripts"))
    import readme_numbers as rn

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench/results/demo-x.json").write_text(json.dumps(r))
    body = rn.render("demo", "bench/results/demo-x.json", root=tmp_path)
    assert (
        "`bench/results/demo-x.json`" in body
        and report.table(json.loads(json.dumps(r)), heading=False) in body
    )
    assert not rn.unsourced_figures(
        "<!-- numbers:demo source=bench/results/demo-x.json -->\n" + body + "<!-- /numbers -->"
    )
    del r["verdict"]
    (tmp_path / "bench/results/demo-y.json").write_text(json.dumps(r))
    with pytest.raises(rn.NumbersError):
        rn.render("demo", "bench/results/demo-y.json", root=tmp_path)


def test_tiny_demo_end_to_end(tmp_path: Path) -> None:
    """The real demo, tiny: trains, SIGKILLs rank 1, resumes from the latest committed step, bitwise equal."""
    out = tmp_path / "result"
    (tmp_path / "tmp").mkdir()  # the 3 torchruns' torchelastic_* folders and error files: with the test's
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "train_demo.py"), "--tiny", "--no-plot",  # make demo's defaults
         "--work", str(tmp_path / "work"), "--out", str(out)],  # fmt: skip
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.with_suffix(".json").read_text())
    v = r["verdict"]
    assert (
        v["bitwise_equal"] and v["steps_compared_after_resume"] > 0 and v["steps_compared_before_crash"] > 0
    )
    assert r["crash"]["killed"]["rank"] == 1 and r["crash"]["killed"]["step"] >= 5
    every = 2
    assert (
        r["resume"]["from_step"] % every == 0
        and 0 < r["resume"]["from_step"] <= r["crash"]["killed"]["step"] + 1
    )
    ref = r["reference"]
    assert ref["swap_read_mb_per_step"] > 0 and ref["swap_write_mb_per_step"] > 0
    # what the demo says is offloaded is what moved through the swap files, and nothing else is claimed
    assert r["swap_bytes_by_kind"].get("optimizer", 0) > 0
    claims_params = any(a.startswith("parameters -> NVMe") for a in r["offloads"])
    assert (r["swap_bytes_by_kind"].get("param", 0) > 0) is claims_params
    assert ref["checkpoints"]["saves"] == 4 and all(x["saves"] == 4 for x in ref["checkpoints"]["per_rank"])
    assert all(p["metrics_urls"] for p in r["phases"].values())
    assert "serves Prometheus metrics at http://" in proc.stdout
    assert "| tokens/s" in out.with_suffix(".md").read_text()


@pytest.mark.gpu
def test_tiny_demo_on_cuda(tmp_path: Path) -> None:
    """DEVICE=cuda: the same tiny demo on 2 GPUs (NCCL); on the lead's 2x H200 machine."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (2 NCCL ranks, one GPU each)")
    out = tmp_path / "result"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "train_demo.py"), "--tiny", "--no-plot", "--device", "cuda",
         "--work", str(tmp_path / "work"), "--out", str(out)],  # fmt: skip
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(out.with_suffix(".json").read_text())["verdict"]["bitwise_equal"]
