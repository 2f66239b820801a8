"""Leadership metrics and readiness of one scheduler replica.

`LeaderWatch.observe` is fed every leader the replica's watch of the whole
prefix sees (cluster_view.ClusterView, independent of the election, whose logic
it does not touch) and keeps the gauges:
is this replica the leader, is there a leader, its term; counts each new
term seen (leader changes, the first leader this replica sees excluded) and
measures failovers: from the moment the replica saw the leader key go to
the moment it saw the next leader, so the time a crashed leader's key
lingers before followers revoke it is not included (the election's probes
bound that; see docs/runbook.md). A term that replaces another without an
empty key in between (seen as one change) counts as a change with no
failover measured.
"""

import logging
import time

from services import metrics
from services.cluster import ClusterClient, LeaderInfo

log = logging.getLogger(__name__)


class LeaderWatch:
    """Leadership as this replica sees it, for /metrics and /readyz."""

    def __init__(self, client: ClusterClient, member_id: str, clock=time.monotonic) -> None:
        self._client = client
        self._member_id = member_id
        self._clock = clock
        self._metrics = metrics.scheduler_metrics()
        self.leader: LeaderInfo | None = None
        self._term: int | None = None
        self._leaderless_since: float | None = None

    def observe(self, leader: LeaderInfo | None) -> None:
        """Updates the metrics for the leader now in etcd (None: no leader)."""
        m, now = self._metrics, self._clock()
        self.leader = leader
        m.leader_present.set(leader is not None)
        m.is_leader.set(leader is not None and leader.member_id == self._member_id)
        if leader is None:
            if self._term is not None and self._leaderless_since is None:
                self._leaderless_since = now
            return
        m.leader_term.set(leader.term)
        if leader.term == self._term:
            return
        if self._term is not None:
            m.leader_changes.inc()
            if self._leaderless_since is not None:
                m.last_failover_duration.set(now - self._leaderless_since)
                log.info("new leader %s (term %d) after %.3f s without one", leader.member_id, leader.term,
                         now - self._leaderless_since)
        self._term = leader.term
        self._leaderless_since = None

    def readiness(self) -> dict:
        """/readyz: ready once registered in etcd with a live session."""
        session = self._client.session
        is_registered = session is not None and not session.lost.is_set() and not self._client.is_closed
        leader = self.leader
        return {
            "ready": is_registered,
            "registered": is_registered,
            "leader": None if leader is None else leader.member_id,
            "is_leader": leader is not None and leader.member_id == self._member_id,
            "term": None if leader is None else leader.term,
        }
