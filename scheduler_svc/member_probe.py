"""The leader's probes of the gateways and of the expert services: a dead
gateway's group goes to a standby, and a dead or hung rank's group is
re-formed, within a few hundred milliseconds instead of a lease TTL.

While it leads, the scheduler health-checks every registered member of a
role every `interval_s` (one HealthChecker each: health_client.HealthCheck).
A member that answered a check once at its address and then misses `misses`
checks in a row has its lease revoked (ClusterClient.depose_member, only if
its member key still holds that address): its member key goes at once, and
the planner treats it as any member that left (a gateway's group goes to a
free gateway; a rank's group is re-formed on a standby, or on the same member
once it registers again: docs/internals.md, "Rank failures").

What counts as a miss differs by role (`MemberProbe.is_silence_a_miss`):

- gateways: only a refused connection (nothing listens: the process is
  gone). A gateway that answers late (busy, or hung) is left to its lease,
  so a slow gateway never loses its group to the probe;
- expert services: a refused connection, and also no answer within the
  deadline from a rank whose last answer was SERVING. A hung serving rank
  (SIGSTOP, a stuck event loop) holds every stream of its group (its peers
  wait on it in the collective), so it is treated as lost: a rank's health
  answers come from its event loop, never from the model thread, so a long
  step does not make it late. A rank that is NOT_SERVING (loading, joining:
  its loop stalls for a moment, e.g. while the garbage collector freezes the
  loaded weights' objects) holds no stream, and its silence is left to its
  lease.

NOT_SERVING (a standby, a loading or draining member) always counts as an
answer: the process is there. Never having answered at an address (still
starting, or registered where nothing ever listened) is not a miss.
"""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from scheduler_svc.health import Health, HealthChecker, MissCounter
from services.cluster import ClusterClient, Member, cancel_and_wait

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class MemberProbe:
    """How the leader watches the members of one role."""

    role: str = "gateway"
    interval_s: float = 0.1
    timeout_s: float = 0.1
    # Consecutive missed checks after which the member's lease is revoked.
    misses: int = 2
    # Whether a check unanswered within timeout_s is a miss (else only a refusal is).
    is_silence_a_miss: bool = False

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.misses < 1:
            raise ValueError(f"a member probe needs interval_s > 0, timeout_s > 0 and misses >= 1, got "
                             f"{self.interval_s}, {self.timeout_s}, {self.misses}")

    @property
    def detection_s(self) -> tuple[float, float]:
        """The least and most time from a member's death (or freeze) to the revocation, probing
        apart: `misses` checks, each a round that takes the deadline when the member is silent."""
        round_s = max(self.interval_s, self.timeout_s) if self.is_silence_a_miss else self.interval_s
        return (self.misses - 1) * round_s, self.misses * round_s + self.interval_s

    def counter(self) -> MissCounter:
        misses = {Health.REFUSED, Health.NO_ANSWER} if self.is_silence_a_miss else {Health.REFUSED}
        return MissCounter(self.misses, frozenset(misses))


async def probe_members(client: ClusterClient, probe: MemberProbe,
                        new_check: Callable[[float], HealthChecker]) -> None:
    """Checks the registered members of probe.role until cancelled (see the module
    docstring); new_check(timeout_s) makes the checker of one member."""
    members: dict[str, Member] = {}
    checks: dict[str, HealthChecker] = {}
    counter = probe.counter()

    async def follow_members() -> None:
        async with contextlib.aclosing(client.watch_members(probe.role)) as changes:
            async for current in changes:
                members.clear()
                members.update((m.member_id, m) for m in current)

    async def check(member: Member) -> None:
        key = f"{member.member_id}@{member.address}"
        if key not in checks:
            checks[key] = new_check(probe.timeout_s)
        if counter.observe(key, await checks[key].health(member.address)):
            log.warning("%s %s at %s missed %d health checks in a row: revoking its lease", probe.role,
                        member.member_id, member.address, probe.misses)
            await client.depose_member(probe.role, member.member_id, member.address)

    following = asyncio.create_task(follow_members(), name=f"{probe.role}-members")
    loop = asyncio.get_running_loop()
    try:
        while True:
            started = loop.time()
            current = list(members.values())
            await asyncio.gather(*(check(m) for m in current))
            live = {f"{m.member_id}@{m.address}" for m in current}
            for key in [k for k in checks if k not in live]:  # gone: its channel too
                await checks.pop(key).close()
                counter.forget(key)
            if following.done():  # the watch ends only when the client is closed
                return
            await asyncio.sleep(max(0.0, started + probe.interval_s - loop.time()))
    finally:
        await cancel_and_wait([following], 2.0, what=f"the {probe.role} members watch")
        for health_check in checks.values():
            await health_check.close()
