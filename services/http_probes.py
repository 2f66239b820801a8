"""/metrics, /healthz and /readyz over HTTP on every process, for Prometheus and Kubernetes.

A tiny HTTP/1.1 server on the role's own event loop (asyncio streams, one
request per connection): so /healthz answers only while the loop does (a
wedged loop fails the liveness probe), and the scrape-time collectors read the
role's state on the loop that changes it, without locks.

- GET /metrics: the default prometheus-client registry, text format 0.0.4.
- GET /healthz: 200 "ok" while the process runs its loop.
- GET /readyz: the role's readiness as JSON, `{"ready": bool, ...}` plus
  what the role checks (the gateway: group formed, experts loaded, KV
  utilization); 200 if ready, else 503. Until the role sets its readiness
  function: 503 `{"ready": false, "reason": "starting"}`.

`start_probes(role, config)` binds `config.metrics_host or config.host` on
`config.metrics_port` (0 picks a free port) and, if the config has a
port_file, writes the bound port to `<port_file>.metrics`, so launchers and
tests started with `--metrics-port 0` find it.
"""

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from services import metrics, process, settings

log = logging.getLogger(__name__)

# Returns {"ready": bool, ...}; may be async.
Readiness = Callable[[], "dict | Awaitable[dict]"]
_READ_TIMEOUT_S = 5.0
_READINESS_TIMEOUT_S = 2.0
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable",
            400: "Bad Request", 500: "Internal Server Error"}


class ProbeServer:
    """The HTTP server of one process (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self._registry = registry
        self._readiness: Readiness | None = None
        self._server: asyncio.Server | None = None
        self._collectors: list = []
        self.port = 0

    def set_readiness(self, readiness: Readiness) -> None:
        """Sets the function /readyz reports."""
        self._readiness = readiness

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 picks a free port); returns the bound port."""
        try:
            self._server = await asyncio.start_server(self._handle, host, port)
        except OSError as error:
            raise ValueError(f"cannot bind the metrics server to {host}:{port}: {error}") from error
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def add_collector(self, collector) -> None:
        """Registers a scrape-time collector until close()."""
        self._registry.register(collector)
        self._collectors.append(collector)

    async def close(self) -> None:
        """Stops serving and unregisters the collectors added."""
        for collector in self._collectors:
            self._registry.unregister(collector)
        self._collectors.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def readiness(self) -> dict:
        """The current readiness report (never raises)."""
        if self._readiness is None:
            return {"ready": False, "reason": "starting"}
        try:
            async with asyncio.timeout(_READINESS_TIMEOUT_S):
                report = self._readiness()
                if inspect.isawaitable(report):
                    report = await report
        except Exception as error:  # noqa: BLE001 - a probe reports, it never crashes the role
            log.warning("readiness check failed: %r", error)
            return {"ready": False, "reason": f"readiness check failed: {error!r}"}
        return dict(report)

    async def metrics(self) -> bytes:
        """The /metrics body: the registry's exposition (the relay of `moemesh up` overrides it)."""
        return generate_latest(self._registry)

    async def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, await self.metrics()
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if path == "/readyz":
            report = await self.readiness()
            body = (json.dumps(report, sort_keys=True) + "\n").encode()
            return (200 if report.get("ready") else 503), "application/json", body
        return 404, "text/plain; charset=utf-8", b"try /metrics, /healthz or /readyz\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # headers: nothing here depends on them
            parts = request_line.decode("latin-1").split()
            if len(parts) != 3:
                status, content_type, body, method = 400, "text/plain; charset=utf-8", b"bad request\n", "GET"
            else:
                method = parts[0]
                status, content_type, body = await self._route(method, parts[1].split("?", 1)[0])
            head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):
            pass  # a client that went away or sent garbage: nothing to answer
        finally:
            writer.close()


async def start_probes(role: str, config: settings.MemberConfig,
                       readiness: Readiness | None = None) -> ProbeServer:
    """Starts the process's HTTP server and announces its port (see the module docstring)."""
    server = ProbeServer()
    if readiness is not None:
        server.set_readiness(readiness)
    host = config.metrics_host or config.host
    port = await server.start(host, config.metrics_port)
    metrics.common_metrics().set_info(role, config.member_id)
    if config.port_file:
        process.write_port_file(process.metrics_port_file(config.port_file), port)
    logging.getLogger(role).info("metrics and probes on http://%s:%d (/metrics /healthz /readyz)", host, port)
    return server
