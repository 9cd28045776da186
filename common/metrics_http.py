"""Serve a Prometheus registry on ``/metrics`` (plain HTTP, meant for an internal
network or a loopback scrape; the port is separate from the mTLS gRPC port)."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from common.config import parse_host_port
from common.errors import ConfigError


def serve_metrics(listen: str, registry: CollectorRegistry) -> tuple[WSGIServer, int]:
    """Start the exporter in a daemon thread; returns (server, bound port)."""
    host, port = parse_host_port(listen)
    try:
        server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    except OSError as exc:
        raise ConfigError(
            "metrics_listen", f"cannot serve /metrics on {listen}: {exc.strerror or exc}"
        ) from None
    if not isinstance(thread, threading.Thread):
        raise RuntimeError("prometheus exporter did not start")
    return server, int(server.server_port)
