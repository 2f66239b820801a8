"""Leader election among the scheduler replicas, on etcd's `/leader` key.

A candidate creates `/leader` in a transaction that succeeds only if the
key is absent (create_revision == 0), attached to its session lease. The
term is the key's create revision: strictly larger for every new leader, so
fencing writes on `create_revision(/leader) == term` rejects a deposed one.
Losers follow the leader: they watch the key and campaign again when it
disappears (the leader's lease was revoked on shutdown, expired, or was
revoked by a follower that found the leader dead).

Fast failure detection: a lease alone cannot replace a crashed leader
within a second (etcd's minimum TTL is 1 s and it checks expiry every
500 ms). So each follower also probes the leader directly (`LeaderProbe`:
a health check of its address every `interval_s`) and after `misses`
consecutive failures revokes the leader's lease, which ends the term at
once (`ClusterClient.depose_leader`). Guards against a follower's own
trouble: a probe answered later than `max_answer_s` (our event loop was
starved) does not count, a follower whose own session is lost deposes
nobody, and the lease is revoked only if etcd answers us and `/leader`
still holds that term under that lease. A leader key left by an earlier
run of this very replica (same member id, another lease) counts as dead
whatever answers at its address.

The leader acts only while it holds the term: it steps down (cancels its
work, then campaigns again) at once when its session is lost (a keepalive
failed: it cannot know its lease outlives the next TTL) or when `/leader`
no longer carries its term; a fenced write that fails also ends its work.
If the lease turns out alive (an etcd blip), it wins the same term back.
Safety never depends on this detection: the fence does.

Cancelling run() ends it promptly: every etcd call it makes has a deadline,
and stepping down waits a bounded time for the term's tasks to end. This
module imports no gRPC: the probe's transport is passed in.
"""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from services.cluster import ClusterClient, ClusterUnavailableError, LeaderInfo, Session, cancel_and_wait

log = logging.getLogger(__name__)

_RETRY_S = 0.5
# Stepping down: how long the term's work and watchers may take to end once cancelled.
_STEP_DOWN_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderProbe:
    """How followers watch the leader directly."""

    # One health check of a leader's address, bounded by its own deadline:
    # True if it answered that it serves.
    check: Callable[[str], Awaitable[bool]]
    interval_s: float = 0.1
    # Consecutive failed checks after which a follower deposes the leader.
    misses: int = 2
    # A check that took longer than this to fail says more about this
    # replica's own event loop than about the leader: it does not count.
    max_answer_s: float = 0.3

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.misses < 1 or self.max_answer_s <= 0:
            raise ValueError(f"a leader probe needs interval_s > 0, misses >= 1 and max_answer_s > 0, got "
                             f"{self.interval_s}, {self.misses}, {self.max_answer_s}")


@dataclasses.dataclass(frozen=True, slots=True)
class Leadership:
    """A term held by this replica."""

    term: int
    lease_id: int
    elected_at: float


def leadership_of(leader: LeaderInfo, session: Session) -> Leadership | None:
    """The leadership this session holds according to the leader key, if any."""
    if leader.lease_id != session.lease_id:
        return None
    return Leadership(leader.term, leader.lease_id, leader.elected_at)


class LeadershipLost(Exception):
    """A write fenced on the term was rejected: a newer leader exists."""


LeadFn = Callable[[Leadership], Awaitable[None]]


class Election:
    """Campaigns for one replica and runs `lead` while it is the leader."""

    def __init__(self, client: ClusterClient, member_id: str, address: str, *,
                 probe: LeaderProbe | None = None):
        self._client = client
        self._member_id = member_id
        self._address = address
        self._probe = probe  # None: a dead leader is replaced when its lease expires
        self.leadership: Leadership | None = None

    @property
    def is_leader(self) -> bool:
        return self.leadership is not None

    async def run(self, lead: LeadFn) -> None:
        """Campaigns until cancelled (or the client is closed); runs
        lead(leadership) during each term held."""
        while not self._client.is_closed:
            try:
                session = await self._client.live_session()
                leader = await self._client.campaign(self._member_id, self._address)
                leadership = leadership_of(leader, session)
                if leadership is None:
                    log.info("following %s (term %d)", leader.member_id, leader.term)
                    await self._follow(leader)
                else:
                    await self._hold(leadership, session, lead)
            except Exception as error:  # noqa: BLE001 - never stop campaigning on an etcd error
                if self._client.is_closed:
                    return
                log.warning("election: %r; retrying", error,
                            exc_info=not isinstance(error, ClusterUnavailableError))
                await asyncio.sleep(_RETRY_S)

    async def _hold(self, leadership: Leadership, session: Session, lead: LeadFn) -> None:
        """Runs lead until it ends, the session is lost or the term ends."""
        self.leadership = leadership
        log.info("%s elected leader, term %d", self._member_id, leadership.term)
        work = asyncio.create_task(lead(leadership), name=f"lead-term-{leadership.term}")
        watchers = [
            asyncio.create_task(session.lost.wait(), name="session-lost"),
            asyncio.create_task(self._wait_term_end(leadership.term), name="term-end"),
        ]
        try:
            done, _ = await asyncio.wait([work, *watchers], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.leadership = None
            await cancel_and_wait([work, *watchers], _STEP_DOWN_S, what=f"term {leadership.term}'s tasks")
        reason = next(t.get_name() for t in [work, *watchers] if t in done)
        log.warning("stepping down from term %d (%s)", leadership.term, reason)
        if work in done and not work.cancelled() and work.exception() is not None:
            if isinstance(work.exception(), LeadershipLost):
                log.warning("%s", work.exception())
            else:
                log.error("leader work failed", exc_info=work.exception())
            await self._client.resign(leadership.term)
            await asyncio.sleep(_RETRY_S)  # let another replica take the term

    async def _follow(self, leader: LeaderInfo) -> None:
        """Returns once the leader's term has ended; meanwhile probes the
        leader and deposes it if it stops answering."""
        if self._probe is None:
            return await self._wait_term_end(leader.term)
        probing = asyncio.create_task(self._probe_leader(leader), name=f"probe-term-{leader.term}")
        try:
            await self._wait_term_end(leader.term)
        finally:
            await cancel_and_wait([probing], _STEP_DOWN_S, what="the leader probe")

    async def _probe_leader(self, leader: LeaderInfo) -> None:
        """Checks the leader every interval; deposes it after `misses`
        consecutive failed checks (see the module docstring's guards)."""
        probe, loop = self._probe, asyncio.get_running_loop()
        # Under our member id but not our lease: an earlier run of this
        # replica, dead by definition even if our own server answers there.
        is_earlier_self = leader.member_id == self._member_id
        misses = 0
        while True:
            started = loop.time()
            is_alive = not is_earlier_self and await probe.check(leader.address)
            if is_alive:
                misses = 0
            elif loop.time() - started <= probe.max_answer_s:
                misses += 1
            if misses >= probe.misses:
                misses = 0
                session = self._client.session
                if session is not None and not session.lost.is_set():
                    # Logged first: once the lease is revoked our own term watch may end this task.
                    log.warning("leader %s (term %d) at %s failed %d health checks in a row: deposing it",
                                leader.member_id, leader.term, leader.address, probe.misses)
                    if await self._client.depose_leader(leader):
                        return
            await asyncio.sleep(max(0.0, started + probe.interval_s - loop.time()))

    async def _wait_term_end(self, term: int) -> None:
        """Returns once /leader no longer holds the key created at term (or
        the client is closed); the watch is cancelled on the way out."""
        async with contextlib.aclosing(self._client.watch_leader()) as leaders:
            async for leader in leaders:
                if leader is None or leader.term != term:
                    return
