"""Pipeline p2p on 2 real gloo processes: metadata per change, receives posted ahead, aborts and timeouts.

Each scenario runs twice: with gloo's tagged transport, and with NCCL's discipline on gloo (``ordered``: every
part of every message on tag 0, a process group per direction, polled waits), where only the order of sends
and receives matches them, as on NCCL."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dstrain_helpers import spawn

from dstrain.pipe.errors import P2PTimeoutError, PipelineAbortedError
from dstrain.pipe.p2p import Receiver, Sender, TensorMeta, decode_meta, encode_meta
from dstrain.pipe.transport import Transport

# (shape, dtype) of each message: a stable run, a change right after it (the speculative receive gets
# filler), every-message changes (variable sequence length), a dtype change, a two-tensor message
SHAPES = [
    [((2, 3), torch.float32)],
    [((2, 3), torch.float32)],
    [((2, 3), torch.float32)],
    [((2, 3), torch.float32)],
    [((2, 5), torch.float32)],
    [((2, 7), torch.float32)],
    [((2, 4), torch.float32)],
    [((2, 4), torch.bfloat16)],
    [((2, 4), torch.bfloat16)],
    [((4,), torch.int64), ((2, 2, 2), torch.float16)],
    # 30 tensors: metadata too long for the header (sent after it), unchanged, then changed after a stable run
    # (fillers of 30 tensors, then the metadata, then the payload)
    [((1, 2, 3), torch.float32)] * 30,
    [((1, 2, 3), torch.float32)] * 30,
    [((1, 2, 4), torch.float32)] * 30,
]


def _tensor(k: int, j: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(int(torch.Size(shape).numel())).reshape(shape) + 100 * k + 10 * j).to(dtype)


def _scenarios(ordered: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    t = Transport.gloo_ordered([[0, 1]], [0, 1]) if ordered else Transport.gloo(None)
    # 1. variable shapes and dtypes arrive exactly, in order
    if rank == 0:
        s = Sender(peer=1, tag=10, transport=t, timeout=30, name="t")
        for k, spec in enumerate(SHAPES):
            s.send(tuple(_tensor(k, j, sh, dt) for j, (sh, dt) in enumerate(spec)), micro_batch=k, ack=0)
        s.drain()
        out["send"] = s.statistics()
    else:
        r = Receiver(peer=0, tag=10, transport=t, timeout=30, name="t")
        r.expect(len(SHAPES))
        ok = []
        for k, spec in enumerate(SHAPES):
            got = r.recv(k).tensors
            want = [_tensor(k, j, sh, dt) for j, (sh, dt) in enumerate(spec)]
            ok.append(
                len(got) == len(want)
                and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
            )
        out["ok"] = ok
        out["recv"] = r.statistics()
    # 2. an ABORT arrives in place of the next message, with its reason
    if rank == 0:
        s = Sender(peer=1, tag=20, transport=t, timeout=30, name="a")
        s.send((torch.ones(3),), micro_batch=0, ack=0)
        s.abort("rank 0 (stage 0) failed: ValueError: boom")
    else:
        r = Receiver(peer=0, tag=20, transport=t, timeout=30, name="a")
        r.expect(3)
        r.recv(0)
        start = time.monotonic()
        try:
            r.recv(1)
            out["abort"] = None
        except PipelineAbortedError as e:
            out["abort"] = (str(e), time.monotonic() - start)
    dist.barrier()
    # 3. a peer that sends nothing: the wait times out (rank 0 stays alive meanwhile, silent: a timed-out
    # gloo wait closes the connection, so nothing collective follows)
    # (rank 0 leaves once rank 1 says its wait ended, through a file: no collective after a timed-out wait)
    done = os.path.join(tempfile.gettempdir(), f"dstrain-p2p-silent-{os.environ['MASTER_PORT']}")
    if rank == 0:
        deadline = time.monotonic() + 60.0
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.path.exists(done):
            os.unlink(done)
    else:
        r = Receiver(peer=0, tag=30, transport=t, timeout=1.0, name="silent")
        r.expect(1)
        start = time.monotonic()
        try:
            r.recv(0)
            out["timeout"] = None
        except P2PTimeoutError:
            out["timeout"] = time.monotonic() - start
        with open(done, "w"):
            pass
    return out


@pytest.mark.parametrize("ordered", [False, True], ids=["tagged", "ordered"])
def test_p2p_two_processes(ordered: bool) -> None:
    start = time.monotonic()
    r0, r1 = spawn(_scenarios, ordered, world=2, start_method="forkserver")
    assert time.monotonic() - start < 240  # never a hang (loose: 2 cores shared with other jobs)
    assert r1["ok"] == [True] * len(SHAPES)
    sent, got = r0["send"], r1["recv"]
    # metadata only when it changed: messages 0, 4, 5, 6, 7, 9, 10, 12
    assert sent.metadata_messages == got.metadata_messages == 8
    assert sent.messages == got.messages == len(SHAPES)
    # after an unchanged message the next payload is posted ahead: 2, 3 (hits), 4, 9, 12 (changed: filled)
    assert got.speculative_hits == 2
    # the fillers: (2, 3) float32 before message 4, (2, 4) bfloat16 before 9, 30 x (1, 2, 3) float32 before 12
    assert sent.wasted_bytes == 2 * 3 * 4 + 2 * 4 * 2 + 30 * 6 * 4
    payload = sum(
        int(torch.Size(sh).numel()) * torch.tensor([], dtype=dt).element_size()
        for spec in SHAPES
        for sh, dt in spec
    )
    assert sent.payload_bytes == got.payload_bytes == payload
    reason, waited = r1["abort"]
    assert "ValueError: boom" in reason and waited < 10
    assert 0.9 <= r1["timeout"] < 10


def test_meta_roundtrip() -> None:
    metas = (
        TensorMeta(torch.float32, (2, 3), True),
        TensorMeta(torch.int64, (), False),
        TensorMeta(torch.bool, (0, 5), False),
    )
    assert decode_meta(encode_meta(metas)) == metas


class _Work:
    """A stand-in for an NCCL work: completes after ``polls`` calls of ``is_completed`` (never if None)."""

    def __init__(self, polls: int | None, fail: bool = False) -> None:
        self.polls, self.fail, self.calls, self.waited = polls, fail, 0, False

    def is_completed(self) -> bool:
        self.calls += 1
        return self.polls is not None and self.calls > self.polls

    def wait(self) -> None:
        if self.fail:
            raise RuntimeError("NCCL communicator was aborted")
        self.waited = True


def test_polled_wait_enforces_the_timeout() -> None:
    """NCCL's waits poll is_completed up to p2p_timeout (a CUDA wait alone would not bound the time), then
    make the stream wait; a failed transfer is a PipelineAbortedError."""
    t = Transport(forward=None, backward=None, device=torch.device("cpu"), tagged=False, poll=True)
    done = _Work(polls=5)
    t.wait(done, 5.0, "x")
    assert done.waited and done.calls == 6
    start = time.monotonic()
    with pytest.raises(P2PTimeoutError):
        t.wait(_Work(polls=None), 0.3, "x")
    assert 0.3 <= time.monotonic() - start < 3
    with pytest.raises(PipelineAbortedError):
        t.wait(_Work(polls=0, fail=True), 5.0, "x")


class _Loopback:
    """An in-process, order-matched transport (NCCL's rule: the k-th receive posted gets the k-th send, no
    tags), recording how many receives are posted at any moment."""

    device = torch.device("cpu")

    def __init__(self, post_ahead: bool) -> None:
        self.post_ahead = post_ahead
        self.sent: list[torch.Tensor] = []
        self.sends = 0
        self.posted: list[list[Any]] = []  # [buffer, matched]

    def isend(self, t: torch.Tensor, peer: int, tag: int, direction: str) -> Any:
        self.sent.append(t.clone())
        self.sends += 1
        return _Work(polls=0)

    def irecv(self, t: torch.Tensor, peer: int, tag: int, direction: str) -> Any:
        entry = [t, False]
        self.posted.append(entry)
        lb = self

        class _Recv:
            def wait(self) -> None:
                upto = next(i for i, e in enumerate(lb.posted) if e is entry)
                for e in lb.posted[: upto + 1]:
                    if not e[1]:
                        src = lb.sent.pop(0)  # the oldest send matches the oldest receive
                        assert src.dtype == e[0].dtype and src.shape == e[0].shape, (src.shape, e[0].shape)
                        e[0].copy_(src)
                        e[1] = True

        return _Recv()

    def wait(self, work: Any, timeout: float, what: str) -> None:
        work.wait()

    @property
    def pending(self) -> int:
        return sum(not e[1] for e in self.posted)


@pytest.mark.parametrize("post_ahead", [True, False], ids=["ahead", "just-in-time"])
def test_receives_posted_just_in_time_without_post_ahead(post_ahead: bool) -> None:
    """NCCL (``post_ahead=False``): no receive is pending between messages (a posted NCCL receive spins on
    the GPU, and lazy kernel loading's device synchronization would wait for it: the 2x H200 deadlock). The
    same receives, in the same order, carry every shape change and filler."""
    lb = _Loopback(post_ahead)
    s = Sender(peer=1, tag=0, transport=lb, timeout=5, name="s")  # type: ignore[arg-type]
    r = Receiver(peer=0, tag=0, transport=lb, timeout=5, name="r")  # type: ignore[arg-type]
    r.expect(len(SHAPES))
    pending_between = [lb.pending]
    for k, spec in enumerate(SHAPES):
        s.send(tuple(_tensor(k, j, sh, dt) for j, (sh, dt) in enumerate(spec)), micro_batch=k, ack=0)
        got = r.recv(k).tensors
        want = [_tensor(k, j, sh, dt) for j, (sh, dt) in enumerate(spec)]
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))
        pending_between.append(lb.pending)
    assert not lb.sent  # every send was received (fillers included)
    if (
        post_ahead
    ):  # one receive waits posted: the next header (fused with the payload after an unchanged one)
        assert pending_between == [1] * len(SHAPES) + [0]
    else:
        assert pending_between == [0] * (len(SHAPES) + 1)
    # a message after an unchanged one is one send (header and payload fused; after a change, the header
    # carries the fillers); 148 sends without fusing (a header, fillers, metadata and each tensor apart)
    assert lb.sends == 114
    assert (
        r.statistics().speculative_hits == 2
        and s.statistics().wasted_bytes == 2 * 3 * 4 + 2 * 4 * 2 + 30 * 6 * 4
    )
