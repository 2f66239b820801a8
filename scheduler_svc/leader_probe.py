"""The transport of the followers' leader probe: a gRPC health check.

`HealthCheck(timeout_s)` is the `check` of election.LeaderProbe: one
grpc.health.v1 Check of the leader's address with a deadline. It keeps one
channel, to the address it last checked, and answers False on any error:
a crashed leader's port refuses at once, a hung one (SIGSTOP, a stuck
event loop) runs into the deadline. The channel has no tracing
interceptors (ten checks a second would flood the traces) and reconnects
quickly.
"""

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_REQUEST = health_pb2.HealthCheckRequest(service="")


class HealthCheck:
    """Checks that the process at an address serves; one channel at a time."""

    def __init__(self, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"the leader probe's timeout must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        self._address: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: health_pb2_grpc.HealthStub | None = None

    async def __call__(self, address: str) -> bool:
        """True if address answered SERVING within the deadline."""
        if address != self._address:
            await self.close()
            self._address = address
            self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
            self._stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await self._stub.Check(_REQUEST, timeout=self._timeout_s)
        except grpc.RpcError as error:
            log.debug("health check of %s failed: %s", address, error.code())
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        channel, self._channel, self._stub, self._address = self._channel, None, None, None
        if channel is not None:
            await channel.close()
