"""LeaderKeyOps: the scheduler leader's key `/leader`: campaign, fence, handover, depose.

The term is the key's mod revision. A campaign creates the key under the
candidate's lease if it is absent; a graceful handover puts it again, in
one transaction, under the heir's lease; either gives the key a revision
larger than every earlier one, so every term is larger than the last.
Every write a leader makes to the cluster state is a transaction that
compares `mod_revision(/leader) == term` (`fence`): once another term has
begun, a deposed leader's write changes nothing.
"""

import collections.abc
import contextlib
import logging
from typing import AsyncIterator

import aetcd
from aetcd import rpc as etcd_rpc

from services import telemetry
from services.cluster.connection import ETCD_ERRORS, ClusterUnavailableError
from services.cluster.records import LeaderInfo, Member, leader_from_kv, leader_value
from services.cluster.session import MemberSession, is_lease_gone, raise_unless_lease_gone

log = logging.getLogger(__name__)

_NO_HEIR = object()  # _hand_to_oldest: none of the heirs took the term


def heir_order(members: collections.abc.Iterable[Member], from_member_id: str) -> list[Member]:
    """The scheduler members a leader may hand its term to, the longest
    registered first (the lowest member key revision; then by member id).
    A scheduler registers once its view of the cluster is built
    (scheduler_svc/main.py) and keeps that registration for its whole life
    (a new one only after its lease was lost), so the oldest registration
    is the warmest replica: one just restarted is still starting (its
    election's watches and first reads, its first probes, lazy imports)
    and would answer as the new leader late."""
    heirs = [m for m in members if m.role == "scheduler" and m.member_id != from_member_id and m.lease_id]
    return sorted(heirs, key=lambda m: (m.revision, m.member_id))


def _leader_after(events: list) -> LeaderInfo | None:
    """The leader after a watch response's events on /leader (the last one counts)."""
    event = events[-1]
    return None if event.type == etcd_rpc.Event.DELETE else leader_from_kv(event.kv)


class LeaderKeyOps(MemberSession):
    """Election, fencing and handover on `/leader`."""

    def fence(self, term: int):
        """The transaction compare that holds only while `term` is the current term."""
        return self._etcd.transactions.mod(self.keys.leader.encode()) == term

    async def get_leader(self) -> LeaderInfo | None:
        return (await self._read_leader())[1]

    async def watch_leader(self) -> AsyncIterator[LeaderInfo | None]:
        """The leader now and after each change (None while there is none)."""
        async with contextlib.aclosing(self._watch_state(self.keys.leader, self._read_leader, is_prefix=False,
                                                         from_events=_leader_after)) as states:
            async for leader in states:
                yield leader

    @telemetry.traced("etcd.campaign")
    async def campaign(self, member_id: str, address: str) -> LeaderInfo:
        """One election attempt: creates /leader under this session's lease if
        absent. Returns the leader after the attempt; we won iff its lease_id is
        our session's (true also when an earlier attempt's reply was lost)."""
        session = await self.live_session()
        key, txn = self.keys.leader.encode(), self._etcd.transactions
        try:
            _, responses = await self._retry(
                "campaign", self._etcd.transaction, compare=[txn.create(key) == 0],
                success=[txn.put(key, leader_value(member_id, address), lease=session.lease_id), txn.get(key)],
                failure=[txn.get(key)])
        except aetcd.ClientError as error:
            raise_unless_lease_gone(error, session)
            raise ClusterUnavailableError(f"etcd at {self.endpoint}: campaign: our lease is gone") from error
        (_, kv), = responses[-1]
        return leader_from_kv(kv)

    @telemetry.traced("etcd.handover")
    async def handover(self, term: int, from_member_id: str,
                       heirs: collections.abc.Sequence[Member] | None = None) -> LeaderInfo | None:
        """A leader's graceful stop: makes another live scheduler member (the
        longest registered: see heir_order) the leader, under that member's
        lease, in one transaction fenced on `term` and on the heir's member
        key being the registration seen. `heirs`: the scheduler members as
        the caller last saw them (so that the handover takes one round trip);
        if none of them takes the term, they are read again once. Returns the
        new leader, None if the handover did not happen (term over, no live
        heir: the caller resigns as usual)."""
        if heirs is not None:
            outcome = await self._hand_to_oldest(term, from_member_id, heirs)
            if outcome is not _NO_HEIR:
                return outcome
        _, snapshot = await self._read_prefix(self.keys.member("scheduler", ""))
        outcome = await self._hand_to_oldest(term, from_member_id, snapshot.members)
        return None if outcome is _NO_HEIR else outcome

    async def _hand_to_oldest(self, term: int, from_member_id: str,
                              heirs: collections.abc.Sequence[Member]) -> "LeaderInfo | None | object":
        """Tries the heirs in heir_order; the new leader, None once the term is
        over, or _NO_HEIR if none of them (still) holds that registration."""
        leader_key, txn = self.keys.leader.encode(), self._etcd.transactions
        for heir in heir_order(heirs, from_member_id):
            member_key = self.keys.member(heir.role, heir.member_id).encode()
            value = leader_value(heir.member_id, heir.address)
            try:
                is_done, responses = await self._retry(
                    "handover", self._etcd.transaction,
                    compare=[self.fence(term), txn.mod(member_key) == heir.revision],
                    success=[txn.put(leader_key, value, lease=heir.lease_id), txn.get(leader_key)],
                    failure=[txn.get(leader_key)])
            except aetcd.ClientError as error:
                if not is_lease_gone(error):
                    raise
                continue  # the heir's lease ended after we saw its member key
            kv = responses[-1][0][1] if responses[-1] else None
            leader = None if kv is None else leader_from_kv(kv)
            if is_done or (kv is not None and kv.value == value):  # or a retry whose first reply was lost
                log.info("term %d handed over to %s (term %d)", term, heir.member_id, leader.term)
                return leader
            if leader is None or leader.term != term:
                return None  # our term is over
        return _NO_HEIR

    @telemetry.traced("etcd.resign")
    async def resign(self, term: int) -> None:
        """Deletes /leader if `term` is still the current term."""
        txn = self._etcd.transactions
        await self._retry("resign", self._etcd.transaction, compare=[self.fence(term)],
                          success=[txn.delete(self.keys.leader.encode())], failure=[])

    async def depose_leader(self, leader: LeaderInfo) -> bool:
        """Revokes the lease of a leader found dead, so that its term ends now,
        but only if etcd answers us and `/leader` still holds that term under
        that lease: a follower cut off from etcd, or one that saw an old
        leader, deposes nobody. One attempt of each call, each bounded by the
        call deadline. Returns True if the lease was revoked by this call."""
        try:
            got = await self._call("depose", self._etcd.get, self.keys.leader.encode())
            if got is None or (got.mod_revision, got.lease) != (leader.term, leader.lease_id):
                log.info("not deposing leader %s (term %d): /leader has changed", leader.member_id, leader.term)
                return False
            await self._call("depose", self._etcd.revoke_lease, leader.lease_id)
            log.warning("revoked the lease of leader %s (term %d)", leader.member_id, leader.term)
        except ETCD_ERRORS as error:  # etcd unreachable, or another follower revoked it first
            log.info("did not depose leader %s (term %d): %r", leader.member_id, leader.term, error)
            return False
        return True

    async def _read_leader(self) -> tuple[int, LeaderInfo | None]:
        revision, snapshot = await self._read_prefix(self.keys.leader)
        return revision, snapshot.leader

