"""The ``/metrics`` HTTP exporter: a threaded server with a deep listen backlog, one port per
local rank."""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["DEFAULT_PORT", "LISTEN_BACKLOG", "MetricsServer", "default_port", "start"]

DEFAULT_PORT = 10464
"""Base port of the exporter. Not 9400 (NVIDIA's DCGM exporter) nor anything in Prometheus's
registry of exporter ports (9100-9999, fully allocated; 9464 is OpenTelemetry's), nor in
/etc/services, and below Linux's ephemeral range (32768+). ``DSIO_METRICS_PORT`` overrides it."""
LISTEN_BACKLOG = 1024
"""Connections the exporter's socket queues (the standard library's default is 5, which drops
scrapes when many arrive at once: several Prometheus servers, a burst of dashboards)."""


def default_port(base: int | None = None) -> int:
    """The port ``dsio.metrics.serve`` uses by default: ``base`` (``DSIO_METRICS_PORT``, else
    :data:`DEFAULT_PORT`) plus ``LOCAL_RANK`` when a launcher (torchrun) sets it, so every local
    rank of a node serves its own port: rank 0 on 10464, rank 1 on 10465, ..."""
    if base is None:
        env = os.environ.get("DSIO_METRICS_PORT", "").strip()
        if env:
            try:
                base = int(env)
            except ValueError:
                from .errors import ConfigError

                raise ConfigError(f"DSIO_METRICS_PORT must be a port number, got {env!r}") from None
        else:
            base = DEFAULT_PORT
    local = os.environ.get("LOCAL_RANK", "").strip()
    port = base + (int(local) if local.isdigit() else 0)
    if not 0 < port < 65536:
        from .errors import ConfigError

        raise ConfigError(f"metrics port {port} (base {base} + LOCAL_RANK) is out of range")
    return port


def _server_class() -> type:
    from http.server import ThreadingHTTPServer

    class _Server(ThreadingHTTPServer):
        daemon_threads = True  # a slow scraper never holds the process at exit
        request_queue_size = LISTEN_BACKLOG

    return _Server


class MetricsServer:
    """A running exporter: ``url``, ``port``; ``close()`` stops it (also a context manager).

    It serves from one daemon thread (plus one per request), so a server left open never keeps
    the process alive at exit."""

    def __init__(self, httpd: Any, thread: threading.Thread, addr: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.addr = addr
        self.port: int = int(httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    @property
    def backlog(self) -> int:
        """The listen backlog the socket was opened with."""
        return int(self._httpd.request_queue_size)

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(registry: Any, port: int | None = None, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``/metrics`` on ``addr:port`` from a daemon thread (``port=None``:
    :func:`default_port`; ``0``: a free port), with a listen backlog of :data:`LISTEN_BACKLOG`.
    The public face is ``dsio.metrics.serve``, which builds the registry."""
    from prometheus_client.exposition import MetricsHandler

    server_cls = _server_class()
    if ":" in addr:
        import socket

        server_cls = type("_Server6", (server_cls,), {"address_family": socket.AF_INET6})
    httpd = server_cls((addr, default_port() if port is None else port), MetricsHandler.factory(registry))
    thread = threading.Thread(target=httpd.serve_forever, name="dsio-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, addr)
