"""Scheduler replicas without gRPC, for election and failover tests on a real etcd.

A Candidate is a client, an election and a lead loop that records its terms
and runs until cancelled; its leader probe (if any) is a FakeProbe, which
answers from a dict instead of a health check.
"""

import asyncio
import time

from scheduler_svc.election import Election, LeaderProbe, Leadership
from services.cluster import ClusterClient, cancel_and_wait
from tests.bounded import eventually


class FakeProbe:
    """Health checks answered from `alive` (address -> bool; absent: alive),
    each after delay_s."""

    def __init__(self, delay_s: float = 0.001):
        self.alive: dict[str, bool] = {}
        self.delay_s = delay_s

    async def __call__(self, address: str) -> bool:
        await asyncio.sleep(self.delay_s)
        return self.alive.get(address, True)

    def policy(self, interval_s: float = 0.05, misses: int = 2, max_answer_s: float = 0.3) -> LeaderProbe:
        return LeaderProbe(self, interval_s=interval_s, misses=misses, max_answer_s=max_answer_s)


class Candidate:
    """One replica. `elected` and `stepped_down` hold (term, time.monotonic())."""

    def __init__(self, endpoint: str, prefix: str, member_id: str, probe: LeaderProbe | None = None):
        self.member_id = member_id
        self.address = f"127.0.0.1:{member_id}"
        self.client = ClusterClient(endpoint, prefix=prefix, call_timeout_s=1.0)
        self.election = Election(self.client, member_id, self.address, probe=probe)
        self.elected: list[tuple[int, float]] = []
        self.stepped_down: list[tuple[int, float]] = []
        self.task: asyncio.Task | None = None

    @property
    def terms(self) -> list[int]:
        return [term for term, _ in self.elected]

    async def start(self) -> "Candidate":
        await self.client.connect()
        await self.client.register("scheduler", self.member_id, self.address, ttl=1)
        self.task = asyncio.create_task(self.election.run(self._lead))
        return self

    async def _lead(self, leadership: Leadership) -> None:
        self.elected.append((leadership.term, time.monotonic()))
        try:
            await asyncio.Event().wait()
        finally:
            self.stepped_down.append((leadership.term, time.monotonic()))

    async def stop(self) -> None:
        """What a replica does on SIGTERM: ends its election, then closes (revokes) its client."""
        assert await cancel_and_wait([self.task], 5.0), f"{self.member_id}'s election ignored its cancellation"
        await self.client.close()
        assert self.client.is_closed and not self.election.is_leader



def leaders(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.election.is_leader]


async def start_all(candidates: list[Candidate]) -> list[Candidate]:
    """Starts the candidates; returns them once exactly one leads, and still does a moment later."""
    await asyncio.gather(*(c.start() for c in candidates))
    assert await eventually(lambda: len(leaders(candidates)) == 1)
    await asyncio.sleep(0.3)
    assert len(leaders(candidates)) == 1
    return candidates


async def start_three(etcd, prefix: str, probe: LeaderProbe | None = None) -> list[Candidate]:
    return await start_all([Candidate(etcd.endpoint, prefix, f"s{i}", probe) for i in range(3)])
