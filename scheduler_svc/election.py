"""Leader election among the scheduler replicas, on etcd's `/leader` key.

A candidate creates `/leader` in a transaction that succeeds only if the
key is absent (create_revision == 0), attached to its session lease. The
term is the key's create revision: strictly larger for every new leader, so
fencing writes on `create_revision(/leader) == term` rejects a deposed one.
Losers watch the key and campaign again when it disappears (the leader's
lease was revoked on shutdown, expired after a crash, or was revoked by a
follower that found it dead).

The leader acts only while it holds the term: it steps down (cancels its
work, then campaigns again) when its session is lost (keepalive failed for
a whole TTL) or when `/leader` no longer carries its term; a fenced write
that fails also ends its work. Safety never depends on this detection: the
fence does.

Cancelling run() ends it promptly: every etcd call it makes has a deadline,
and stepping down waits a bounded time for the term's tasks to end.
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

    def __init__(self, client: ClusterClient, member_id: str, address: str):
        self._client = client
        self._member_id = member_id
        self._address = address
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
                    await self._wait_term_end(leader.term)
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
            if not isinstance(work.exception(), LeadershipLost):
                log.error("leader work failed", exc_info=work.exception())
            await self._client.resign(leadership.term)
            await asyncio.sleep(_RETRY_S)  # let another replica take the term

    async def _wait_term_end(self, term: int) -> None:
        """Returns once /leader no longer holds the key created at term (or
        the client is closed); the watch is cancelled on the way out."""
        async with contextlib.aclosing(self._client.watch_leader()) as leaders:
            async for leader in leaders:
                if leader is None or leader.term != term:
                    return
