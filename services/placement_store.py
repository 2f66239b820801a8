"""Expert placements in etcd: the committed placement of a group, and which ranks have staged it.

| key | value (JSON) | written by | lease |
|---|---|---|---|
| `/placement/<group_id>` | `Placement.to_dict()` plus `"term"` | scheduler leader, fenced by term and epoch | none |
| `/placement_ready/<group_id>/<epoch>/<rank>` | `{"member_id"}` | the rank, once it has loaded that epoch's replicas | the rank's |

The placement epoch is the group's own counter of committed placements,
separate from the group record's epoch (the group's formation). A commit
succeeds only if `/leader` still has the proposer's term as its create
revision and the placement key is unchanged since the proposal's epoch was
read: a deposed leader or a proposal computed against an older placement
writes nothing. Uses the ClusterClient's etcd connection, retries and
watches (its internals: this module is its placement-specific extension).
"""

import contextlib
import json
from collections.abc import AsyncIterator

import aetcd

from services.cluster import ClusterClient
from services.cluster.session import raise_unless_lease_gone as _raise_unless_lease_gone
from services.placement import Placement


class StaleProposalError(Exception):
    """A proposal against an epoch that is no longer the group's current one."""


class LeaderTermError(Exception):
    """The proposer's term is no longer the leader's."""


class PlacementStore:
    """Reads, commits and watches placements through one ClusterClient."""

    def __init__(self, client: ClusterClient):
        self._client = client
        self._root = client.keys.root

    def key(self, group_id: str) -> str:
        return f"{self._root}placement/{group_id}"

    def ready_dir(self, group_id: str, epoch: int | None = None) -> str:
        return f"{self._root}placement_ready/{group_id}/" + ("" if epoch is None else f"{epoch}/")

    async def _read(self, group_id: str) -> tuple[int, Placement | None, int]:
        """(revision, placement or None, its mod revision or 0)."""
        c = self._client
        result = await c._retry("get_placement", c._etcd.get_prefix, self.key(group_id).encode())
        for kv in result:
            if kv.key.decode() == self.key(group_id):
                return result.header.revision, Placement.from_dict(json.loads(kv.value)), kv.mod_revision
        return result.header.revision, None, 0

    async def get(self, group_id: str) -> Placement | None:
        """The group's committed placement, None before the first commit."""
        return (await self._read(group_id))[1]

    async def commit(self, term: int, group_id: str, expected_epoch: int, placement: Placement) -> Placement:
        """Writes `placement` as epoch expected_epoch + 1, fenced on the term and
        on the current epoch. Raises StaleProposalError, LeaderTermError."""
        c = self._client
        _, current, mod_revision = await self._read(group_id)
        current_epoch = 0 if current is None else current.epoch
        if current_epoch != expected_epoch:
            raise StaleProposalError(f"group {group_id!r} is at placement epoch {current_epoch}, "
                                     f"the proposal was made against epoch {expected_epoch}")
        committed = Placement(placement.num_experts, placement.num_ranks, placement.num_spare_slots,
                              placement.layers, epoch=expected_epoch + 1)
        value = json.dumps({**committed.to_dict(), "term": term}).encode()
        txn, key = c._etcd.transactions, self.key(group_id).encode()
        is_written, _ = await c._retry(
            "commit_placement", c._etcd.transaction,
            compare=[c.fence(term), txn.mod(key) == mod_revision],
            success=[txn.put(key, value)], failure=[])
        if is_written:
            return committed
        leader = await c.get_leader()
        if leader is None or leader.term != term:
            raise LeaderTermError(f"term {term} is no longer the leader's")
        raise StaleProposalError(f"the placement of group {group_id!r} changed during the proposal")

    async def watch(self, group_id: str) -> AsyncIterator[Placement | None]:
        """The group's placement now and after each change."""
        async def read():
            revision, placement, _ = await self._read(group_id)
            return revision, placement

        async with contextlib.aclosing(self._client._watch_state(self.key(group_id), read, is_prefix=False)) as states:
            async for placement in states:
                yield placement

    async def mark_ready(self, group_id: str, epoch: int, rank: int, member_id: str) -> None:
        """Puts this rank's ready key for the placement epoch under its session lease."""
        c = self._client
        value = json.dumps({"member_id": member_id}).encode()
        while True:
            session = await c.live_session()
            try:
                await c._retry("mark_placement_ready", c._etcd.put, f"{self.ready_dir(group_id, epoch)}{rank}".encode(),
                               value, lease=session.lease_id)
                return
            except aetcd.ClientError as error:
                _raise_unless_lease_gone(error, session)

    async def _read_ready(self, group_id: str) -> tuple[int, dict[int, set[int]]]:
        c, prefix = self._client, self.ready_dir(group_id)
        result = await c._retry("read_placement_ready", c._etcd.get_prefix, prefix.encode())
        ready: dict[int, set[int]] = {}
        for kv in result:
            epoch, rank = kv.key.decode()[len(prefix):].split("/")
            ready.setdefault(int(epoch), set()).add(int(rank))
        return result.header.revision, ready

    async def ready(self, group_id: str) -> dict[int, set[int]]:
        """Per placement epoch, the ranks that have staged it."""
        return (await self._read_ready(group_id))[1]

    async def watch_ready(self, group_id: str) -> AsyncIterator[dict[int, set[int]]]:
        """Per placement epoch, the ranks that have staged it: now and after each change."""
        async with contextlib.aclosing(self._client._watch_state(
                self.ready_dir(group_id), lambda: self._read_ready(group_id))) as states:
            async for ready in states:
                yield ready
