"""Each trainer rank's HTTP `GET /health`, for probes that must reach every rank.

Under torchrun only rank 0 serves gRPC, so the gRPC health service cannot tell whether the
other ranks (in Kubernetes, the other pods) are there. Every rank therefore answers a small
HTTP endpoint of its own (plain HTTP because Kubernetes probes it with `httpGet`, which needs
no client in the image and no token, like the gRPC health service):

- 200 once this rank has joined the trainer's process group (and, on rank 0, once its gRPC
  server serves); a one-process trainer has joined at once;
- 503 while it is joining, after rank 0 stopped serving (graceful shutdown), or once the
  group has failed (a peer gone: every later command would fail; the pod should restart).

It runs on a thread of its own, so it answers while the rank waits in a collective or in
torch's process-group set-up. It says the process lives and has joined; it cannot tell a
rank that is stuck inside a collective from one that is working. Connections are served
one at a time with a short socket timeout, so a probe cannot hold resources for long."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

log = logging.getLogger(__name__)

# Seconds a connection may take to send its request (probes send one line at once).
SOCKET_TIMEOUT = 5.0


class RankHealth:
    """What this rank reports: set by the trainer's serve() as it joins and serves."""

    def __init__(
        self, rank: int, world_size: int, local_rank: int = 0, group_failure: Callable[[], str] = lambda: ""
    ) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self._group_failure = group_failure  # (ranks.group_failure: the command group's transport failed)
        self._lock = threading.Lock()
        self._joined = False
        self._serving = False

    def joined(self) -> None:
        with self._lock:
            self._joined = True

    def serving(self, serving: bool) -> None:
        with self._lock:
            self._serving = serving

    def report(self) -> tuple[int, dict]:
        """(HTTP status, body)."""
        with self._lock:
            joined, serving = self._joined, self._serving
        failure = self._group_failure()
        body = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "joined": joined,
            "serving": serving,
        }
        if failure:
            body["failure"] = failure[:500]
        # Only rank 0 serves gRPC; the others are healthy once they have joined.
        healthy = joined and not failure and (serving or self.rank != 0)
        return (200 if healthy else 503), body


def _handler(health: RankHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/health":
                self._answer(404, {"error": f"no such path {self.path[:100]!r}: this port answers GET /health"})
                return
            self._answer(*health.report())

        do_HEAD = do_GET

        def _refuse(self) -> None:
            self._answer(405, {"error": f"{self.command} is not allowed: this port answers GET /health"})

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        def log_message(self, format, *args) -> None:
            pass  # (probed every few seconds: no log line each time)

    return Handler


class HealthServer:
    """The endpoint on its own thread; close() stops it."""

    def __init__(self, health: RankHealth, host: str, port: int) -> None:
        self.health = health
        self._server = HTTPServer((host, port), _handler(health))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="rank-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start(host: str, base_port: int, rank: int, world_size: int, group_failure: Callable[[], str]) -> HealthServer:
    """This rank's endpoint on base_port + LOCAL_RANK (each process of a node its own port;
    probes of a pod ask local rank 0, whose torchrun ends the pod's other ranks with it)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    server = HealthServer(RankHealth(rank, world_size, local_rank, group_failure), host, base_port + local_rank)
    log.info("rank %d answers GET /health on %s:%d", rank, host, server.port)
    return server
