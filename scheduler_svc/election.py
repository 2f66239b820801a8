"""Leader election among the scheduler replicas, on etcd's `/leader` key.

A candidate creates `/leader` in a transaction that succeeds only if the
key is absent, attached to its session lease. The term is the key's mod
revision: strictly larger for every new leader, so fencing writes on
`mod_revision(/leader) == term` (ClusterClient.fence) rejects a deposed one.
Losers follow the leader: they watch the key and campaign again when it
disappears (the leader's lease was revoked on shutdown, expired, or was
revoked by a follower that found the leader dead).

Fast failure detection: a lease alone cannot replace a crashed leader
within a second (etcd's minimum TTL is 1 s and it checks expiry every
500 ms). So each follower also probes the leader directly (`LeaderProbe`:
a health check of its address every `interval_s`) and after `misses`
consecutive failures revokes the leader's lease, which ends the term at
once (`ClusterClient.depose_leader`); checks that merely go unanswered
(rather than refused) must also span `silent_s`, so a leader starved of CPU
for a moment on a loaded machine keeps its term. Guards against a follower's own
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

Graceful stop (`hand_over`): the leader puts `/leader` again under a live
follower's lease (the longest registered one: a replica just restarted is
still starting and would answer late), in one transaction fenced on its
term (ClusterClient.handover), the scheduler members being those this
replica has been watching all along: one etcd round trip. The key never
disappears, so nobody campaigns; the follower's own term watch sees itself
named and it leads at once, without an election. With no live follower the leader
resigns as before (closing the client revokes its lease).

Cancelling run() ends it promptly: every etcd call it makes has a deadline,
and stepping down waits a bounded time for the term's tasks to end. This
module imports no gRPC: the probe's transport is passed in.
"""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from services.cluster import ClusterClient, ClusterUnavailableError, LeaderInfo, Member, Session, cancel_and_wait

log = logging.getLogger(__name__)

_RETRY_S = 0.5
# What LeaderProbe.check returns for a leader that did not answer in time.
SILENT = object()
# Stepping down: how long the term's work and watchers may take to end once cancelled.
_STEP_DOWN_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderProbe:
    """How followers watch the leader directly."""

    # One health check of a leader's address, bounded by its own deadline:
    # True if it answered that it serves, False if it refused (nothing
    # listens: a crash) or answered NOT_SERVING, SILENT if it did not answer
    # within the deadline (hung, or only starved of CPU for a moment).
    check: Callable[[str], Awaitable["bool | object"]]
    interval_s: float = 0.1
    # Consecutive failed checks after which a follower deposes the leader.
    misses: int = 2
    # A check that took longer than this to fail says more about this
    # replica's own event loop than about the leader: it does not count.
    max_answer_s: float = 0.3
    # A leader whose checks only go unanswered (SILENT) is deposed once they
    # have for this long, not after `misses` alone: a leader starved of CPU
    # for 300 ms on a loaded machine is not dead. A refusal is definite.
    silent_s: float = 0.5

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.misses < 1 or self.max_answer_s <= 0 or self.silent_s < 0:
            raise ValueError(f"a leader probe needs interval_s > 0, misses >= 1, max_answer_s > 0 and "
                             f"silent_s >= 0, got {self.interval_s}, {self.misses}, {self.max_answer_s}, "
                             f"{self.silent_s}")


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
        # The scheduler members as this replica's watch last saw them: the heirs of a handover.
        self._heirs: list[Member] | None = None
        self._is_stopping = False  # hand_over() has begun: campaign no more

    @property
    def is_leader(self) -> bool:
        return self.leadership is not None

    async def run(self, lead: LeadFn) -> None:
        """Campaigns until cancelled (or the client is closed); runs
        lead(leadership) during each term held."""
        # Followed all along, not from the start of a term: a handover right after an election still needs no read.
        heirs = asyncio.create_task(self._watch_heirs(), name="watch-heirs")
        try:
            await self._campaign(lead)
        finally:
            await cancel_and_wait([heirs], _STEP_DOWN_S, what="the heirs watch")

    async def _campaign(self, lead: LeadFn) -> None:
        """run()'s loop: campaign, then lead or follow, until the client is closed or hand_over() begins."""
        leader: LeaderInfo | None = None  # the leader after the last term, if known
        while not self._client.is_closed and not self._is_stopping:
            try:
                session = await self._client.live_session()
                if leader is None:
                    leader = await self._client.campaign(self._member_id, self._address)
                leadership = leadership_of(leader, session)
                if leadership is None:
                    log.info("following %s (term %d)", leader.member_id, leader.term)
                    leader = await self._follow(leader)  # a leader handed the term to us: no campaign
                else:
                    leader = None
                    await self._hold(leadership, session, lead)
            except Exception as error:  # noqa: BLE001 - never stop campaigning on an etcd error
                leader = None
                if self._client.is_closed:
                    return
                log.warning("election: %r; retrying", error,
                            exc_info=not isinstance(error, ClusterUnavailableError))
                await asyncio.sleep(_RETRY_S)

    async def hand_over(self, campaign: asyncio.Task) -> LeaderInfo | None:
        """Graceful stop of the replica running `campaign` (this election's
        run()): if it holds a term, first hands it to a live follower in one
        etcd transaction (ClusterClient.handover), then ends the campaign (the
        fence rejects any late write of the ending work). The transaction
        goes out before the term's work is torn down: that teardown is not on
        the way to the new leader. Returns the new leader; None if this
        replica did not lead or no follower took the term (then closing the
        client ends the term as before: the lease and /leader go, the
        followers campaign)."""
        leadership, leader = self.leadership, None
        self._is_stopping = True  # the term that ends with the handover is not campaigned for again
        try:
            if leadership is not None and not self._client.is_closed:
                leader = await self._client.handover(leadership.term, self._member_id, self._heirs)
        except Exception as error:  # noqa: BLE001 - etcd trouble: closing the client still ends the term
            log.warning("handing term %d over failed: %r; resigning", leadership.term, error)
        finally:
            await cancel_and_wait([campaign], _STEP_DOWN_S, what="the election")
        if leader is not None:
            log.info("handed term %d over to %s (term %d)", leadership.term, leader.member_id, leader.term)
        return leader

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

    async def _watch_heirs(self) -> None:
        """Keeps self._heirs current (for hand_over) until cancelled."""
        async with contextlib.aclosing(self._client.watch_members("scheduler")) as changes:
            async for members in changes:
                self._heirs = members

    async def _follow(self, leader: LeaderInfo) -> LeaderInfo | None:
        """Returns the next leader (None: none yet) once the leader's term has
        ended; meanwhile probes the leader and deposes it if it stops answering."""
        if self._probe is None:
            return await self._wait_term_end(leader.term)
        probing = asyncio.create_task(self._probe_leader(leader), name=f"probe-term-{leader.term}")
        try:
            return await self._wait_term_end(leader.term)
        finally:
            await cancel_and_wait([probing], _STEP_DOWN_S, what="the leader probe")

    async def _probe_leader(self, leader: LeaderInfo) -> None:
        """Checks the leader every interval; deposes it after `misses`
        consecutive failed checks, the last a refusal or all of them silent
        for `silent_s` (see the module docstring's guards)."""
        probe, loop = self._probe, asyncio.get_running_loop()
        # Under our member id but not our lease: an earlier run of this
        # replica, dead by definition even if our own server answers there.
        is_earlier_self = leader.member_id == self._member_id
        misses, failing_since = 0, None
        while True:
            started = loop.time()
            answer = False if is_earlier_self else await probe.check(leader.address)
            if answer is True:
                misses, failing_since = 0, None
            elif loop.time() - started <= probe.max_answer_s:
                misses += 1
                failing_since = started if failing_since is None else failing_since
            if misses >= probe.misses and (answer is not SILENT or loop.time() - failing_since >= probe.silent_s):
                misses, failing_since = 0, None
                session = self._client.session
                if session is not None and not session.lost.is_set():
                    # Logged first: once the lease is revoked our own term watch may end this task.
                    log.warning("leader %s (term %d) at %s failed %d health checks in a row (%s): deposing it",
                                leader.member_id, leader.term, leader.address, probe.misses,
                                "silent" if answer is SILENT else "refused")
                    if await self._client.depose_leader(leader):
                        return
            await asyncio.sleep(max(0.0, started + probe.interval_s - loop.time()))

    async def _wait_term_end(self, term: int) -> LeaderInfo | None:
        """Returns the leader after it (None: none) once /leader no longer
        holds the key created at term, or None once the client is closed; the
        watch is cancelled on the way out."""
        async with contextlib.aclosing(self._client.watch_leader()) as leaders:
            async for leader in leaders:
                if leader is None or leader.term != term:
                    return leader
        return None
