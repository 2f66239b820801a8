"""GetClusterState: a replica is the leader only once its election holds the term; answers come from the view."""

import asyncio

from moe.scheduler.v1 import scheduler_pb2
from scheduler_svc.cluster_view import ClusterView
from scheduler_svc.election import Leadership
from scheduler_svc.servicer import SchedulerServicer, cluster_state_pb
from services.cluster import ClusterClient, ClusterSnapshot, LeaderInfo, Member, cancel_and_wait
from tests.bounded import eventually, run

SNAPSHOT = ClusterSnapshot(revision=12, leader=LeaderInfo("s1", "127.0.0.1:1", term=11, elected_at=5.0, lease_id=7),
                           members=[Member("s1", "scheduler", "127.0.0.1:1", lease_id=7, revision=3)],
                           groups=[], ready={})


def test_is_leader_needs_etcd_and_the_election_to_agree_on_the_term():
    taking_over = cluster_state_pb(SNAPSHOT, "s1", held_term=None)  # etcd names s1, its election has not seen it yet
    assert not taking_over.is_leader
    assert (taking_over.leader.member_id, taking_over.leader.term) == ("s1", 11)
    assert cluster_state_pb(SNAPSHOT, "s1", held_term=11).is_leader
    assert not cluster_state_pb(SNAPSHOT, "s1", held_term=4).is_leader  # an older term it has yet to step down from
    assert not cluster_state_pb(SNAPSHOT, "s0", held_term=11).is_leader


def test_get_cluster_state_answers_from_the_view_while_the_session_is_live(etcd, key_prefix):
    """No etcd read per answer while the replica's session is live; once it is
    not, the view (frozen here: its watch cancelled) is not trusted and etcd is read."""
    async def body():
        client, other = ClusterClient(etcd.endpoint, prefix=key_prefix), ClusterClient(etcd.endpoint, prefix=key_prefix)
        for c in (client, other):
            await c.connect()
        await client.register("scheduler", "s0", "127.0.0.1:1", ttl=2)
        leader = await client.campaign("s0", "127.0.0.1:1")
        view = ClusterView(client)
        servicer = SchedulerServicer(client, "s0", lambda: Leadership(leader.term, leader.lease_id, 0.0), view)
        watching = asyncio.create_task(view.run())
        assert await eventually(lambda: view.current() is not None and view.current().leader == leader)
        answer = await servicer.GetClusterState(scheduler_pb2.GetClusterStateRequest(), None)
        assert answer.is_leader and answer.leader.term == leader.term
        assert await cancel_and_wait([watching], 2.0)  # the view stops here
        await other.register("expert", "e0", "127.0.0.1:2", ttl=2)
        answer = await servicer.GetClusterState(scheduler_pb2.GetClusterStateRequest(), None)
        assert [m.member_id for m in answer.members] == ["s0"]  # from the view
        client.session.lost.set()
        answer = await servicer.GetClusterState(scheduler_pb2.GetClusterStateRequest(), None)
        assert [m.member_id for m in answer.members] == ["e0", "s0"]  # read from etcd
        await other.close()
        await client.close()

    run(body())
