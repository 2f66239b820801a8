"""Serving the OpenAI-compatible endpoint with uvicorn in the gateway's own event loop.

The gateway's lifecycle (gateway/server.py) starts it next to the gRPC server
and stops it after the drain. uvicorn's own signal handling is left out: the
gateway's SIGTERM/SIGINT handlers run the drain, which the HTTP streams in
flight take part in like gRPC ones (they are served by the same engine).
"""

import asyncio
import contextlib
import logging

import uvicorn

log = logging.getLogger("gateway.http")


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """A running uvicorn server; `port` is the one it bound."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task) -> None:
        self._server = server
        self._task = task

    @classmethod
    async def start(cls, app, host: str, port: int, *, shutdown_grace_s: float = 1.0) -> "HttpServer":
        """Binds host:port (0: a free port) and serves app until stop()."""
        config = uvicorn.Config(app, host=host.strip("[]"), port=port, log_config=None, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=shutdown_grace_s)
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(), name="http-server")
        while not server.started:
            if task.done():
                task.result()  # the bind failed: raises (uvicorn exits with SystemExit)
                raise RuntimeError(f"the HTTP server on {host}:{port} stopped while starting")
            await asyncio.sleep(0.01)
        return cls(server, task)

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stops accepting, lets responses in flight end (up to the grace), and closes."""
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
