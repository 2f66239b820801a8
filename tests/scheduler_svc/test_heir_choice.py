"""Who a graceful handover makes leader, and what a new term costs the heir.

The heir is the longest registered follower, not the lowest member id: a
replica just restarted (the usual case right after a rolling restart) is
still starting and would answer as the new leader late. A replica
registers only once its view of the cluster is built, and the leader plans
nothing when only a scheduler comes or goes (the old leader leaving right
after a handover, among them)."""

import asyncio

from scheduler_svc.cluster_view import ClusterView
from scheduler_svc.election import Leadership
from scheduler_svc.state import lead_groups
from services.cluster import ClusterClient, ClusterSnapshot, Member, cancel_and_wait
from services.cluster.leadership import heir_order
from tests.bounded import eventually, run
from tests.scheduler_svc.candidates import Candidate, leaders, start_three


def _scheduler(member_id: str, revision: int, lease_id: int = 1, role: str = "scheduler") -> Member:
    return Member(member_id, role, f"127.0.0.1:{revision}", lease_id=lease_id, revision=revision)


def test_heir_order_is_the_longest_registered_first():
    members = [_scheduler("s0", revision=40), _scheduler("s1", revision=7), _scheduler("s2", revision=3),
               _scheduler("s3", revision=12), _scheduler("s4", revision=2, lease_id=0),
               _scheduler("g0", revision=1, role="gateway")]
    # s2 is the leader itself; s4 has no lease (a record made outside etcd); g0 is no scheduler.
    assert [m.member_id for m in heir_order(members, "s2")] == ["s1", "s3", "s0"]
    assert heir_order([_scheduler("s0", revision=5)], "s0") == []


def test_handover_passes_over_a_just_restarted_follower_with_the_lowest_id(etcd, key_prefix):
    """s0 and s1 follow; s0 (the lowest id) restarts, so it registers anew:
    the term goes to the follower registered longer, whatever its id."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        restarted_id, warm_id = sorted(c.member_id for c in candidates if c is not old)
        await next(c for c in candidates if c.member_id == restarted_id).stop()
        restarted = await Candidate(etcd.endpoint, key_prefix, restarted_id).start()

        async def registered_again() -> bool:
            members = await old.client.list_members("scheduler")
            return any(m.member_id == restarted_id and m.lease_id == restarted.client.session.lease_id
                       for m in members)

        assert await eventually(registered_again)
        new = await old.election.hand_over(old.task)
        await old.client.close()
        assert new is not None and new.member_id == warm_id
        warm = next(c for c in candidates if c.member_id == warm_id)
        assert await eventually(lambda: warm.election.is_leader)
        assert warm.terms == [new.term] and restarted.terms == []
        for c in (warm, restarted):
            await c.stop()

    run(body())


class _Watching:
    """A client whose prefix watch yields the given snapshots, then waits (or raises `error`)."""

    def __init__(self, snapshots: list, error: Exception | None = None):
        self._snapshots, self._error = snapshots, error
        self.session = None
        self.is_closed = False

    async def watch_snapshot(self):
        for snapshot in self._snapshots:
            await asyncio.sleep(0.05)
            yield snapshot
        if self._error is not None:
            raise self._error
        await asyncio.Event().wait()


def test_view_is_warm_once_its_first_snapshot_is_in_and_says_why_it_never_was():
    snapshot = ClusterSnapshot(revision=3, leader=None, members=[], groups=[], ready={})

    async def body():
        view = ClusterView(_Watching([snapshot]))
        running = asyncio.create_task(view.run())
        await view.wait_warm(running)  # returns only once the snapshot is in
        assert view._snapshot is snapshot and not running.done()
        assert await cancel_and_wait([running], 2.0)

        broken = ClusterView(_Watching([], error=ValueError("bad prefix")))
        running = asyncio.create_task(broken.run())
        try:
            await broken.wait_warm(running)
        except ValueError as error:
            assert "bad prefix" in str(error)
        else:
            raise AssertionError("wait_warm returned for a view that never got a snapshot")

    run(body())


def test_the_leader_plans_again_for_experts_but_not_for_schedulers_coming_and_going(etcd, key_prefix):
    """The old leader's member key going away after a handover (or a
    follower joining) lands in the new leader's first milliseconds; it must
    cost no snapshot read and no plan. A gateway or an expert joining does."""
    async def body():
        client, other = (ClusterClient(etcd.endpoint, prefix=key_prefix) for _ in range(2))
        for c in (client, other):
            await c.connect()
        await client.register("scheduler", "s0", "127.0.0.1:1", ttl=2)
        leader = await client.campaign("s0", "127.0.0.1:1")
        reads = []
        snapshot_with_failures = client.snapshot_with_failures

        async def counted():
            reads.append(asyncio.get_running_loop().time())
            return await snapshot_with_failures()

        client.snapshot_with_failures = counted
        leading = asyncio.create_task(lead_groups(client, Leadership(leader.term, leader.lease_id, 0.0), 1))
        assert await eventually(lambda: reads)  # the term's first plan (or two: each watch's first state)
        await asyncio.sleep(0.3)
        num_reads = len(reads)
        await other.register("scheduler", "s1", "127.0.0.1:2", ttl=2)
        await other.close()  # s1 leaves again
        await asyncio.sleep(0.3)
        assert len(reads) == num_reads
        gateway, expert = (ClusterClient(etcd.endpoint, prefix=key_prefix) for _ in range(2))
        await gateway.connect()
        await gateway.register("gateway", "g0", "127.0.0.1:3", ttl=2)
        assert await eventually(lambda: len(reads) == num_reads + 1)
        await expert.connect()
        await expert.register("expert", "e0", "127.0.0.1:4", {"rendezvous_port": 29500}, ttl=2)
        assert await eventually(lambda: len(reads) == num_reads + 2)

        async def has_group() -> bool:
            return [(g.gateway_id, g.ranks[0].member_id) for g in await client.list_groups()] == [("g0", "e0")]

        assert await eventually(has_group)  # and that plan was written
        assert await cancel_and_wait([leading], 2.0)
        for c in (expert, gateway, client):
            await c.close()

    run(body())
