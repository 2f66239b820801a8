"""Process start-up: what every role's main.py does the same way.

Logging and tracing (`configure_telemetry`), stop signals, running the
role's `serve` coroutine (`run_role`), and announcing the bound port: a
process started with `--port 0 --port-file PATH` writes the port it bound to
PATH, the port of its metrics server to PATH.metrics (the gateway: that of
its HTTP endpoint to PATH.http), so a launcher can find servers started on
port 0. The flags themselves come from services/settings.py.
"""

import asyncio
import contextlib
import logging
import os
import pathlib
import signal
import sys
import typing
from collections.abc import Sequence

from services import gc_pauses, logging_json, telemetry, tls
from services.cluster.connection import ClusterUnavailableError
from services.settings import MemberConfig, parse_config

T = typing.TypeVar("T")


def write_port_file(path: str | os.PathLike, port: int) -> None:
    """Writes the bound port (decimal and a newline) to path, atomically.

    A launcher that starts a server with `--port 0 --port-file PATH` waits
    until PATH exists and reads the port from it: the rename makes a
    half-written file impossible.
    """
    target = pathlib.Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)


def metrics_port_file(port_file: str | os.PathLike) -> str:
    """Where a process started with --port-file PATH writes its metrics port: PATH.metrics."""
    return f"{port_file}.metrics"


def http_port_file(port_file: str | os.PathLike) -> str:
    """Where the gateway started with --port-file PATH writes its HTTP endpoint's port: PATH.http."""
    return f"{port_file}.http"


def read_port_file(path: str | os.PathLike) -> int | None:
    """The port in a file written by write_port_file, None if not there yet."""
    try:
        return int(pathlib.Path(path).read_text().strip())
    except FileNotFoundError:
        return None


def run_role(role: str, cls: type[T], serve, argv: Sequence[str] | None = None, *,
             prog: str | None = None) -> None:
    """What a role's main() does: parse cls from argv and env, set up logging
    (lines tagged with role) and tracing (from the OTEL_* environment), then
    run `await serve(config, stop)` until it returns, stop being set on
    SIGTERM or SIGINT; the spans still buffered are exported at the end.
    An unreachable etcd at start ends the process with status 1 and one line
    naming the endpoints (exit_unreachable)."""
    config = parse_config(cls, argv, prog=prog)
    configure_telemetry(role, config)
    configure_tls(role, config)

    async def main() -> None:
        await serve(config, stop_on_signals())

    try:
        with exit_unreachable(role):
            asyncio.run(main())
    finally:
        telemetry.shutdown_tracing()


@contextlib.contextmanager
def exit_unreachable(role: str):
    """Turns etcd (or a peer) unreachable at start into a logged error and exit status 1, not a traceback."""
    try:
        yield
    except ClusterUnavailableError as error:
        logging.getLogger(role).error("%s", error)
        print(f"{role}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def configure_logging(role: str, config: MemberConfig) -> None:
    """Logs to stderr in config.log_format, each line naming the role and member
    (and the request and trace ids on lines about a request)."""
    logging_json.configure(role, config.member_id, config.log_level, config.log_format)


def configure_telemetry(role: str, config: MemberConfig) -> None:
    """Logging, then tracing from the OTEL_* environment (services/telemetry.py), then the
    garbage collector's pauses as a metric (services/gc_pauses.py)."""
    configure_logging(role, config)
    telemetry.configure_tracing(role)
    gc_pauses.observe()


def configure_tls(role: str, config: MemberConfig) -> None:
    """Mutual TLS as role for every server and channel of the process, when
    config.tls_dir is set (services/tls.py); exits with status 2 naming a
    missing file."""
    try:
        tls.configure(tls.MeshTls(tls.TlsFiles.from_dir(config.tls_dir), role) if config.tls_dir else None)
    except ValueError as error:
        print(f"--tls-dir: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call from within the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


def announce_port(role: str, config: MemberConfig, port: int) -> None:
    """Tells the operator and the launcher where the server listens: a line
    on stdout, a log line, and the port file if config.port_file is set."""
    print(f"{role} {config.member_id} listening on {config.address(port)}", file=sys.stdout, flush=True)
    logging.getLogger(role).info("listening on %s (bound %s:%d)", config.address(port), config.host, port)
    if config.port_file:
        write_port_file(config.port_file, port)
