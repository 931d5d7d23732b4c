"""Point-to-point messages between pipeline neighbours: receives posted ahead, metadata when it changes.

One `Sender` / `Receiver` pair per direction and kind (activations to the next stage, gradients to the
previous one). Contract: every receive posted is matched by the next send in order with the same byte count
(no tags: the same code on gloo and NCCL); every wait has a timeout (`P2PTimeoutError`); a failing rank's
ABORT reaches its neighbours as `PipelineAbortedError`, and no send is waited on during a batch unless its
peer acknowledged it. The wire format and the protocol, in full: docs/pipe.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.pipe.errors import PipelineAbortedError, PipelineError, ShapeMismatchError
from dstrain.pipe.transport import FORWARD, Transport

__all__ = ["P2PStatistics", "Receiver", "Received", "Sender", "TensorMeta"]

_MAGIC = 0x50495045  # "PIPE"
_DATA, _ABORT = 1, 2
_FIXED = 8  # header words before the inline metadata
_HEADER_WORDS = 128
_INLINE = _HEADER_WORDS - _FIXED
_HEADER_BYTES = _HEADER_WORDS * 8
_ALIGN = 64  # byte alignment of each tensor inside a fused message (any dtype can view it)
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a receiver must know to post a tensor's receive."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send a {t.dtype} tensor between pipeline stages")
        return TensorMeta(t.dtype, tuple(t.shape), bool(t.requires_grad))


def fused_layout(metas: tuple[TensorMeta, ...]) -> tuple[list[tuple[int, int]], int]:
    """Where each tensor lies in a fused message (header first): ``[(byte offset, bytes)]`` and the total."""
    spans, pos = [], _HEADER_BYTES
    for m in metas:
        n = math.prod(m.shape) * torch.empty((), dtype=m.dtype).element_size()
        spans.append((pos, n))
        pos += -(-n // _ALIGN) * _ALIGN
    return spans, pos


def encode_meta(metas: tuple[TensorMeta, ...]) -> list[int]:
    """``[n, (dtype code, requires_grad, ndim, *shape) per tensor]``."""
    words = [len(metas)]
    for m in metas:
        words += [_CODE[m.dtype], int(m.requires_grad), len(m.shape), *m.shape]
    return words


def decode_meta(words: list[int]) -> tuple[TensorMeta, ...]:
    """Inverse of `encode_meta`."""
    n, pos, out = words[0], 1, []
    for _ in range(n):
        code, rg, ndim = words[pos : pos + 3]
        shape = tuple(words[pos + 3 : pos + 3 + ndim])
        out.append(TensorMeta(_DTYPES[code], shape, bool(rg)))
        pos += 3 + ndim
    if pos != len(words):
        raise PipelineError(f"corrupt pipeline metadata: {len(words)} words, {pos} used")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class P2PStatistics:
    """Counters of one direction of one channel."""

    messages: int
    payload_bytes: int
    """Bytes of tensors (excluding headers and metadata)."""
    metadata_messages: int
    """Messages whose metadata changed and was sent."""
    speculative_hits: int
    """Messages whose payload arrived fused with their header, in the shapes posted ahead (receiver side)."""
    wasted_bytes: int
    """Zeros sent in a fused message's payload place after a shape change (or with an ABORT)."""
    wait_seconds: float
    """Time blocked waiting (receiver: for messages; sender: for acknowledged or final sends)."""


class _Channel:
    def __init__(
        self,
        *,
        peer: int,
        tag: int,
        group: Any = None,
        timeout: float,
        name: str,
        transport: Transport | None = None,
        direction: str = FORWARD,
    ) -> None:
        self.peer = peer
        self.tag = tag
        self.transport = transport if transport is not None else Transport.gloo(group)
        self.direction = direction
        self.timeout = timeout
        self.name = name
        self._last: tuple[TensorMeta, ...] | None = None
        self._stable = False  # the previous message kept its metadata: the next payload is posted ahead
        self._seq = 0
        self._stats = {"messages": 0, "payload_bytes": 0, "metadata_messages": 0, "speculative_hits": 0}
        self._stats.update(wasted_bytes=0)
        self._wait_seconds = 0.0
        self.device = torch.device("cpu")
        """Where received tensors are delivered (the wire is the transport's: host memory on gloo)."""

    @property
    def _wire(self) -> torch.device:
        return self.transport.device

    def _isend(self, t: torch.Tensor, offset: int) -> Any:
        return self.transport.isend(t, self.peer, self.tag + offset, self.direction)

    def _irecv(self, t: torch.Tensor, offset: int) -> Any:
        return self.transport.irecv(t, self.peer, self.tag + offset, self.direction)

    def statistics(self) -> P2PStatistics:
        return P2PStatistics(**self._stats, wait_seconds=self._wait_seconds)


def _header(kind: int, micro_batch: int, n_meta: int, ack: int, fingerprint: int, seq: int) -> list[int]:
    return [_MAGIC, kind, micro_batch, n_meta, ack, fingerprint, seq, 0]


class Sender(_Channel):
    """Sends messages to ``peer`` (a global rank); posts, never blocks until `release`/`drain`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pending: list[tuple[int, list[Any], list[torch.Tensor]]] = []
        self.aborted = False

    @staticmethod
    def _header_words(words: list[int], inline: list[int]) -> torch.Tensor:
        header = torch.zeros(_HEADER_WORDS, dtype=torch.int64)
        header[: len(words)] = torch.tensor(words, dtype=torch.int64)
        if inline:
            header[_FIXED : _FIXED + len(inline)] = torch.tensor(inline, dtype=torch.int64)
        return header

    @property
    def _fused(self) -> bool:
        """The receiver posted one fused receive (header + the last shapes' payload): our last message kept
        its metadata. Both ends apply this rule."""
        return self._stable and self._last is not None

    def _post_head(
        self,
        words: list[int],
        inline: list[int],
        payload: list[torch.Tensor] | None,
        keep: list[Any],
        works: list[Any],
    ) -> None:
        """Post the header. Fused (see `_fused`): one message of the header and, in the last shapes' places,
        ``payload`` (unchanged metadata) or zeros (changed metadata, or an ABORT: fillers of the receive
        posted ahead). Otherwise the header alone."""
        header = self._header_words(words, inline)
        if not self._fused:
            header = header.view(torch.uint8).to(self._wire)  # bytes, as the receiver posts them
            keep.append(header)
            works.append(self._isend(header, 0))
            return
        assert self._last is not None
        spans, total = fused_layout(self._last)
        buf = torch.zeros(total, dtype=torch.uint8, device=self._wire)
        buf[:_HEADER_BYTES].view(torch.int64).copy_(header)
        if payload is not None:
            for t, (off, n) in zip(payload, spans, strict=True):
                buf[off : off + n].view(t.dtype).copy_(t.reshape(-1))
                self._stats["payload_bytes"] += n
        else:
            self._stats["wasted_bytes"] += sum(n for _, n in spans)
        keep.append(buf)
        works.append(self._isend(buf, 0))

    def send(
        self, tensors: tuple[torch.Tensor, ...], *, micro_batch: int, ack: int, fingerprint: int = -1
    ) -> None:
        """Post message ``micro_batch`` (the tensors are detached, made contiguous and kept until released)."""
        metas = tuple(TensorMeta.of(t) for t in tensors)
        changed = metas != self._last
        meta_words = encode_meta(metas) if changed else []
        inline = meta_words if len(meta_words) <= _INLINE else []
        keep: list[Any] = []
        works: list[Any] = []
        words = _header(_DATA, micro_batch, len(meta_words), ack, fingerprint, self._seq)
        fused = self._fused and not changed
        self._post_head(words, inline, [t.detach() for t in tensors] if fused else None, keep, works)
        if changed:
            self._stats["metadata_messages"] += 1
            if not inline:
                meta = torch.tensor(meta_words, dtype=torch.int64, device=self._wire)
                keep.append(meta)
                works.append(self._isend(meta, 1))
        if not fused:
            for t in tensors:
                t = t.detach().to(self._wire).contiguous()
                keep.append(t)
                works.append(self._isend(t, 2))
                self._stats["payload_bytes"] += t.numel() * t.element_size()
        self._pending.append((self._seq, works, keep))
        self._stats["messages"] += 1
        self._stable = not changed
        self._last = metas
        self._seq += 1

    def release(self, acked: int) -> None:
        """Wait on (already complete) sends the peer acknowledged: sequence numbers below ``acked``."""
        start = time.perf_counter()
        while self._pending and self._pending[0][0] < acked:
            _, works, _ = self._pending.pop(0)
            for w in works:
                self.transport.wait(w, self.timeout, f"{self.name}: acknowledged send to rank {self.peer}")
        self._wait_seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Wait on every pending send (call only once every receiver is known to have posted its receives)."""
        self.release(self._seq)

    @property
    def pending(self) -> int:
        """Messages posted and not yet waited on."""
        return len(self._pending)

    def abort(self, reason: str) -> None:
        """Post an ABORT carrying ``reason`` (its first 960 bytes) in place of the next message, and the
        fillers of any receive posted ahead (once; never waited on)."""
        if self.aborted:
            return
        self.aborted = True
        text = reason.encode()[: _INLINE * 8]
        padded = text + b"\0" * (-len(text) % 8)
        inline = torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist() if padded else []
        keep: list[Any] = []
        works: list[Any] = []
        self._post_head(_header(_ABORT, -1, len(text), 0, -1, self._seq), inline, None, keep, works)
        self._pending.append((self._seq, works, keep))  # kept alive; never waited on
        self._seq += 1

    def forget(self) -> None:
        """Drop pending sends without waiting (the batch failed; the channel is no longer used)."""
        self._pending.clear()


@dataclass(frozen=True, slots=True)
class Received:
    """One message: its tensors (receive buffers, ``requires_grad`` as sent) and header fields."""

    tensors: tuple[torch.Tensor, ...]
    micro_batch: int
    ack: int
    fingerprint: int


class Receiver(_Channel):
    """Receives the messages of ``peer``; call `expect` with the number of messages of the batch first."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._remaining = 0
        self._header: tuple[torch.Tensor, Any] | None = None
        self._spans: list[tuple[int, int]] | None = None
        """Set when the posted header receive is fused with the last shapes' payload (see `Sender`)."""
        self.received = 0
        """Messages fully received so far (what this side acknowledges to the peer)."""

    def _post_ahead(self) -> None:
        self._spans = None
        if self._stable and self._last is not None:  # one receive: header + payload in the last shapes
            self._spans, total = fused_layout(self._last)
            buf = torch.empty(total, dtype=torch.uint8, device=self._wire)
        else:
            buf = torch.empty(_HEADER_BYTES, dtype=torch.uint8, device=self._wire)
        self._header = (buf, self._irecv(buf, 0))

    def expect(self, messages: int) -> None:
        """Post the receives of the first of ``messages`` messages that make up the coming batch."""
        if self._header is not None:
            raise PipelineError(f"{self.name}: receives are still posted from the previous batch")
        self._remaining = messages
        if messages and self.transport.post_ahead:
            self._post_ahead()

    def _wait(self, work: Any, what: str) -> None:
        start = time.perf_counter()
        try:
            self.transport.wait(work, self.timeout, f"{self.name}: {what} from rank {self.peer}")
        finally:
            self._wait_seconds += time.perf_counter() - start

    def recv(self, micro_batch: int) -> Received:
        """Wait for message ``micro_batch`` (it must be the next one); raises if the peer aborted."""
        if self._header is None and self._remaining > 0 and not self.transport.post_ahead:
            self._post_ahead()  # just in time: the same receives a post-ahead transport posted earlier
        if self._header is None:
            raise PipelineError(f"{self.name}: recv of micro-batch {micro_batch} with nothing posted")
        buf, work = self._header
        spans, self._spans = self._spans, None
        self._header = None
        self._wait(work, f"header of micro-batch {micro_batch}")
        header = buf[:_HEADER_BYTES].view(torch.int64).tolist()  # (128,) on the host
        magic, kind, mb, n_meta, ack, fingerprint, _, _ = header[:_FIXED]
        if magic != _MAGIC:
            raise PipelineError(f"{self.name}: corrupt header from rank {self.peer}: {header[:_FIXED]}")
        if kind == _ABORT:  # a fused receive got zeros in the payload's place: nothing else is posted
            inline = torch.tensor(header[_FIXED:], dtype=torch.int64).numpy().tobytes()
            raise PipelineAbortedError(inline[:n_meta].decode(errors="replace"))
        if mb != micro_batch:
            raise PipelineError(
                f"{self.name}: expected micro-batch {micro_batch} from rank {self.peer}, got {mb} (schedules differ)"
            )
        if n_meta:  # a fused receive held zeros in the payload's place (fillers): discarded
            spans = None
            if n_meta <= _INLINE:
                words = header[_FIXED : _FIXED + n_meta]
            else:
                buf = torch.empty(n_meta, dtype=torch.int64, device=self._wire)
                self._wait(self._irecv(buf, 1), "metadata")
                words = buf.tolist()
            metas = decode_meta(words)
            self._stats["metadata_messages"] += 1
        else:
            if self._last is None:
                raise PipelineError(f"{self.name}: first message from rank {self.peer} carried no metadata")
            metas = self._last
        if spans is not None:  # the payload came with the header, in the shapes posted ahead
            self._stats["speculative_hits"] += 1
            parts = [
                buf[off : off + n].view(m.dtype).view(m.shape)
                for (off, n), m in zip(spans, metas, strict=True)
            ]
        else:
            posted = [
                (b, self._irecv(b, 2))
                for b in (torch.empty(m.shape, dtype=m.dtype, device=self._wire) for m in metas)
            ]
            for _, w in posted:
                self._wait(w, f"payload of micro-batch {micro_batch}")
            parts = [b for b, _ in posted]
        tensors = []
        for part, m in zip(parts, metas, strict=True):
            self._stats["payload_bytes"] += part.numel() * part.element_size()
            part = part.to(self.device)
            if m.requires_grad:
                part.requires_grad_()
            tensors.append(part)
        self._stats["messages"] += 1
        self._stable = not n_meta
        self._last = metas
        self.received += 1
        self._remaining -= 1
        if self._remaining > 0 and self.transport.post_ahead:
            self._post_ahead()
        return Received(tuple(tensors), mb, ack, fingerprint)

    def forget(self) -> None:
        """Drop posted receives (the batch failed; the channel is no longer used)."""
        self._header = None
        self._spans = None
        self._remaining = 0


def check_grads(
    sent: tuple[TensorMeta, ...], grads: tuple[torch.Tensor, ...], micro_batch: int, peer: int
) -> None:
    """Gradients from the next stage must match the activations that required them, in dtype and shape."""
    want = [(m.dtype, m.shape) for m in sent if m.requires_grad]
    got = [(g.dtype, tuple(g.shape)) for g in grads]
    if want != got:
        raise ShapeMismatchError(
            f"micro-batch {micro_batch}: rank {peer} returned gradients {got} for activations {want}"
        )
