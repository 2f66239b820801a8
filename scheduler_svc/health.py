"""What a health check of another process says, and when misses add up to a death, for the
probes of the leader, of the gateways and of the expert services. Pure.

The transport (a grpc.health.v1 Check) is scheduler_svc/health_client.py;
the election (followers probing the leader) and the member probes (the
leader probing the gateways and the ranks: member_probe.py) see only these answers.
"""

import dataclasses
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


@dataclasses.dataclass(slots=True)
class MissCounter:
    """Consecutive missed checks per member (a key such as "id@address").

    A check whose answer is in `misses` is a miss, any other answer resets the
    count; only a member that answered once counts misses (one still starting,
    or registered where nothing ever listened, is not known to have died).
    Silence (NO_ANSWER) is judged by the last answer: after SERVING it is a
    miss like any; after NOT_SERVING (a member loading, joining or waiting,
    whose event loop may stall for a moment, holding no stream) it counts
    towards `threshold_not_serving` instead, or not at all when that is None.
    `observe` says True once, when a count reaches its threshold, and starts
    counting again from zero."""

    threshold: int
    misses: frozenset
    threshold_not_serving: int | None = None
    _counts: dict = dataclasses.field(default_factory=dict)
    _last: dict = dataclasses.field(default_factory=dict)  # key -> its last answer (SERVING or NOT_SERVING)

    def __post_init__(self) -> None:
        if self.threshold < 1 or (self.threshold_not_serving is not None and self.threshold_not_serving < 1):
            raise ValueError(f"the miss threshold must be >= 1, got {self.threshold}, {self.threshold_not_serving}")

    def observe(self, key: str, health: Health) -> bool:
        """Counts one check of key; True if key has now missed its threshold in a row."""
        if health not in self.misses:
            self._last[key] = health
            self._counts.pop(key, None)
            return False
        last = self._last.get(key)
        if last is None:
            return False
        threshold = self.threshold
        if health is Health.NO_ANSWER and last is not Health.SERVING:
            if self.threshold_not_serving is None:
                return False
            threshold = self.threshold_not_serving
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] < threshold:
            return False
        del self._counts[key]
        return True

    def forget(self, key: str) -> None:
        """The member left (or moved): its history goes."""
        self._counts.pop(key, None)
        self._last.pop(key, None)
