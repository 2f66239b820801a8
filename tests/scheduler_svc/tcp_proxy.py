"""A loopback TCP proxy that can partition its clients from the target.

`cut()` is a network partition, not a crash: connections stay open and
everything sent either way is dropped, so calls run into their deadlines.
`heal()` closes the connections that were open (their streams lost bytes)
and forwards again; clients reconnect.
"""

import asyncio
import contextlib


class TcpProxy:
    """Forwards 127.0.0.1:<port> to target (host:port) until closed."""

    def __init__(self, target: str):
        self._host, _, port = target.rpartition(":")
        self._port = int(port)
        self._server: asyncio.Server | None = None
        self._connections: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._pumps: set[asyncio.Task] = set()
        self.is_cut = False

    async def start(self) -> str:
        """Listens on a free port; returns the endpoint to give clients."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        self.is_cut = True

    def heal(self) -> None:
        self.is_cut = False
        self._drop_connections()

    async def close(self) -> None:
        self._server.close()
        self._drop_connections()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    def _drop_connections(self) -> None:
        for client, upstream in self._connections:
            client.close()
            upstream.close()
        self._connections.clear()

    async def _accept(self, client_reader, client_writer) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self._host, self._port)
        except OSError:
            client_writer.close()
            return
        pair = (client_writer, upstream_writer)
        self._connections.add(pair)
        for reader, writer in ((client_reader, upstream_writer), (upstream_reader, client_writer)):
            task = asyncio.create_task(self._pump(reader, writer))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if not self.is_cut:
                    writer.write(data)
                    await writer.drain()
        writer.close()
