"""Health checks over gRPC: the transport of the followers' leader probe and of the leader's gateway probe.

`HealthCheck(timeout_s)` is one grpc.health.v1 Check of an address with a
deadline, answered as a `Health` (scheduler_svc/health.py); called, it is
the `check` of election.LeaderProbe. It keeps one channel, to the address
it last checked: a crashed process's port refuses at once (REFUSED), a hung
one (SIGSTOP, a stuck event loop) runs into the deadline (NO_ANSWER: the
election waits `silent_s` before it believes that). The channel has no
tracing interceptors (ten checks a second would flood the traces) and
reconnects quickly.
"""

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.health import Health, leader_answer
from services import grpc_util

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_REQUEST = health_pb2.HealthCheckRequest(service="")
_ANSWERS = {
    health_pb2.HealthCheckResponse.SERVING: Health.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING: Health.NOT_SERVING,
}


class HealthCheck:
    """Checks that the process at an address serves; one channel at a time."""

    def __init__(self, timeout_s: float, peer_role: str = "scheduler"):
        if timeout_s <= 0:
            raise ValueError(f"the leader probe's timeout must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        self._stubs = grpc_util.LastAddressStub(
            health_pb2_grpc.HealthStub, peer_role,
            lambda address, role: grpc_util.channel(address, role, is_traced=False, options=_OPTIONS))

    async def __call__(self, address: str) -> "bool | object":
        """The leader probe's answer (health.leader_answer)."""
        return leader_answer(await self.health(address))

    async def health(self, address: str) -> Health:
        """What the address answered within the deadline: REFUSED if nothing
        listens there (UNAVAILABLE), NO_ANSWER for no answer in time or any
        other error or status."""
        stub = await self._stubs.to(address)
        try:
            reply = await stub.Check(_REQUEST, timeout=self._timeout_s)
        except grpc.RpcError as error:
            log.debug("health check of %s failed: %s", address, error.code())
            return Health.REFUSED if error.code() == grpc.StatusCode.UNAVAILABLE else Health.NO_ANSWER
        return _ANSWERS.get(reply.status, Health.NO_ANSWER)

    async def close(self) -> None:
        await self._stubs.close()
