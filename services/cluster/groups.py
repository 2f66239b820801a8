"""GroupOps: worker group records, their ready keys and failure reports.

The leader writes groups in transactions fenced on its term
(LeaderKeyOps.fence). The group watch ignores (and logs) a record of a
group that carries an older leader term than one already seen for that
group: no deposed leader's assignment is ever acted on.
"""

import collections.abc
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator

import aetcd
from aetcd import utils as etcd_utils

from services import telemetry
from services.cluster.connection import UNSET
from services.cluster.leadership import LeaderKeyOps
from services.cluster.records import ClusterSnapshot, GroupAssignment
from services.cluster.session import raise_unless_lease_gone

log = logging.getLogger(__name__)

_STALE = object()  # a group record older than the newest seen for its group


class _GroupTerms:
    """The newest term seen per group id by one member's group watch."""

    def __init__(self, member_id: str):
        self.member_id = member_id
        self._latest: dict[str, int] = {}
        self._warned: set[tuple[str, int]] = set()

    def current(self, groups: collections.abc.Iterable[GroupAssignment]) -> Any:
        """The member's group in `groups` (None if it has none), or _STALE if
        its only record there is stale."""
        mine = [g for g in groups if g.has_member(self.member_id)]
        fresh = []
        for group in mine:
            latest = self._latest.get(group.group_id, 0)
            if group.term >= latest:
                fresh.append(group)
                self._latest[group.group_id] = group.term
            elif (group.group_id, group.term) not in self._warned:
                self._warned.add((group.group_id, group.term))
                log.warning("ignoring a stale record of group %s for %s: written in term %d, but term %d "
                            "was already seen for it", group.group_id, self.member_id, group.term, latest)
        if fresh:
            return fresh[0]
        return _STALE if mine else None


class GroupOps(LeaderKeyOps):
    """Reads, watches and fenced writes of the worker groups."""

    async def list_groups(self) -> list[GroupAssignment]:
        return (await self._read_prefix(self.keys.groups))[1].groups

    async def get_group(self, group_id: str) -> GroupAssignment | None:
        got = await self._retry("get_group", self._etcd.get, self.keys.group(group_id).encode())
        return None if got is None else GroupAssignment.from_json(got.value)

    async def ready_ranks(self, group_id: str, epoch: int) -> set[int]:
        """Ranks whose ready key for (group_id, epoch) exists."""
        snapshot = (await self._read_prefix(self.keys.ready_dir(group_id, epoch)))[1]
        return set(snapshot.ready.get((group_id, epoch), {}))

    async def watch_group_for_member(self, member_id: str) -> AsyncIterator[GroupAssignment | None]:
        """The group holding member_id (as a rank or as the gateway): now if it
        has one, then on every change; None once it has lost its group.

        A record of a group whose term is older than one this watch has
        already seen for that group id is stale (a deposed leader's, or etcd
        restored from an old backup): it is logged and ignored, as if that
        change had not happened. Expert services and gateways follow their
        assignment through this watch, so none of them acts on one."""
        terms = _GroupTerms(member_id)
        last = UNSET
        async with contextlib.aclosing(self._watch_state(
                self.keys.groups, lambda: self._read_prefix(self.keys.groups), key=lambda s: s.groups)) as states:
            async for groups in states:
                group = terms.current(groups)
                if group is _STALE or group == last:
                    continue
                if group is not None or last is not UNSET:
                    yield group
                last = group

    async def watch_ready(self, group_id: str, epoch: int) -> AsyncIterator[set[int]]:
        """The ready ranks of (group_id, epoch) now and after each change."""
        prefix = self.keys.ready_dir(group_id, epoch)
        async with contextlib.aclosing(self._watch_state(
                prefix, lambda: self._read_prefix(prefix),
                key=lambda s: set(s.ready.get((group_id, epoch), {})))) as states:
            async for ready in states:
                yield ready

    async def wait_group_ready(self, group: GroupAssignment) -> None:
        """Returns once every rank of the group has marked itself ready."""
        async with contextlib.aclosing(self.watch_ready(group.group_id, group.epoch)) as states:
            async for ready in states:
                if ready >= set(range(group.world_size)):
                    return

    @telemetry.traced("etcd.mark_rank_ready")
    async def mark_rank_ready(self, group_id: str, epoch: int, rank: int, member_id: str) -> bool:
        """Puts /ready/<group>/<epoch>/<rank> under this member's lease, only
        while that exact assignment (epoch, rank -> member_id) is current.
        Returns False if it is not (the group moved on; nothing written)."""
        group_key = self.keys.group(group_id).encode()
        value = json.dumps({"member_id": member_id}).encode()
        while True:
            session = await self.live_session()
            got = await self._retry("mark_rank_ready", self._etcd.get, group_key)
            group = None if got is None else GroupAssignment.from_json(got.value)
            if group is None or group.epoch != epoch or group.rank_of(member_id) != rank:
                return False
            try:
                is_written, _ = await self._retry(
                    "mark_rank_ready", self._etcd.transaction,
                    compare=[self._etcd.transactions.mod(group_key) == got.mod_revision],
                    success=[self._etcd.transactions.put(
                        self.keys.ready(group_id, epoch, rank).encode(), value, lease=session.lease_id)],
                    failure=[],
                )
            except aetcd.ClientError as error:
                raise_unless_lease_gone(error, session)
                continue  # under the next session's lease
            if is_written:
                return True  # else the group key changed under us: check it again

    @telemetry.traced("etcd.write_groups")
    async def write_groups(self, term: int, put: collections.abc.Sequence[GroupAssignment] = (),
                           delete: collections.abc.Sequence[str] = (),
                           stale_epochs: collections.abc.Sequence[tuple[str, int]] = ()) -> bool:
        """Puts and deletes groups in one transaction fenced on the term; a
        deleted group's ready and failure keys go with it, and so do those of
        each (group_id, epoch) in stale_epochs. Returns False (nothing
        written) if the term is no longer current."""
        txn = self._etcd.transactions
        ops = [txn.put(self.keys.group(g.group_id).encode(), g.to_json()) for g in put]
        prefixes = [p for i in delete for p in (self.keys.ready_dir(i), self.keys.failure_dir(i))]
        prefixes += [p for i, e in stale_epochs for p in (self.keys.ready_dir(i, e), self.keys.failure_dir(i, e))]
        ops += [txn.delete(self.keys.group(group_id).encode()) for group_id in delete]
        ops += [txn.delete(p.encode(), range_end=etcd_utils.prefix_range_end(p.encode())) for p in prefixes]
        is_written, _ = await self._retry("write_groups", self._etcd.transaction,
                                          compare=[self.fence(term)], success=ops, failure=[])
        return is_written

    @telemetry.traced("etcd.report_rank_failure")
    async def report_rank_failure(self, group_id: str, epoch: int, rank: int, member_id: str,
                                  reason: str) -> None:
        """Puts /failures/<group>/<epoch>/<rank>: this rank's group failed under it (a
        collective timed out or errored) and the rank is about to exit. Written
        without a lease, so it survives the rank; retried like every one-shot call."""
        value = json.dumps({"group_id": group_id, "epoch": epoch, "rank": rank, "member_id": member_id,
                            "reason": reason, "reported_at": time.time()}).encode()
        await self._retry("report_rank_failure", self._etcd.put,
                          self.keys.failure(group_id, epoch, rank).encode(), value)

    async def snapshot_with_failures(self) -> tuple[ClusterSnapshot, set[tuple[str, int]]]:
        """The whole state at one revision, and the (group_id, epoch) that have a failure report."""
        result = await self._retry("snapshot", self._etcd.get_prefix, self.keys.root.encode())
        prefix = self.keys.failure_dir()
        failed = set()
        for kv in result:
            key = kv.key.decode()
            if key.startswith(prefix):
                with contextlib.suppress(ValueError):
                    group_id, epoch, _rank = key[len(prefix):].split("/")
                    failed.add((group_id, int(epoch)))
        return self.keys.parse(result.header.revision, result), failed

    async def watch_failures(self) -> AsyncIterator[set[str]]:
        """The keys of the failure reports now and after each change."""
        prefix = self.keys.failure_dir()

        async def read() -> tuple[int, set[str]]:
            result = await self._retry("read", self._etcd.get_prefix, prefix.encode())
            return result.header.revision, {kv.key.decode() for kv in result}

        async with contextlib.aclosing(self._watch_state(prefix, read)) as states:
            async for keys in states:
                yield keys
