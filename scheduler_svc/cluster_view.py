"""The cluster state as this replica's watch of the whole prefix last saw it.

GetClusterState answers from it, not from an etcd read per call: during a
failover the new leader's first answers would otherwise queue behind the
new term's start-up reads, and a client polling the replicas would add a
read of everything per poll. A replica whose etcd session is not live (etcd
unreachable, or the keepalive failing) reads etcd instead, so it answers
UNAVAILABLE rather than from a view it cannot vouch for.
"""

import asyncio
import contextlib
from collections.abc import Callable

from services.cluster import ClusterClient, ClusterSnapshot


class ClusterView:
    """The cluster state as this replica's watch of the prefix last saw it
    (ClusterClient.watch_snapshot): one revision, milliseconds behind etcd."""

    def __init__(self, client: ClusterClient, on_change: Callable[[ClusterSnapshot], None] = lambda _: None):
        self._client = client
        self._on_change = on_change
        self._snapshot: ClusterSnapshot | None = None
        self._is_warm = asyncio.Event()  # the first snapshot is in

    async def run(self) -> None:
        """Follows the prefix until cancelled (or the client is closed)."""
        async with contextlib.aclosing(self._client.watch_snapshot()) as snapshots:
            async for snapshot in snapshots:
                self._snapshot = snapshot
                self._on_change(snapshot)
                self._is_warm.set()

    async def wait_warm(self, running: asyncio.Task) -> None:
        """Returns once the first snapshot is in; `running` is this view's
        run(), whose error is raised if it ends first. The replica registers
        (and may be handed a term) only then: a new leader never answers late
        because its view is still being built."""
        warm = asyncio.create_task(self._is_warm.wait(), name="cluster-view-warm")
        try:
            await asyncio.wait([warm, running], return_when=asyncio.FIRST_COMPLETED)
        finally:
            warm.cancel()
        if not self._is_warm.is_set():
            running.result()  # raises what run() raised
            raise RuntimeError("the cluster view ended before its first snapshot")

    async def read(self) -> ClusterSnapshot:
        """The watched snapshot, else (before the first one, or while the
        session is not live) one read of etcd: ClusterUnavailableError if etcd
        does not answer, rather than a view this replica cannot vouch for."""
        snapshot = self.current()
        return snapshot if snapshot is not None else await self._client.snapshot()

    def current(self) -> ClusterSnapshot | None:
        """The watched snapshot; None before the first one, and while this
        replica's session is not live (its watch may be cut off as well)."""
        session = self._client.session
        if session is None or session.lost.is_set() or self._client.is_closed:
            return None
        return self._snapshot
