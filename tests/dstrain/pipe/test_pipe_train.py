"""train_batch / eval_batch on 2 real gloo processes (one spawn runs every scenario; each test checks one).

PP=2 equals single-process gradient accumulation bitwise; tied weights across stages; variable sequence
lengths; activation checkpointing; eval; and the failures that must end every rank with an error, never a
hang: an exhausted iterator, a raising stage, mismatched shapes, out-of-step labels.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dstrain_helpers import spawn
from torch import nn

from dstrain.pipe.errors import PipelineError
from dstrain.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

DIM, VOCAB, MB = 16, 12, 4
ROOT = Path(__file__).resolve().parents[3]
DS_LOSSES = Path(__file__).with_name("pipe_ds_losses.json")  # recorded by bench/pipe.py --record-ds-losses


def mlp_layers() -> list[Any]:
    return [
        LayerSpec(nn.Linear, DIM, 32),
        nn.Tanh(),
        LayerSpec(nn.Linear, 32, 32),
        nn.Tanh(),
        LayerSpec(nn.Linear, 32, 32),
        nn.Tanh(),
        LayerSpec(nn.Linear, 32, 8),
    ]


def lm_head(emb: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ emb.weight.t()  # (B, T, V)


def tied_layers() -> list[Any]:
    return [
        TiedLayerSpec("emb", nn.Embedding, VOCAB, DIM),
        LayerSpec(nn.Linear, DIM, DIM),
        torch.tanh,
        LayerSpec(nn.Linear, DIM, DIM),
        TiedLayerSpec("emb", nn.Embedding, VOCAB, DIM, forward_fn=lm_head),
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def mlp_data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MB, DIM, generator=g), torch.randint(0, 8, (MB,), generator=g)) for _ in range(n)]


def lm_data(n: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches whose sequence length changes from micro-batch to micro-batch (3..8)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = int(torch.randint(3, 9, (), generator=g))
        idx = torch.randint(0, VOCAB, (MB, seq), generator=g)
        out.append((idx, (idx * 5 + 1) % VOCAB))
    return out


def config(gas: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "steps_per_print": 10**6,
    }
    cfg.update(extra)
    return cfg


def build_engine(module: PipelineModule, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(engine, runner) for this rank's stage, through dstrain.initialize."""
    import dstrain

    engine, _, _, _ = dstrain.initialize(model=module, config=cfg)
    return engine, engine.runner


def reference(
    layers: list[Any], loss_fn: Any, data: list[Any], gas: int, steps: int, clip: float = 0.0
) -> dict[str, Any]:
    """The whole model in one process: gradient accumulation over the same micro-batches, same SGD (and
    torch's ``clip_grad_norm_`` when ``clip`` > 0: the tied embedding is one parameter here, counted once)."""
    model = PipelineModule(layers, num_stages=1, loss_fn=loss_fn, seed_layers=True, stage_id=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for s in range(steps):
        total = 0.0
        for m in range(gas):
            x, y = data[s * gas + m]
            loss = loss_fn(model(x), y)
            (loss.float() * (1.0 / gas)).backward()  # what Precision.scale_loss computes at fp32
            total += loss.item()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(torch.tensor(total / gas, dtype=torch.float32)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"model": model, "losses": losses, "norms": norms, "state": state}


def _compare(module: PipelineModule, ref: dict[str, Any]) -> dict[str, Any]:
    state = module.state_dict()
    return {
        "max_param_diff": max((state[k] - ref["state"][k]).abs().max().item() for k in state),
        "bitwise": all(torch.equal(state[k], ref["state"][k]) for k in state),
    }


def _train(kind: str, gas: int, steps: int, clip: float = 0.0, **pipe: Any) -> dict[str, Any]:
    layers, loss_fn, data = (
        (mlp_layers(), F.cross_entropy, mlp_data(gas * steps + gas))
        if kind == "mlp"
        else (tied_layers(), lm_loss, lm_data(gas * steps))
    )
    module = PipelineModule(
        layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform", seed_layers=True
    )
    cfg = config(gas, pipeline=pipe) if pipe else config(gas)
    cfg["gradient_clipping"] = clip
    engine, runner = build_engine(module, cfg)
    runner.trace = True
    it = iter(data)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.train_batch(it).item())
        norms.append(engine.statistics().last_grad_norm)
    timeline = runner.timeline()
    ref = reference(layers, loss_fn, data, gas, steps, clip)
    out: dict[str, Any] = {"losses": losses, "ref_losses": ref["losses"], **_compare(module, ref)}
    out["timeline"] = timeline
    out["norms"], out["ref_norms"] = norms, ref["norms"]
    if kind == "mlp":  # eval on the next micro-batches: no step, the mean loss on every stage
        eval_loss = runner.eval_batch(it).item()
        with torch.no_grad():
            ref_eval = [F.cross_entropy(ref["model"](x), y).item() for x, y in data[gas * steps :]]
        out["eval"] = (eval_loss, float(torch.tensor(sum(ref_eval) / gas, dtype=torch.float32)))
        out["unchanged_by_eval"] = _compare(module, ref)["bitwise"]
    else:
        w = module.tied_modules["emb"].weight.detach().clone()
        got = [torch.zeros_like(w) for _ in range(2)]
        dist.all_gather(got, w)
        out["tied_identical"] = torch.equal(got[0], got[1])
    out["stats"] = runner.statistics()
    out["prepares"] = engine.stepper.statistics().prepares  # one per step, at the boundary backward
    out["global_steps"] = engine.global_steps
    engine.close()
    return out


class Boom(nn.Module):
    """Raises on its ``at``-th call (a stage that fails mid-batch)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom in stage 1")
        return x


def _failure(case: str, transport: str = "auto") -> dict[str, Any]:
    """Run one failing batch; returns (exception class name, seconds until raised, weights unchanged)."""
    rank = dist.get_rank()
    layers = mlp_layers()
    if case == "raises":
        layers.insert(5, Boom(at=2))  # lands on stage 1 (uniform split of 8: [0, 4), [4, 8))
    module = PipelineModule(
        layers, num_stages=2, loss_fn=F.cross_entropy, partition_method="uniform", seed_layers=True
    )
    # a neighbour that missed the abort would wait this long and raise P2PTimeoutError instead
    engine, runner = build_engine(module, config(4, pipeline={"p2p_timeout": 60, "transport": transport}))
    data = mlp_data(4)
    if case == "exhausted":
        data = data[:2]
    elif case == "shapes":  # micro-batch 2: 3 labels for 4 inputs
        data[2] = (data[2][0], data[2][1][:3])
    elif case == "labels" and rank == 1:  # the last stage's iterator is one micro-batch ahead
        data = data[1:] + data[:1]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    start = time.monotonic()
    err: BaseException | None = None
    try:
        runner.train_batch(iter(data))
    except Exception as e:
        err = e
    took = time.monotonic() - start
    again = None
    try:  # a poisoned pipeline refuses at once
        runner.train_batch(iter(mlp_data(4)))
    except Exception as e:
        again = type(e).__name__
    unchanged = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    return {
        "error": type(err).__name__ if err else None,
        "message": str(err),
        "is_pipeline_error": isinstance(err, PipelineError),
        "seconds": took,
        "again": again,
        "unchanged": unchanged,
    }


def _deepspeed_anchor() -> list[float]:
    """The model, data and optimizer of the recorded DeepSpeed run (bench/pipe.py --record-ds-losses)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.pipe import _optimizer_cfg, make_data, make_layers

    spec = json.loads(DS_LOSSES.read_text())["model"]
    layers = make_layers(spec["dim"], spec["hidden_layers"])  # nn.Module instances, seeded as DeepSpeed's run
    module = PipelineModule(layers, num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
    cfg = config(spec["gas"], optimizer=_optimizer_cfg())
    cfg["train_micro_batch_size_per_gpu"] = spec["micro_batch"]
    engine, _ = build_engine(module, cfg)
    it = iter(make_data(spec["steps"] * spec["gas"], spec["micro_batch"], spec["dim"]))
    losses = [engine.train_batch(it).item() for _ in range(spec["steps"])]
    engine.close()
    return losses


def _resume(directory: str) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more; a fresh engine (other initial weights) loads and trains the same 2."""
    adam = {"type": "Adam", "params": {"lr": 1e-2}}
    data = mlp_data(16)

    def engine(seed: int) -> tuple[Any, PipelineModule]:
        module = PipelineModule(mlp_layers(), 2, F.cross_entropy, "uniform", seed_layers=True, base_seed=seed)
        return build_engine(module, config(4, optimizer=adam))[0], module

    first, m1 = engine(1234)
    it = iter(data)
    [first.train_batch(it) for _ in range(2)]
    first.save_checkpoint(directory)
    cont = [first.train_batch(it).item() for _ in range(2)]
    want = {k: v.clone() for k, v in m1.state_dict().items()}
    first.close()
    second, m2 = engine(99)
    second.load_checkpoint(directory)
    it = iter(data[8:])
    resumed = [second.train_batch(it).item() for _ in range(2)]
    got = m2.state_dict()
    second.close()
    # one stage over both ranks (data parallel 2) cannot take the two stages' files: refused, naming both
    import dstrain

    module = PipelineModule(mlp_layers(), 1, F.cross_entropy, "uniform", seed_layers=True, base_seed=5)
    third = build_engine(module, config(4, optimizer=adam))[0]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    try:
        third.load_checkpoint(directory)
        restaged: Any = None
    except dstrain.ReshapeError as e:
        restaged = {"error": type(e).__name__, "message": str(e), "steps": third.global_steps}
    restaged_unchanged = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    third.close()
    return {
        "losses": (cont, resumed),
        "bitwise": all(torch.equal(got[k], v) for k, v in want.items()),
        "restaged": restaged,
        "restaged_unchanged": restaged_unchanged,
    }


def _half(dtype: str) -> dict[str, Any]:
    """bf16 / fp16 compute (fp32 master weights): activations and gradients cross stages in that dtype."""
    module = PipelineModule(mlp_layers(), 2, F.cross_entropy, "uniform", seed_layers=True)
    cfg = config(4, **{dtype: {"enabled": True}})
    engine, runner = build_engine(module, cfg)
    it = iter(mlp_data(12))
    losses = [engine.train_batch(it).item() for _ in range(3)]
    st = runner.statistics()
    sent = st.send_activation or st.send_grad
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    engine.close()
    return {"losses": losses, "bytes": sent.payload_bytes, "skipped": engine.skipped_steps, "state": state}


def unpipelined_half(dtype: str) -> dict[str, Any]:
    """The same model, data and config without a pipeline: one process (world size 1, no process group),
    ``engine(x)`` / ``engine.backward`` / ``engine.step`` over the 4 micro-batches of each step."""
    import dstrain

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks
    try:
        module = PipelineModule(mlp_layers(), 1, F.cross_entropy, "uniform", seed_layers=True, stage_id=0)
        engine, _, _, _ = dstrain.initialize(model=module, config=config(4, **{dtype: {"enabled": True}}))
        data, losses = mlp_data(12), []
        for s in range(3):
            total = 0.0
            for x, y in data[4 * s : 4 * s + 4]:
                loss = F.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.float().item()
            losses.append(float(torch.tensor(total / 4, dtype=torch.float32)))
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        engine.close()
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "state": state}


def _scenarios(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "bf16": _half("bf16"),
        "fp16": _half("fp16"),
        "resume": _resume(directory),
        "deepspeed": _deepspeed_anchor(),
        "mlp": _train("mlp", 4, 3),
        "tied": _train("tied", 4, 3),
        "mlp_clip": _train("mlp", 4, 3, clip=0.05),
        "tied_clip": _train("tied", 4, 3, clip=0.05),
        "ckpt": _train("mlp", 4, 2, activation_checkpoint_interval=2),
        "mlp8": _train("mlp", 8, 1),
        "few": _train("mlp", 1, 2),  # fewer micro-batches than stages
    }
    for case in ("exhausted", "raises", "shapes", "labels"):
        out[case] = _failure(case)
    # NCCL's discipline on gloo: untagged parts matched by order only, a process group per direction
    out["ordered_mlp"] = _train("mlp", 4, 3, transport="ordered")
    out["ordered_tied"] = _train("tied", 4, 3, transport="ordered")
    out["ordered_raises"] = _failure("raises", transport="ordered")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as directory:
        res = spawn(_scenarios, directory, world=2, start_method="forkserver")
    assert time.monotonic() - start < 600  # never a hang (loose: 2 cores shared with other jobs)
    return res


def test_pp2_equals_single_process_accumulation_bitwise(results: list[dict[str, Any]]) -> None:
    """fp32 MLP, 1, 4 and 8 micro-batches: losses and every weight bitwise equal to one process."""
    for case in ("mlp", "mlp8", "few"):
        for r in results:
            assert r[case]["bitwise"], (case, r[case]["max_param_diff"])
            assert r[case]["losses"] == r[case]["ref_losses"], case  # the same mean loss on every stage
    for r in results:
        assert r["mlp"]["prepares"] == r["mlp"]["global_steps"] == 3
    s0, s1 = results[0]["mlp"]["stats"], results[1]["mlp"]["stats"]
    assert s0.peak_live_activations == 2 and s1.peak_live_activations == 1  # 1F1B: S - s in flight
    assert s0.send_activation.messages == 12 and s1.recv_grad is None
    assert s0.send_activation.metadata_messages == 1  # fixed shapes: metadata once
    assert s1.recv_activation.speculative_hits == 10  # payload receives posted ahead (all but 0 and 1)
    assert s1.send_grad.payload_bytes == s0.send_activation.payload_bytes == 12 * MB * 32 * 4


def test_eval_batch(results: list[dict[str, Any]]) -> None:
    for r in results:
        got, want = r["mlp"]["eval"]
        assert got == want
        assert r["mlp"]["unchanged_by_eval"]


def test_tied_weights_and_variable_sequence_length(results: list[dict[str, Any]]) -> None:
    """Embedding tied to the LM head on the other stage, sequence length changing every micro-batch:
    within 1e-6 of one process, and the two stages' copies bitwise identical.

    Not bitwise: one process accumulates the head's and the embedding's gradient of each micro-batch into
    one tensor in turn; the pipeline sums each stage's accumulated part once at the end (another order).
    """
    for r in results:
        t = r["tied"]
        assert t["max_param_diff"] <= 1e-6
        assert max(abs(a - b) for a, b in zip(t["losses"], t["ref_losses"], strict=True)) <= 1e-6
        assert t["tied_identical"]
    assert results[0]["tied"]["stats"].send_activation.metadata_messages > 6  # shapes changed, sent again


def test_activation_checkpointing(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["ckpt"]["bitwise"]
    # stage 0 holds 4 layers: every 2 recomputed, so fewer bytes saved for backward
    assert (
        results[0]["ckpt"]["stats"].peak_activation_bytes < results[0]["mlp"]["stats"].peak_activation_bytes
    )


@pytest.mark.parametrize(
    ("case", "errors"),
    [
        ("exhausted", ("DataExhaustedError", "PipelineAbortedError")),
        ("raises", ("PipelineAbortedError", "PipelineError")),
        ("shapes", ("ShapeMismatchError", "PipelineAbortedError")),
        ("labels", ("PipelineAbortedError", "LabelMismatchError")),
    ],
)
def test_failures_end_every_rank(results: list[dict[str, Any]], case: str, errors: tuple[str, str]) -> None:
    """Each rank raises a PipelineError (the failing rank its own, the other the abort), promptly; no rank
    stepped the optimizer; the pipeline then refuses further batches."""
    for rank, r in enumerate(results):
        f = r[case]
        assert f["error"] == errors[rank], (rank, f)
        assert f["is_pipeline_error"]
        assert f["seconds"] < 60
        assert f["unchanged"]
        assert f["again"] == "PipelineError"
    if case == "raises":
        assert "boom in stage 1" in results[0]["raises"]["message"]  # the origin's error, on the other rank


def test_losses_match_deepspeed_pipeline_engine(results: list[dict[str, Any]]) -> None:
    """Same model, data and Adam as DeepSpeed's PipelineEngine run recorded in pipe_ds_losses.json: every
    step's loss within 1e-5 over 10 steps, on both stages."""
    want = json.loads(DS_LOSSES.read_text())["losses"]
    assert len(want) == 10
    for r in results:
        got = r["deepspeed"]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)


def test_checkpoint_resume_bitwise(results: list[dict[str, Any]]) -> None:
    """Each stage saves its own rank file; a fresh engine that loads them continues bitwise."""
    for r in results:
        cont, resumed = r["resume"]["losses"]
        assert cont == resumed
        assert r["resume"]["bitwise"]


def test_a_checkpoint_of_another_stage_count_is_refused_naming_both(results: list[dict[str, Any]]) -> None:
    """Saved by 2 stages, loaded by 1 stage over the same 2 ranks: a ReshapeError naming both stage
    counts, before anything is applied."""
    for rank, r in enumerate(results):
        got = r["resume"]["restaged"]
        assert got is not None and got["error"] == "PipelineLayoutError", (rank, got)
        assert "saved 2 pipeline stages" in got["message"] and "this run 1 (stage 0)" in got["message"], got
        assert got["steps"] == 0 and r["resume"]["restaged_unchanged"], got


def test_bf16_and_fp16(results: list[dict[str, Any]]) -> None:
    """Half-precision stages send half the bytes of fp32 and train to within 2e-2 of the fp32 losses; the
    loss (and fp16's skip decision) is the same on both stages."""
    ref = results[0]["mlp"]["losses"]
    for dtype in ("bf16", "fp16"):
        a, b = results[0][dtype], results[1][dtype]
        assert a["losses"] == b["losses"] and a["skipped"] == b["skipped"]
        assert a["bytes"] == b["bytes"] == 12 * MB * 32 * 2  # 12 messages of (MB, 32) 2-byte elements
        assert max(abs(x - y) for x, y in zip(a["losses"], ref, strict=True)) <= 2e-2, (
            dtype,
            a["losses"],
            ref,
        )


def test_gradient_clipping_over_stages(results: list[dict[str, Any]]) -> None:
    """Clipping with PP=2: the global norm sums over both stages (the tied embedding/head weight counted
    once), on both stages equal to one process's ``clip_grad_norm_``, and the clipped weights within 1e-6.

    Not bitwise: torch's norm is an fp32 norm of per-tensor fp32 norms; dstrain sums squared per-piece norms
    in float64 over the stages (another order), so the norm, and the clip factor, differ in the last bits.
    """
    for case in ("mlp_clip", "tied_clip"):
        for r in results:
            c = r[case]
            assert min(c["ref_norms"]) > 0.05, case  # every step really clipped
            for got, want in zip(c["norms"], c["ref_norms"], strict=True):
                assert abs(got - want) <= 1e-6 * want, (case, c["norms"], c["ref_norms"])
            assert c["max_param_diff"] <= 1e-6, (case, c["max_param_diff"])
            assert max(abs(a - b) for a, b in zip(c["losses"], c["ref_losses"], strict=True)) <= 1e-6
        # unclipped, the same run moves further: clipping changed the weights
        assert results[0][case]["losses"][-1] != results[0][case.split("_")[0]]["losses"][-1]
    assert (
        results[0]["tied_clip"]["norms"] == results[1]["tied_clip"]["norms"]
    )  # the same norm on every stage


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_equals_the_unpipelined_run(results: list[dict[str, Any]], dtype: str) -> None:
    """bf16 / fp16 with PP=2 against the same engine without a pipeline (one process): the activations and
    gradients crossing stages are the same half-precision tensors, gradients accumulate in the same dtype and
    order, so losses and weights are bitwise equal (each stage holds its layers' weights)."""
    want = unpipelined_half(dtype)
    for r in results:
        got = r[dtype]
        assert got["losses"] == want["losses"], (got["losses"], want["losses"])
        for k, v in got["state"].items():
            assert torch.equal(v, want["state"][k]), k


def test_ordered_transport_nccls_discipline_on_gloo(results: list[dict[str, Any]]) -> None:
    """The transport NCCL uses (no tags: a message's parts and the fillers matched by order alone; one process
    group per direction, receives posted just in time) trains bitwise like the tagged one
    (variable sequence lengths and tied weights included), and a failing stage still ends every rank."""
    for rank, r in enumerate(results):
        assert r["ordered_mlp"]["bitwise"] and r["ordered_mlp"]["losses"] == r["mlp"]["losses"]
        assert r["ordered_mlp"]["eval"] == r["mlp"]["eval"]
        assert r["ordered_tied"]["losses"] == r["tied"]["losses"] and r["ordered_tied"]["tied_identical"]
        f = r["ordered_raises"]
        assert f["error"] == ("PipelineAbortedError", "PipelineError")[rank] and f["unchanged"], f
        assert f["seconds"] < 60 and f["again"] == "PipelineError"
    assert results[0]["ordered_tied"]["stats"].send_activation.metadata_messages > 6


def test_timeline_and_sends_posted_before_receives(results: list[dict[str, Any]]) -> None:
    """The per-instruction timeline of the last batch holds every instruction of the stage's schedule once,
    in order, then the status, drain and step phases. Within a step sends are posted before receives: stage 0
    sends micro-batch k's activation before it waits for micro-batch k-1's gradient (DeepSpeed's order is
    the reverse), and the last stage returns a gradient before it waits for the next activation."""
    from dstrain.pipe.runner import sends_first
    from dstrain.pipe.schedule import train_schedule

    for stage, r in enumerate(results):
        tl = r["mlp"]["timeline"]
        want = [
            (i.op.value, i.micro_batch)
            for step in train_schedule(4, 2, stage).steps
            for i in sends_first(step)
            if i.micro_batch is not None
        ]
        got = [(e.what, e.micro_batch) for e in tl]
        assert got[: len(want)] == want
        assert [w for w, _ in got[len(want) :]] == ["status", "drain", "step"]
        assert all(a.end <= b.start for a, b in zip(tl, tl[1:])) and all(e.seconds >= 0 for e in tl)
    order = [(e.what, e.micro_batch) for e in results[0]["mlp"]["timeline"]]
    for k in range(1, 4):
        assert order.index(("SendActivation", k)) < order.index(("RecvGrad", k - 1))
