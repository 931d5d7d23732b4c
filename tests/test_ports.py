"""tests/_ports.py: the rendezvous port of a test launch is one that a concurrent launch does not pick
(two pytest-xdist workers never; an outgoing connection never: it is below the ephemeral range)."""

from __future__ import annotations

import socket

import _ports
import pytest


def _picks(monkeypatch: pytest.MonkeyPatch, worker: str, count: int, n: int = 300) -> set[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    return {_ports.free_port() for _ in range(n)}


def test_two_workers_of_one_session_never_pick_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    gw0, gw1 = _picks(monkeypatch, "gw0", 2), _picks(monkeypatch, "gw1", 2)
    assert len(gw0) > 1 and len(gw1) > 1  # random within each worker's ports, not one fixed port
    assert gw0.isdisjoint(gw1)


def test_the_port_is_below_the_ephemeral_range_and_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    low = _ports._ephemeral_low()
    port = _ports.free_port()
    if low - 10_000 >= 64:
        assert 10_000 <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens on it


def test_a_listening_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """With all but one of this worker's ports listened on, the port handed out is not one of them (the
    free one, or the kernel's when the random tries miss it)."""
    monkeypatch.setattr(_ports, "_ephemeral_low", lambda: 20_064)  # ports 10000..20063
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "157")  # 64 ports of class 0: 10000, 10157, ...
    listeners = []
    try:
        for port in range(10_000, 20_064, 157)[1:]:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # someone on the machine holds it: it is taken either way
                s.close()
                continue
            s.listen()
            listeners.append(s)
        picked = _ports.free_port()
        assert picked not in {s.getsockname()[1] for s in listeners}
        with socket.socket() as s:
            s.bind(("127.0.0.1", picked))
    finally:
        for s in listeners:
            s.close()


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ports, "_ephemeral_low", lambda: 1024)  # ip_local_port_range starting at 1024
    port = _ports.free_port()
    assert port > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
