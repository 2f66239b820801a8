"""The leader's probes of the gateways and of the expert services: a dead
gateway's group goes to a standby, and a dead or hung rank's group is
re-formed, within a few hundred milliseconds instead of a lease TTL.

While it leads, the scheduler health-checks every registered member of a
role (one HealthChecker each: health_client.HealthCheck), a check every
`interval_s`, each with a long deadline (`deadline_s`) and several in flight
at once, so that a late answer is still an answer and a member whose every
answer is late still answers every `interval_s`. Every `interval_s` it judges the
members by the time since their last answer (health.SilenceJudge): a member
that answered once and then is refused `refusals` checks in a row, or (where
`silent_s` is set) stays silent for `silent_s` after a SERVING answer, has
its lease revoked (ClusterClient.depose_member, only if its member key still
holds that address): its member key goes at once, and the planner treats it
as any member that left (a gateway's group goes to a free gateway; a rank's
group is re-formed on a standby, or on the same member once it registers
again: docs/internals.md, "Rank failures").

Judging by silence rather than by a short deadline is what keeps a slow
member: a rank on a loaded host whose answers take half a second still
answers every half second, and is kept; one frozen (SIGSTOP, a stuck event
loop) stops, and is lost `silent_s` after its last answer.

- gateways: only refusals (nothing listens: the process is gone). A gateway
  that answers late or not at all (busy, or hung) is left to its lease, so a
  slow gateway never loses its group to the probe;
- expert services: refusals, and silence after a SERVING answer. A hung
  serving rank holds every stream of its group (its peers wait on it in the
  collective), so it is treated as lost: a rank's health answers come from
  its event loop, never from the model thread, so a long step does not
  silence it. A rank that is NOT_SERVING (loading, joining: its loop stalls
  for a moment, e.g. while the garbage collector freezes the loaded weights'
  objects) holds no stream, and its silence is left to its lease.

A judging round that comes late (this scheduler was paused or starved of
CPU, so answers that arrived meanwhile may not be recorded yet) does not
count its own lateness as the members' silence (SilenceJudge.tick).
"""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from scheduler_svc.health import HealthChecker, SilenceJudge
from services.cluster import ClusterClient, Member, cancel_and_wait

log = logging.getLogger(__name__)

# Checks of one member in flight at once (a frozen member holds them all until their deadline).
MAX_IN_FLIGHT = 8


@dataclasses.dataclass(frozen=True, slots=True)
class MemberProbe:
    """How the leader watches the members of one role."""

    role: str = "gateway"
    interval_s: float = 0.1
    # Refused checks in a row after which the member's lease is revoked.
    refusals: int = 2
    # Seconds without an answer after a SERVING one after which it is revoked (None: silence never counts).
    silent_s: float | None = None
    # Deadline of one check: long, so that a late answer still counts as one.
    deadline_s: float = 2.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.deadline_s <= 0:
            raise ValueError(f"a member probe needs interval_s > 0 and deadline_s > 0, got "
                             f"{self.interval_s}, {self.deadline_s}")
        self.judge()  # checks refusals and silent_s

    @property
    def detection_s(self) -> tuple[float, float]:
        """The least and most time from a member's freeze (or, for a role whose silence
        does not count, its death) to the revocation, etcd apart."""
        if self.silent_s is None:
            return (self.refusals - 1) * self.interval_s, (self.refusals + 1) * self.interval_s
        return max(0.0, self.silent_s - self.interval_s), self.silent_s + self.interval_s

    def judge(self) -> SilenceJudge:
        return SilenceJudge(self.refusals, self.silent_s, interval_s=self.interval_s)


async def probe_members(client: ClusterClient, probe: MemberProbe,
                        new_check: Callable[[float], HealthChecker]) -> None:
    """Checks the registered members of probe.role until cancelled (see the module
    docstring); new_check(deadline_s) makes the checker of one member."""
    members: dict[str, Member] = {}
    checking: dict[str, asyncio.Task] = {}  # "id@address" -> its checks
    judge = probe.judge()
    loop = asyncio.get_running_loop()

    async def follow_members() -> None:
        async with contextlib.aclosing(client.watch_members(probe.role)) as changes:
            async for current in changes:
                members.clear()
                members.update((f"{m.member_id}@{m.address}", m) for m in current)

    async def keep_checking(key: str, address: str) -> None:
        """A check every interval_s, each waiting up to deadline_s, several in flight at once:
        a member whose every answer is late still answers every interval_s."""
        check = new_check(probe.deadline_s)
        in_flight: set[asyncio.Task] = set()

        async def one() -> None:
            judge.answered(key, await check.health(address), loop.time())

        try:
            while True:
                if len(in_flight) < MAX_IN_FLIGHT:
                    task = asyncio.create_task(one())
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                await asyncio.sleep(probe.interval_s)
        finally:
            await cancel_and_wait(list(in_flight), 2.0, what=f"the checks of {key}")
            await check.close()

    following = asyncio.create_task(follow_members(), name=f"{probe.role}-members")
    try:
        due = loop.time()
        while not following.done():  # the watch ends only when the client is closed
            for key in [k for k in checking if k not in members]:  # gone: its checks too
                await cancel_and_wait([checking.pop(key)], 2.0, what=f"the checks of {key}")
                judge.forget(key)
            for key, member in members.items():
                if key not in checking:
                    checking[key] = asyncio.create_task(keep_checking(key, member.address), name=f"check-{key}")
            now = loop.time()
            judge.tick(now)
            for key, member in list(members.items()):
                if judge.is_lost(key, now):
                    log.warning("%s %s at %s %s: revoking its lease", probe.role, member.member_id,
                                member.address, judge.why(key, now))
                    judge.forget(key)  # lost again only after a new answer
                    await client.depose_member(probe.role, member.member_id, member.address)
            due = max(due + probe.interval_s, now)
            await asyncio.sleep(max(0.0, due - loop.time()))
    finally:
        await cancel_and_wait([following, *checking.values()], 2.0, what=f"the {probe.role} probes")
