"""The transport of the followers' leader probe: a gRPC health check.

`HealthCheck(timeout_s)` is the `check` of election.LeaderProbe: one
grpc.health.v1 Check of the leader's address with a deadline. It keeps one
channel, to the address it last checked, and answers False on any error:
a crashed leader's port refuses at once (False), a hung one (SIGSTOP, a
stuck event loop) runs into the deadline (SILENT: the election waits
`silent_s` before it believes that). The channel has no tracing
interceptors (ten checks a second would flood the traces) and reconnects
quickly.
"""

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.election import SILENT

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_REQUEST = health_pb2.HealthCheckRequest(service="")
REFUSED = grpc.StatusCode.UNAVAILABLE


class HealthCheck:
    """Checks that the process at an address serves; one channel at a time."""

    def __init__(self, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"the leader probe's timeout must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        self._address: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: health_pb2_grpc.HealthStub | None = None

    async def __call__(self, address: str) -> "bool | object":
        """True if address answered SERVING within the deadline; False if it
        refused the connection or answered NOT_SERVING; election.SILENT for
        anything else (no answer in time, another error)."""
        status = await self.status(address)
        if status == health_pb2.HealthCheckResponse.SERVING:
            return True
        if status in (REFUSED, health_pb2.HealthCheckResponse.NOT_SERVING):
            return False
        return SILENT  # no answer in time, or an error that does not say the leader is gone

    async def status(self, address: str) -> "int | grpc.StatusCode":
        """The health status the address answered (a HealthCheckResponse
        status), or the gRPC code of the failed check: UNAVAILABLE if nothing
        listens there, DEADLINE_EXCEEDED if it did not answer in time."""
        if address != self._address:
            await self.close()
            self._address = address
            self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
            self._stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await self._stub.Check(_REQUEST, timeout=self._timeout_s)
        except grpc.RpcError as error:
            log.debug("health check of %s failed: %s", address, error.code())
            return error.code()
        return reply.status

    async def close(self) -> None:
        channel, self._channel, self._stub, self._address = self._channel, None, None, None
        if channel is not None:
            await channel.close()
