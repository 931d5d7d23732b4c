"""The step thread (`dstrain.offload.optimizer.step_thread`): sub-group steps taken during the boundary
backward run on one thread of their own, beside backward.

- Training with it is bitwise the training with the same steps on the backward thread
  (``step_thread: false``), fp32 and bf16, optimizer state on the CPU or on NVMe, with the host master
  separated (the GPU code path) and every sub-group stepped on the thread.
- A step that fails on the thread surfaces as `StepThreadError` (its cause the original error) from the
  backward or the optimizer step that follows: not swallowed, no hang; so does a worker that ended.
- close() while a step is in flight waits for it, and leaves no thread behind.
- The queue is bounded and ordered.
- A script that never calls close(), leaving with steps handed to the thread, exits promptly and cleanly.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, make_model, run_child
from _offload_helpers import final_params, offload_config

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
import dstrain.offload.compose as compose  # noqa: E402
from dstrain.errors import StepThreadError  # noqa: E402
from dstrain.offload.optimizer.step_thread import StepThread  # noqa: E402
from dstrain.offload.param.host_master import HostMasterShards  # noqa: E402

STEPS = 4
NAME = "dstrain-offload-step"


def _step_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == NAME]


@contextlib.contextmanager
def _torn_down(engine: Any, monkeypatch: Any) -> Iterator[None]:
    """A failure test's teardown: the patches undone (the kernel works again), the engine closed, and,
    when the block passed, no step thread left behind."""
    try:
        yield
    finally:
        monkeypatch.undo()
        engine.close()
    assert not _step_threads()


def _config(tmp_path: Any, optimizer: str, bf16: bool, thread: bool) -> dict[str, Any]:
    cfg = offload_config(3, optimizer, str(tmp_path), sub_group=1024, bf16=bf16)
    cfg["zero_optimization"]["offload_optimizer"]["step_thread"] = thread
    return cfg


def _train(cfg: dict[str, Any], monkeypatch: Any, device: str = "cpu") -> dict[str, Any]:
    store = HostMasterShards(separate=True, pin_memory=device == "cuda")
    monkeypatch.setattr(compose, "build_param_store", lambda *a, **k: store)
    engine, opt = dstrain.initialize(model=make_model().to(device), config=cfg)[:2]
    try:
        # the reads ahead done before each backward (on NVMe a sub-group steps early only if its
        # state is in memory: this makes that so on a loaded machine too)
        losses = engine_losses(engine, STEPS, hook=lambda step, micro: opt.drain())
        s = opt.statistics()
        return {
            "losses": losses,
            "params": final_params(engine),
            "early": s.stepped_in_backward,
            "on_thread": s.stepped_on_thread,
            "sub_groups": s.sub_groups,
        }
    finally:
        engine.close()
        monkeypatch.undo()


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_steps_on_the_thread_train_bitwise_like_on_the_backward_thread(
    monkeypatch, tmp_path, bf16, optimizer
) -> None:
    serial = _train(_config(tmp_path, optimizer, bf16, False), monkeypatch)
    threaded = _train(_config(tmp_path, optimizer, bf16, True), monkeypatch)
    assert serial["on_thread"] == 0 and serial["early"] > 0
    # every sub-group stepped during backward was stepped on the thread (the first step only records)
    assert threaded["on_thread"] == threaded["early"] == serial["early"]
    assert serial["early"] == (STEPS - 1) * serial["sub_groups"]  # all but the first step's
    assert threaded["losses"] == serial["losses"]
    assert serial["losses"][-1] < serial["losses"][0]  # it trained
    for a, b in zip(threaded["params"], serial["params"], strict=True):
        assert torch.equal(a, b)
    assert not _step_threads()  # close() ended it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_on_cuda_the_thread_trains_bitwise_like_the_backward_thread(monkeypatch, tmp_path, optimizer) -> None:
    """The GPU layout (master and gradients page-locked on the host, bf16 shards on the GPU): the host
    steps on the thread while backward's kernels run, the same bits as on the backward thread."""
    serial = _train(_config(tmp_path, optimizer, True, False), monkeypatch, "cuda")
    threaded = _train(_config(tmp_path, optimizer, True, True), monkeypatch, "cuda")
    assert threaded["on_thread"] == threaded["early"] == serial["early"] > 0 == serial["on_thread"]
    assert threaded["losses"] == serial["losses"]
    for a, b in zip(threaded["params"], serial["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_device_gradient_steps_on_the_callers_stream(tmp_path) -> None:
    """Parameters offloaded to the CPU, the optimizer too: the fp32 master and its gradients stay on
    the GPU and the step on the thread is a device kernel (m, v copied up). Trained on a side
    stream, the thread's step must queue behind the gradient's kernels on that stream (not on the
    thread's default stream, which nothing orders after them): the same bits as on the backward thread."""
    out = []
    for thread in (False, True):
        cfg = _config(tmp_path, "cpu", True, thread)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        engine, opt = dstrain.initialize(model=make_model().cuda(), config=cfg)[:2]
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                losses = engine_losses(engine, STEPS)
            torch.cuda.synchronize()
            out.append((losses, final_params(engine), opt.statistics().stepped_on_thread))
        finally:
            engine.close()
    (serial, p_serial, n_serial), (threaded, p_threaded, n_threaded) = out
    assert n_serial == 0 < n_threaded
    assert threaded == serial
    for a, b in zip(p_threaded, p_serial, strict=True):
        assert torch.equal(a, b)


def _failing_kernel(monkeypatch: Any, *, block: threading.Event | None = None) -> dict[str, int]:
    """Make the fused AdamW kernel fail (or, with ``block``, wait for it) when run on the step thread."""
    real = torch._fused_adamw_
    seen = {"calls": 0, "done": 0}

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == NAME:
            seen["calls"] += 1
            if block is None:
                raise RuntimeError("injected failure on the step thread")
            assert block.wait(30)
            time.sleep(0.2)  # still running when close() is called
            out = real(*args, **kwargs)
            seen["done"] += 1
            return out
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    return seen


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_a_failure_on_the_thread_surfaces_typed(monkeypatch, tmp_path, optimizer) -> None:
    cfg = _config(tmp_path, optimizer, False, True)
    cfg["optimizer"]["type"] = "AdamW"
    engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    with _torn_down(engine, monkeypatch):
        engine_losses(engine, 1)  # the first armed pass only records; nothing on the thread yet
        seen = _failing_kernel(monkeypatch)
        with pytest.raises(StepThreadError) as info:  # (reads done first: on NVMe the steps go early)
            engine_losses(engine, 1, start=1, hook=lambda step, micro: opt.drain())
        assert isinstance(info.value.__cause__, RuntimeError)
        assert seen["calls"] >= 1


def test_after_a_failure_raised_in_backward_the_step_never_completes(monkeypatch, tmp_path) -> None:
    """The failure surfaces at the next hand-over, during backward; that sub-group and those dropped
    behind the failed one were never stepped. An engine.step() after it (a caller that caught the
    backward's error) must not finish the step without them: it raises, every time."""
    from _dstrain_helpers import global_batch

    cfg = _config(tmp_path, "cpu", False, True)
    cfg["optimizer"]["type"] = "AdamW"
    engine = dstrain.initialize(model=make_model(), config=cfg)[0]
    with _torn_down(engine, monkeypatch):
        engine_losses(engine, 1)  # the first armed pass only records; nothing on the thread yet
        assert engine.config.gradient_accumulation_steps == 1
        seen = _failing_kernel(monkeypatch)
        idx, targets = global_batch(1, engine.config.train_batch_size)
        mb = engine.config.train_micro_batch_size_per_gpu
        with pytest.raises(StepThreadError):
            engine.backward(engine(idx[:mb], targets[:mb]))  # a later hand-over says so
        assert seen["calls"] >= 1
        monkeypatch.undo()  # the kernel works again: still, the step is incomplete
        for _ in range(2):
            with pytest.raises(StepThreadError) as info:
                engine.step()
            assert isinstance(info.value.__cause__, StepThreadError)


def test_the_optimizer_step_returns_after_every_step_handed_to_the_thread(monkeypatch, tmp_path) -> None:
    """engine.step() joins the thread before it steps the rest and casts the master into the shards:
    with each step on the thread slowed down, none is still running when engine.step() returns (a
    step that were, would write the master after the cast read it)."""
    cfg = _config(tmp_path, "cpu", True, True)
    cfg["optimizer"]["type"] = "AdamW"
    engine = dstrain.initialize(model=make_model(), config=cfg)[0]
    try:
        engine_losses(engine, 1)  # the first armed pass only records; nothing on the thread yet
        release = threading.Event()
        release.set()  # (each step on the thread still sleeps 0.2 s before it runs)
        seen = _failing_kernel(monkeypatch, block=release)
        engine_losses(engine, 1, start=1)
        assert seen["calls"] > 0
        assert seen["done"] == seen["calls"]
    finally:
        monkeypatch.undo()
        engine.close()


def test_close_during_an_in_flight_step_joins_it(monkeypatch, tmp_path) -> None:
    from _dstrain_helpers import global_batch

    # room for every sub-group of a step: backward hands them all over and returns while they wait
    monkeypatch.setattr(compose, "StepThread", lambda: StepThread(depth=1 << 20))
    cfg = _config(tmp_path, "cpu", False, True)
    cfg["optimizer"]["type"] = "AdamW"
    engine = dstrain.initialize(model=make_model(), config=cfg)[0]
    release = threading.Event()
    try:
        engine_losses(engine, 1)
        seen = _failing_kernel(monkeypatch, block=release)
        idx, targets = global_batch(1, engine.config.train_batch_size)
        mb = engine.config.train_micro_batch_size_per_gpu
        engine.backward(engine(idx[:mb], targets[:mb]))  # the first step waits on the thread
        deadline = time.monotonic() + 30
        while not seen["calls"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen["calls"] == 1 and seen["done"] == 0  # one running, the others queued behind it
        threading.Timer(0.3, release.set).start()
    finally:
        release_at = time.monotonic()
        engine.close()  # while that step is in flight: returns once every step handed over is done
        monkeypatch.undo()
    assert time.monotonic() - release_at >= 0.2
    assert seen["done"] == seen["calls"] > 1
    assert not _step_threads()


def test_jobs_run_in_order_and_the_queue_is_bounded() -> None:
    thread = StepThread(depth=2)
    order: list[int] = []
    gate = threading.Event()
    thread.submit(lambda: (gate.wait(30), order.append(0)))
    thread.submit(lambda: order.append(1))
    third = threading.Thread(target=thread.submit, args=(lambda: order.append(2),))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # two queued or running: the third waits for room
    gate.set()
    third.join(30)
    thread.join()
    assert order == [0, 1, 2] and thread.jobs_done == 3
    seen: list[bool] = []
    thread.submit(lambda: seen.append(torch.is_grad_enabled()))
    thread.join()
    assert seen == [False]  # jobs run with gradients off
    thread.close()
    assert not thread.alive
    with pytest.raises(StepThreadError):
        thread.submit(lambda: None)


def test_a_failed_job_is_raised_once_and_drops_what_is_queued_behind_it() -> None:
    thread = StepThread(depth=3)
    gate = threading.Event()
    ran: list[int] = []

    def fail() -> None:
        gate.wait(30)
        raise ValueError("boom")

    thread.submit(fail)
    thread.submit(lambda: ran.append(1))
    gate.set()
    with pytest.raises(StepThreadError) as info:
        thread.join()
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == []  # dropped: the step it belonged to is incomplete anyway
    thread.join()  # raised once
    thread.submit(lambda: ran.append(2))  # and the thread still works
    thread.join()
    assert ran == [2]
    thread.close()


class _Fatal(BaseException):
    pass


def test_a_worker_that_ends_does_not_hang_its_callers() -> None:
    thread = StepThread(depth=1)

    def die() -> None:
        raise _Fatal

    thread.submit(die)
    t0 = time.monotonic()
    with pytest.raises(StepThreadError) as info:
        thread.join()  # the worker is gone: raised, not waited for forever
    assert isinstance(info.value.__cause__, _Fatal)
    assert time.monotonic() - t0 < 30
    assert not thread.alive
    ran: list[int] = []
    thread.submit(lambda: ran.append(1))  # another worker takes over
    thread.join()
    assert ran == [1]
    thread.close()


def test_a_script_that_never_closes_exits_promptly_with_steps_handed_over(tmp_path) -> None:
    # the worker is a daemon and its jobs hold torch tensors: leaving without step() or close()
    # mid-step must neither hang the interpreter's exit nor crash it (run_child: 600 s timeout,
    # SIGSEGV named, any other non-zero exit fails with the child's stderr)
    here = Path(__file__).resolve().parent
    t0 = time.monotonic()
    out = run_child(
        here / "_step_thread_exit_child.py", tmp_path, [here, here.parent], "exiting with the step thread"
    )
    assert out["handed"]["before"] > 0  # the thread was in use
    assert time.monotonic() - t0 < 120


# -- parameters and optimizer state both on NVMe: the master (and the gradients) in swap files --------

PARAMOPT_WIDTH, PARAMOPT_DEPTH = 256, 8  # 8 units of 66k elements, fp32 gradient shards 2.1 MB
GRADS_IN_FILE = 2 << 20  # offload_pinned_bytes below the gradient shards: they go to NVMe too
GRADS_IN_MEMORY = 8 << 20


def _paramopt_config(root: Any, *, bf16: bool, budget: int, thread: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 1 << 14,
            "offload_param": {"device": "nvme", "nvme_path": str(root), "buffer_count": 3},
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(root),
                "buffer_count": 2,
                "step_thread": thread,
            },
            "offload_pinned_bytes": budget,
        },
        "steps_per_print": 1000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _paramopt_engine(cfg: dict[str, Any], complete_reads: bool = True) -> tuple[Any, Any]:
    from _dstrain_helpers import TanhStack
    from test_offload_grads import _complete_reads

    torch.manual_seed(0)
    engine, opt = dstrain.initialize(model=TanhStack(PARAMOPT_WIDTH, PARAMOPT_DEPTH), config=cfg)[:2]
    if complete_reads:  # which sub-groups step during backward does not depend on the disk's timing
        _complete_reads(opt)
    return engine, opt


def _paramopt_steps(engine: Any, opt: Any, steps: int, start: int = 0) -> list[float]:
    losses = []
    for _ in range(start, start + steps):
        g = torch.Generator().manual_seed(100)  # the same batch every step: the loss must fall
        x = torch.randn(2, PARAMOPT_WIDTH, generator=g)  # (B, WIDTH)
        y = torch.randn(2, PARAMOPT_WIDTH, generator=g).tanh()
        opt.drain()  # the m, v read ahead during forward: in before backward
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _paramopt_train(cfg: dict[str, Any]) -> dict[str, Any]:
    engine, opt = _paramopt_engine(cfg)
    try:
        losses = _paramopt_steps(engine, opt, STEPS)
        s = opt.statistics()
        return {
            "losses": losses,
            "params": [t.clone() for t in engine.full_state_dict().values()],
            "grads_in_file": engine.zero.store.grads is not None,
            "early": s.stepped_in_backward,
            "on_thread": s.stepped_on_thread,
        }
    finally:
        engine.close()


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("budget", [GRADS_IN_MEMORY, GRADS_IN_FILE])
def test_with_parameters_and_optimizer_on_nvme_the_thread_trains_bitwise_like_the_backward_thread(
    tmp_path, bf16, budget
) -> None:
    """The master read from the parameter file (fp32: the shard; bf16: the master file, the stepped
    ranges cast into the shard file on the thread) and the gradients in memory or in their own file:
    the step thread runs the kernel and the write-backs of every sub-group stepped during backward,
    with the same bits as the backward thread, step after step."""
    serial = _paramopt_train(_paramopt_config(tmp_path, bf16=bf16, budget=budget, thread=False))
    threaded = _paramopt_train(_paramopt_config(tmp_path, bf16=bf16, budget=budget, thread=True))
    assert serial["grads_in_file"] == threaded["grads_in_file"] == (budget == GRADS_IN_FILE)
    assert serial["on_thread"] == 0 and serial["early"] > 0
    assert threaded["on_thread"] == threaded["early"] > 0  # every early step ran on the thread
    assert threaded["losses"] == serial["losses"]
    assert serial["losses"][-1] < serial["losses"][0]  # it trained
    for a, b in zip(threaded["params"], serial["params"], strict=True):
        assert torch.equal(a, b)
    assert not _step_threads()


@pytest.mark.parametrize("budget", [GRADS_IN_MEMORY, GRADS_IN_FILE])
def test_with_parameters_and_optimizer_on_nvme_a_failure_on_the_thread_surfaces_typed(
    monkeypatch, tmp_path, budget
) -> None:
    """The kernel fails on the thread: StepThreadError (its cause the kernel's error) from the backward
    or the step after; the failed sub-group's swap buffers went back to their pools unwritten (the
    m, v pool holds only what is read ahead), and close() neither hangs nor leaves the thread."""
    engine, opt = _paramopt_engine(_paramopt_config(tmp_path, bf16=False, budget=budget, thread=True))
    with _torn_down(engine, monkeypatch):
        _paramopt_steps(engine, opt, 1)  # the first armed pass only records; nothing on the thread yet
        seen = _failing_kernel(monkeypatch)
        with pytest.raises(StepThreadError) as info:
            _paramopt_steps(engine, opt, 1, start=1)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert seen["calls"] >= 1
        opt.drain()  # the writes in flight
        assert opt.statistics().swapper.buffers_in_use == len(opt.swapped.reads.ahead)


def test_with_parameters_and_optimizer_on_nvme_a_script_that_never_closes_exits_cleanly(tmp_path) -> None:
    """Its steps on the thread hold swap buffers of three pools (m and v, master, gradients) and one is
    still running (slowed down to 1 s) when the interpreter exits: no crash, and a prompt exit. (Before
    the exit hook that lets them finish, a read waiting for such a buffer kept dsio's exit drain
    waiting its full 60 s, and the step's writes found the loop closed.)"""
    here = Path(__file__).resolve().parent
    out = run_child(
        here / "_step_thread_exit_child.py",
        tmp_path,
        [here, here.parent],
        "exiting with the step thread (parameters + optimizer on NVMe)",
        args=["paramopt"],
    )
    exited = time.time()
    assert out["handed"]["before"] > 0  # the thread was in use
    assert out["handed"]["in_flight"] > 0  # and still had steps when the interpreter exited
    # from its last line to its end: the step in flight (1 s), dsio's drain, the interpreter's exit
    # (~3 s measured under load; without the hook over 60 s)
    assert exited - out["handed"]["t"] < 30


@pytest.mark.timeout(120)
def test_steps_dropped_behind_a_failure_on_the_thread_hand_their_buffers_back(monkeypatch, tmp_path) -> None:
    """Optimizer state on NVMe: the failing step is still running when the next one is handed over,
    which the thread then drops unrun (it clears its queue); that step's m, v buffers go back to the
    pool unwritten, as the failed one's do. Else the pool lends them to nobody from then on: it holds
    more than its read-ahead after the failure (and later reads wait for them)."""
    cfg = _config(tmp_path, "nvme", False, True)
    cfg["optimizer"]["type"] = "AdamW"
    engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    with _torn_down(engine, monkeypatch):
        engine_losses(engine, 1, hook=lambda step, micro: opt.drain())  # the first armed pass records
        queued = threading.Event()  # a second step is handed over while the first still runs
        real_submit, real_kernel = StepThread.submit, torch._fused_adamw_
        handed = {"n": 0}

        def submit(self: StepThread, job: Any) -> None:
            real_submit(self, job)
            handed["n"] += 1
            if handed["n"] == 2:
                queued.set()

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == NAME:
                queued.wait(10)
                raise RuntimeError("injected failure on the step thread")
            return real_kernel(*args, **kwargs)

        monkeypatch.setattr(StepThread, "submit", submit)
        monkeypatch.setattr(torch, "_fused_adamw_", kernel)
        with pytest.raises(StepThreadError):  # (reads done first: on NVMe the steps go early)
            engine_losses(engine, 1, start=1, hook=lambda step, micro: opt.drain())
        assert handed["n"] >= 2  # one failed, one dropped behind it
        opt.drain()  # the writes in flight
        assert opt.statistics().swapper.buffers_in_use == len(opt.swapped.reads.ahead)


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_an_engine_dropped_without_close_takes_its_optimizer_and_step_thread(tmp_path, optimizer) -> None:
    """An offloading engine dropped without ``close()`` after steps on the thread: at garbage collection
    its `OffloadAdam` goes (with its swap buffers) and so does the step thread. Its worker kept the last
    job, whose closure holds the optimizer, while waiting for the next, and nothing ended the worker:
    one thread (and one optimizer's pinned buffers) per engine dropped, for good."""
    import gc
    import weakref

    def trained_and_dropped() -> weakref.ref[Any]:
        engine, opt = dstrain.initialize(
            model=make_model(), config=_config(tmp_path, optimizer, False, True)
        )[:2]
        engine_losses(engine, 2, hook=lambda step, micro: opt.drain())
        assert opt.statistics().stepped_on_thread > 0
        assert len(_step_threads()) == before + 1
        return weakref.ref(opt)  # engine and optimizer dropped here, never closed

    before = len(_step_threads())
    dropped = trained_and_dropped()
    gc.collect()
    assert dropped() is None
    deadline = time.monotonic() + 30  # the worker ends on its own once told (nothing is queued)
    while len(_step_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_step_threads()) == before


@pytest.mark.timeout(120)
def test_steps_dropped_behind_a_failure_raised_by_the_step_hand_their_buffers_back(
    monkeypatch, tmp_path
) -> None:
    """The twin of the test above where the failure surfaces in ``engine.step()``'s join, not at a
    hand-over during backward: backward hands every sub-group step over and returns while the first one
    still runs; it fails after, the others are dropped unrun, and their m, v buffers go back to the pool
    (else it holds more than its read-ahead from then on)."""
    from _dstrain_helpers import global_batch

    monkeypatch.setattr(compose, "StepThread", lambda: StepThread(depth=1 << 20))  # room for every step
    cfg = _config(tmp_path, "nvme", False, True)
    cfg["optimizer"]["type"] = "AdamW"
    engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    with _torn_down(engine, monkeypatch):
        engine_losses(engine, 1, hook=lambda step, micro: opt.drain())  # the first armed pass records
        backward_done = threading.Event()
        real_kernel = torch._fused_adamw_

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == NAME:
                backward_done.wait(30)
                raise RuntimeError("injected failure on the step thread")
            return real_kernel(*args, **kwargs)

        monkeypatch.setattr(torch, "_fused_adamw_", kernel)
        idx, targets = global_batch(1, engine.config.train_batch_size)
        assert engine.config.gradient_accumulation_steps == 1
        opt.drain()  # the reads done: on NVMe the sub-groups step during backward
        engine.backward(engine(idx, targets))  # hands them all over, returns
        assert opt.statistics().stepped_in_backward >= 2  # one to fail, one (at least) dropped behind it
        backward_done.set()
        with pytest.raises(StepThreadError):
            engine.step()
        opt.drain()  # the writes in flight
        assert opt.statistics().swapper.buffers_in_use == len(opt.swapped.reads.ahead)
