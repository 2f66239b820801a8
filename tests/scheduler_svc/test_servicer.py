"""GetClusterState's view of leadership: a replica is the leader only once its election holds the term."""

from scheduler_svc.servicer import cluster_state_pb
from services.cluster import ClusterSnapshot, LeaderInfo, Member

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
