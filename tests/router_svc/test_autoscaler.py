"""The scaling loop against a fake cluster and a fake scheduler leader: what it proposes, and when."""

import asyncio

import pytest

from router_svc.autoscaler import Autoscaler, Committed, Proposal, ProposalError
from router_svc.config import RouterConfig
from router_svc.windows import SlidingWindows
from services.cluster import ClusterSnapshot, GroupAssignment, LeaderInfo, Member, RankInfo
from services.placement import EMPTY, Placement
from tests.bounded import run

LEADER = LeaderInfo("s0", "127.0.0.1:7000", term=7, elected_at=0.0)


class FakeCluster:
    """One group of two ranks, each with one spare slot per layer."""

    def __init__(self, leader: LeaderInfo | None = LEADER):
        self.leader = leader
        ranks = [RankInfo(r, f"e{r}", f"127.0.0.1:{6000 + r}") for r in range(2)]
        members = [Member(f"e{r}", "expert", f"127.0.0.1:{6000 + r}", {"num_spare_expert_slots": 1})
                   for r in range(2)]
        self.snapshot_value = ClusterSnapshot(1, leader, members, [GroupAssignment("g0", 1, 7, 2, "", ranks)], {})

    async def snapshot(self) -> ClusterSnapshot:
        return self.snapshot_value

    async def get_leader(self) -> LeaderInfo | None:
        return self.leader


class FakeStore:
    def __init__(self):
        self.placements: dict[str, Placement] = {}

    async def get(self, group_id: str) -> Placement | None:
        return self.placements.get(group_id)


class FakeProposer:
    """Records every proposal; fails the first `num_failures` of them."""

    def __init__(self, num_failures: int = 0):
        self.calls: list[tuple[str, Proposal]] = []
        self.num_failures = num_failures

    async def propose(self, address: str, proposal: Proposal) -> Committed:
        self.calls.append((address, proposal))
        if len(self.calls) <= self.num_failures:
            raise ProposalError("UNAVAILABLE: the leader is away")
        return Committed(epoch=proposal.expected_epoch + 1, term=proposal.term)


def hot_expert_0(now: list[float]) -> SlidingWindows:
    """Ten seconds of reports in which expert 0 of layer 0 takes every hit."""
    windows = SlidingWindows(60)
    for t in (0.0, 10.0):
        windows.add("g0", 0, [(0, [8, 0, 0, 0])], t)
    now[0] = 10.0
    return windows


def autoscaler(proposer, cluster=None, store=None, **config) -> tuple[Autoscaler, list[float]]:
    now = [0.0]
    windows = hot_expert_0(now)
    cfg = RouterConfig(member_id="r0", scale_up_window_s=10.0, scale_down_window_s=20.0, rebalance_interval_s=0,
                       policy_interval_s=0.01, **config)
    return Autoscaler(cfg, windows, cluster or FakeCluster(), proposer, clock=lambda: now[0],
                      store=store or FakeStore()), now


def test_a_hot_expert_gets_a_replica_proposed_to_the_leader_once():
    proposer = FakeProposer()
    scaler, _ = autoscaler(proposer)
    run(scaler.tick())
    [(address, proposal)] = proposer.calls
    assert address == LEADER.address
    assert (proposal.group_id, proposal.expected_epoch, proposal.term) == ("g0", 0, LEADER.term)
    # Expert 0 lives on rank 0: its replica goes to rank 1's spare.
    assert proposal.placement == Placement(4, 2, 1, {0: (EMPTY, 0)})
    assert scaler.num_proposed == 1
    run(scaler.tick())  # the windows must fill again after a change
    assert len(proposer.calls) == 1


def test_nothing_is_proposed_without_a_leader():
    proposer = FakeProposer()
    scaler, _ = autoscaler(proposer, FakeCluster(leader=None))
    run(scaler.tick())
    assert proposer.calls == [] and scaler.num_proposed == 0


def test_a_failed_proposal_is_retried_at_the_next_tick():
    proposer = FakeProposer(num_failures=2)
    scaler, _ = autoscaler(proposer)

    async def body():
        running = asyncio.create_task(scaler.run())
        while scaler.num_proposed == 0:
            assert not running.done(), running.exception()
            await asyncio.sleep(0.01)
        scaler.stop()
        await asyncio.wait_for(running, 5)

    run(body())
    assert len(proposer.calls) == 3 and scaler.num_proposed == 1


@pytest.mark.parametrize("spares", [0, 2])
def test_groups_whose_spares_do_not_match_are_left_alone(spares):
    cluster = FakeCluster()
    members = [Member(m.member_id, m.role, m.address, {"num_spare_expert_slots": spares})
               for m in cluster.snapshot_value.members]
    cluster.snapshot_value = ClusterSnapshot(1, LEADER, members, cluster.snapshot_value.groups, {})
    store = FakeStore()
    store.placements["g0"] = Placement(4, 2, 1)  # committed with one spare per rank
    proposer = FakeProposer()
    scaler, _ = autoscaler(proposer, cluster, store)
    run(scaler.tick())
    assert proposer.calls == []
