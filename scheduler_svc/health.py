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
class SilenceJudge:
    """When a probed member is lost, judged by the time since its last answer rather
    than by missed deadlines.

    The prober checks each member one request after another, each with a deadline
    long enough that a late answer still arrives (`answered` records what each check
    said, and when). A member slowed down (a loaded host, a busy event loop) keeps
    answering, however late, and is never lost; only one that stops answering is:
    frozen (SIGSTOP, a wedged loop), gone (refused) or cut off. `is_lost` is True for
    a member that answered once and then

    - was refused `refusals` checks in a row (nothing listens: the process is gone), or
    - has been silent for `silent_s` since an answer that was SERVING (a hung serving
      process holds its streams), or for `silent_not_serving_s` since a NOT_SERVING
      one (loading, joining or waiting: its loop may stall for a while and it holds no
      stream); None for either: that silence never counts. A silence counts only while
      another member (if any was ever heard) was heard within it: when all go silent at
      once, the prober itself (starved of CPU) or its network is the likelier cause, and
      the leases decide.

    A member never seen answering (still starting, or registered where nothing ever
    listened) is lost only with `silent_unheard_s`: that long after its first check was sent
    (`checked`) with no answer at all (a process hung before its first answer), under the same
    rule of other members heard meanwhile; None: never. Times are the caller's clock
    (monotonic seconds)."""

    refusals: int
    silent_s: float | None = None
    silent_not_serving_s: float | None = None
    # How often the prober judges (`tick`): a longer gap between rounds is the prober's own pause.
    interval_s: float | None = None
    silent_unheard_s: float | None = None
    _last_tick: float | None = None
    _first_checked: dict = dataclasses.field(default_factory=dict)  # key -> when its first check was sent
    _last: dict = dataclasses.field(default_factory=dict)  # key -> (time, SERVING or NOT_SERVING)
    _refused: dict = dataclasses.field(default_factory=dict)  # key -> refusals in a row

    def __post_init__(self) -> None:
        silences = (self.silent_s, self.silent_not_serving_s, self.silent_unheard_s)
        if self.refusals < 1 or any(s is not None and s <= 0 for s in silences):
            raise ValueError(f"a silence judge needs refusals >= 1 and silences > 0, got {self.refusals}, "
                             f"{', '.join(map(str, silences))}")

    def checked(self, key: str, now: float) -> None:
        """A check of key was sent at `now` (only the first one's time is kept)."""
        self._first_checked.setdefault(key, now)

    def answered(self, key: str, health: Health, now: float) -> None:
        """Records one check of key that ended at `now` (NO_ANSWER: its deadline passed)."""
        if health is Health.REFUSED:
            if key in self._last:
                self._refused[key] = self._refused.get(key, 0) + 1
        elif health is not Health.NO_ANSWER:
            self._last[key] = (now, health)
            self._refused.pop(key, None)

    def heard(self, key: str) -> bool:
        """Whether key ever answered (only such a member can be lost by silence)."""
        return key in self._last

    def is_lost(self, key: str, now: float) -> bool:
        last = self._last.get(key)
        if last is None:
            since, allowed = self._first_checked.get(key), self.silent_unheard_s
            if since is None:
                return False
        else:
            if self._refused.get(key, 0) >= self.refusals:
                return True
            since, health = last
            allowed = self.silent_s if health is Health.SERVING else self.silent_not_serving_s
        if allowed is None or now - since < allowed:
            return False
        # Only a silence of its own: when no other member was heard meanwhile, the prober
        # (starved of CPU) or its network is the likelier cause, and the leases decide instead.
        others = [t for k, (t, _) in self._last.items() if k != key]
        return not others or any(now - t < allowed for t in others)

    def why(self, key: str, now: float) -> str:
        """Why is_lost said True, for the log."""
        if self._refused.get(key, 0) >= self.refusals:
            return f"refused {self._refused[key]} health checks in a row"
        if key not in self._last:
            return f"has not answered any health check in {now - self._first_checked[key]:.2f} s"
        since, health = self._last[key]
        return f"has not answered a health check for {now - since:.2f} s (last answer {health.value})"

    def tick(self, now: float) -> None:
        """Starts a judging round. A round later than `interval_s` after the last one means the
        prober itself was not running (paused, starved of CPU) for the excess: answers may be
        waiting unread and nothing is known of the members meanwhile, so that time does not
        count as their silence (every member's last answer moves forward by it, never past now).
        A prober that is only ever late still judges: its lateness is forgiven, not its members'
        silence."""
        last, self._last_tick = self._last_tick, now
        if last is None or self.interval_s is None:
            return
        excess = now - last - self.interval_s
        if excess > 0:
            for key, (since, health) in self._last.items():
                self._last[key] = (min(since + excess, now), health)
            for key, since in self._first_checked.items():
                self._first_checked[key] = min(since + excess, now)

    def forget(self, key: str) -> None:
        """The member left (or was given up on): its history goes."""
        self._last.pop(key, None)
        self._refused.pop(key, None)
        self._first_checked.pop(key, None)
