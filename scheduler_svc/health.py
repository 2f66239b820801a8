"""What a health check of another process says, for the probes of the leader and of the gateways. Pure.

The transport (a grpc.health.v1 Check) is scheduler_svc/health_client.py;
the election (followers probing the leader) and the gateway probe (the
leader probing the gateways) see only these answers.
"""

import enum
from typing import Protocol

from scheduler_svc.election import SILENT


class Health(enum.Enum):
    """One check's answer."""

    SERVING = "serving"
    # It answered, and is not serving (a standby, or one draining).
    NOT_SERVING = "not_serving"
    # Nothing listens at the address: the connection was refused (the process is gone).
    REFUSED = "refused"
    # No answer within the deadline (hung, or busy), or an error that does not say it is gone.
    NO_ANSWER = "no_answer"


class HealthChecker(Protocol):
    """Checks the process at an address; close() frees what it holds."""

    async def health(self, address: str) -> Health: ...

    async def close(self) -> None: ...


def leader_answer(health: Health) -> "bool | object":
    """The answer election.LeaderProbe.check gives for a check of the leader: True if it
    serves, False if it refused or answered NOT_SERVING, election.SILENT for no answer."""
    if health is Health.SERVING:
        return True
    if health in (Health.REFUSED, Health.NOT_SERVING):
        return False
    return SILENT
