"""gRPC plumbing shared by every role: servers with health and reflection,
channels with sane defaults (mutual TLS when the process has it).

Every server enables the standard health service (grpc.health.v1) and server
reflection, so `grpcurl`/`buf curl` can call it with no stubs.

With the process's TLS on (services.tls.active()), servers listen with
dynamic mutual-TLS credentials and check each caller's role first
(tls.RoleInterceptor); the gateway's port accepts clients without a
certificate (its public API authenticates them with API keys). Channels
present this process's certificate and check the server's role
(`peer_role`). Without TLS both stay plaintext.
"""

import dataclasses
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services import telemetry, tls

log = logging.getLogger(__name__)

# Messages carry step plans and prompts; 64 MiB bounds a single message.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclasses.dataclass(slots=True)
class Server:
    """A started grpc.aio server, its bound port and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    # The role's own services (not health or reflection).
    service_names: tuple[str, ...] = ()

    async def set_serving(self, is_serving: bool) -> None:
        """Sets the overall health status ("") and that of every role service."""
        status = SERVING if is_serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting calls and lets running ones finish within grace_s."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(
    register_fns,
    service_names: list[str],
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors=(),
    options=(),
    mesh_tls: tls.MeshTls | None = None,
) -> Server:
    """Starts a grpc.aio server on host:port (0 picks a free port).

    register_fns: callables taking the server, each adding one servicer
    (e.g. `lambda s: pb2_grpc.add_FooServiceServicer_to_server(impl, s)`).
    service_names: the full names of those services, for reflection.
    The overall health status starts NOT_SERVING; the role flips it. While
    tracing is on, every call of the role's services runs in a span
    (telemetry.server_interceptors, ahead of `interceptors`). `options`: grpc server
    options that override the mesh's defaults (services/grpc_limits.ServerLimits).
    mesh_tls: the TLS to listen with (default: the process's, tls.active()).
    """
    mesh_tls = tls.active() if mesh_tls is None else mesh_tls
    role_check = [tls.RoleInterceptor()] if mesh_tls else []
    merged = list({**dict(_OPTIONS), **dict(options)}.items())
    server = grpc.aio.server(options=merged,
                             interceptors=[*role_check, *telemetry.server_interceptors(), *interceptors])
    for register in register_fns:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    if mesh_tls:
        # The gateway's API is public: clients may come without a certificate.
        credentials = tls.server_credentials(mesh_tls.files, require_client_cert=mesh_tls.role != "gateway")
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    started = Server(server=server, port=bound, health=health_servicer, service_names=tuple(service_names))
    await started.set_serving(False)
    log.info("gRPC server listening on %s:%d", host, bound)
    return started


def channel(target: str, peer_role: str | None = None, *, is_traced: bool = True, options=(),
            mesh_tls: tls.MeshTls | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to a process of role peer_role with the mesh's message
    limits (and, while tracing is on and is_traced, the trace context sent with
    every unary call). With TLS (mesh_tls, default the process's) it presents
    this process's certificate, read now, and checks that the server's names
    peer_role (which TLS then needs). options: channel options beyond the limits.
    """
    mesh_tls = tls.active() if mesh_tls is None else mesh_tls
    interceptors = (telemetry.client_interceptors() if is_traced else None) or None
    if not mesh_tls:
        return grpc.aio.insecure_channel(target, options=[*_OPTIONS, *options], interceptors=interceptors)
    if peer_role is None:
        raise ValueError(f"a TLS channel to {target} needs the role it calls")
    return grpc.aio.secure_channel(target, tls.channel_credentials(mesh_tls.files),
                                   options=[*_OPTIONS, *options, *tls.channel_options(peer_role)],
                                   interceptors=interceptors)


def _tls_stamp() -> tuple | None:
    """The process's certificate files' stamp (None without TLS, or while they are being replaced)."""
    mesh_tls = tls.active()
    if mesh_tls is None:
        return None
    try:
        return mesh_tls.files.stamp()
    except OSError:
        return None


class LastAddressStub:
    """One stub on one channel to the address called last: a caller that talks to
    one peer at a time (the scheduler leader, a probed process) reuses it while
    the address stays, and a new address closes the old channel first. So does
    a rotated certificate: a channel keeps the credentials it was made with,
    also when it reconnects, so a kept one would present an expired certificate."""

    def __init__(self, make_stub, peer_role: str | None = None, open_channel=channel):
        self._make_stub = make_stub
        self._open_channel = lambda address: open_channel(address, peer_role)
        self._address: str | None = None
        self._tls_stamp: tuple | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub = None

    async def to(self, address: str):
        """The stub for address, on the kept channel or a new one."""
        stamp = _tls_stamp()
        if address != self._address or (stamp is not None and stamp != self._tls_stamp):
            await self.close()
            self._address, self._tls_stamp, self._channel = address, stamp, self._open_channel(address)
            self._stub = self._make_stub(self._channel)
        return self._stub

    async def close(self) -> None:
        """Closes the channel (the next call opens a new one)."""
        channel, self._channel, self._stub, self._address = self._channel, None, None, None
        if channel is not None:
            await channel.close()
