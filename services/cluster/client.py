"""ClusterClient: a process's view of the mesh's control-plane state in etcd; one per process.

    client = ClusterClient("127.0.0.1:2379")
    await client.connect()
    await client.register("expert", "e0", "10.0.0.5:50051", {"rendezvous_port": 29500})
    async for group in client.watch_group_for_member("e0"):
        ...  # a GroupAssignment, or None once the member has lost its group
    await client.close()
"""

import contextlib
import json
import logging
from typing import AsyncIterator

from aetcd import rpc as etcd_rpc

from services.cluster.connection import ETCD_ERRORS
from services.cluster.groups import GroupOps
from services.cluster.records import ClusterSnapshot, Member, member_from_kv

log = logging.getLogger(__name__)


class ClusterClient(GroupOps):
    """Session, membership, leader key and worker groups over one etcd connection.

    The layers, each a module of services/cluster/: EtcdConnection (bounded
    calls and watches), MemberSession (the lease), LeaderKeyOps (election,
    fencing, handover), GroupOps (group records); this class adds the whole
    snapshot and the member list."""

    async def __aenter__(self) -> "ClusterClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def snapshot(self) -> ClusterSnapshot:
        """Everything under the prefix, read at one revision."""
        result = await self._retry("snapshot", self._etcd.get_prefix, self.keys.root.encode())
        return self.keys.parse(result.header.revision, result)

    async def watch_snapshot(self) -> AsyncIterator[ClusterSnapshot]:
        """Everything under the prefix now and after each change, each at one
        revision: the changes are applied from the watch's events, so a
        replica that answers reads from it costs etcd no read per answer.
        It lags etcd by one watch delivery (milliseconds)."""
        kv_by_key: dict[bytes, object] = {}

        async def read() -> tuple[int, ClusterSnapshot]:
            result = await self._retry("snapshot", self._etcd.get_prefix, self.keys.root.encode())
            kv_by_key.clear()
            kv_by_key.update((kv.key, kv) for kv in result)
            return result.header.revision, self.keys.parse(result.header.revision, result)

        def after(events: list) -> ClusterSnapshot:
            for event in events:
                if event.type == etcd_rpc.Event.DELETE:
                    kv_by_key.pop(event.kv.key, None)
                else:
                    kv_by_key[event.kv.key] = event.kv
            # The last event's revision is the newest (a delete event's kv carries its revision too).
            return self.keys.parse(events[-1].kv.mod_revision, kv_by_key.values())

        async with contextlib.aclosing(self._watch_state(self.keys.root, read, from_events=after)) as states:
            async for snapshot in states:
                yield snapshot

    async def list_members(self, role: str | None = None) -> list[Member]:
        return (await self._read_prefix(self._members_prefix(role)))[1].members

    async def watch_members(self, role: str | None = None) -> AsyncIterator[list[Member]]:
        """The members (of one role, or all) now and after each change,
        re-registrations under a new lease included. A change is applied from
        the watch's events rather than read again: a leader's several
        member watches cost no round trips when a member comes or goes."""
        prefix = self._members_prefix(role)
        by_key: dict[bytes, Member] = {}

        async def read() -> tuple[int, list[Member]]:
            revision, snapshot = await self._read_prefix(prefix)
            by_key.clear()
            by_key.update((self.keys.member(m.role, m.member_id).encode(), m) for m in snapshot.members)
            return revision, snapshot.members

        def after(events: list) -> list[Member]:
            for event in events:
                if event.type == etcd_rpc.Event.DELETE:
                    by_key.pop(event.kv.key, None)
                    continue
                try:
                    by_key[event.kv.key] = member_from_kv(event.kv)
                except (ValueError, KeyError, TypeError) as error:
                    log.warning("skipping malformed etcd key %s: %r", event.kv.key.decode(), error)
            return sorted(by_key.values(), key=lambda m: (m.role, m.member_id))

        async with contextlib.aclosing(self._watch_state(prefix, read, from_events=after)) as states:
            async for members in states:
                yield members

    async def depose_member(self, role: str, member_id: str, address: str) -> bool:
        """Revokes the lease of a member found dead (its address refuses
        connections), so that its key goes now rather than after the TTL; only
        if its member key still holds that address (a restarted process
        registered anew elsewhere is left alone). One attempt of each call.
        Returns True if the lease was revoked by this call."""
        try:
            got = await self._call("depose", self._etcd.get, self.keys.member(role, member_id).encode())
            if got is None or not got.lease or json.loads(got.value).get("address") != address:
                return False
            await self._call("depose", self._etcd.revoke_lease, got.lease)
            log.warning("revoked the lease of %s %s at %s", role, member_id, address)
        except ETCD_ERRORS as error:
            log.info("did not depose %s %s: %r", role, member_id, error)
            return False
        return True

    def _members_prefix(self, role: str | None) -> str:
        return self.keys.members + (f"{role}/" if role else "")


@contextlib.asynccontextmanager
async def registered(endpoint: str, role: str, member_id: str, address: str, *, info: dict | None = None,
                     ttl: int = 2, prefix: str = "/moemesh",
                     reach_timeout_s: float = 10.0) -> AsyncIterator[ClusterClient]:
    """A client connected (waiting for etcd as long as it takes, once an endpoint
    accepts connections: see EtcdConnection.connect) and registered for the life
    of the block; leaving it revokes the lease."""
    client = ClusterClient(endpoint, prefix=prefix, reach_timeout_s=reach_timeout_s)
    try:
        await client.connect(wait_s=None)
        await client.register(role, member_id, address, info, ttl=ttl)
        yield client
    finally:
        await client.close()
