"""Committing expert placements on a real etcd: only the current leader's term, only
against the group's current placement epoch; a rank's ready marks follow its lease."""

import asyncio

import pytest

from scheduler_svc.placement import LeaderTermError, NotLeaderError, StaleProposalError, commit_proposal
from services.cluster import ClusterClient, GroupAssignment, RankInfo
from services.placement import EMPTY, Placement
from services.placement_store import PlacementStore
from tests.bounded import eventually, run

HOT = Placement(8, 2, 1, {0: (4, 0)})


async def _leader(etcd, prefix: str, member_id: str) -> tuple[ClusterClient, int]:
    client = ClusterClient(etcd.endpoint, prefix=prefix)
    await client.connect()
    await client.register("scheduler", member_id, "127.0.0.1:1")
    leader = await client.campaign(member_id, "127.0.0.1:1")
    group = GroupAssignment("g0", 1, leader.term, 2, "127.0.0.1:2",
                            [RankInfo(0, "e0", "127.0.0.1:3"), RankInfo(1, "e1", "127.0.0.1:4")])
    assert await client.write_groups(leader.term, [group])
    return client, leader.term


def test_commits_advance_the_epoch_and_stale_epochs_and_terms_are_rejected(etcd, key_prefix):
    async def body():
        client, term = await _leader(etcd, key_prefix, "s0")
        store = PlacementStore(client)
        assert await store.get("g0") is None
        first, by = await commit_proposal(client, "s0", "g0", 0, term, HOT)
        assert (first.epoch, by) == (1, term)
        assert await store.get("g0") == first
        with pytest.raises(StaleProposalError, match="epoch 1.*against epoch 0"):
            await commit_proposal(client, "s0", "g0", 0, term, HOT.with_layer(0, (EMPTY, EMPTY)))
        with pytest.raises(LeaderTermError):
            await commit_proposal(client, "s0", "g0", 1, term - 1, HOT)
        with pytest.raises(NotLeaderError, match="s9 is not the leader"):
            await commit_proposal(client, "s9", "g0", 1, term, HOT)
        with pytest.raises(ValueError, match="for 4 ranks"):
            await commit_proposal(client, "s0", "g0", 1, term, Placement(8, 4, 1))
        second, _ = await commit_proposal(client, "s0", "g0", 1, 0, HOT.with_layer(0, (EMPTY, 1)))
        assert second.epoch == 2 and (await store.get("g0")).spares(0) == (EMPTY, 1)

        # A deposed leader: its term's fence rejects the write even when the epoch is right.
        await client.resign(term)
        other, new_term = await _leader(etcd, key_prefix, "s1")
        with pytest.raises(LeaderTermError):
            await PlacementStore(client).commit(term, "g0", 2, HOT)
        assert (await store.get("g0")).epoch == 2
        third, by = await commit_proposal(other, "s1", "g0", 2, new_term, HOT)
        assert (third.epoch, by) == (3, new_term)
        await other.close()
        await client.close()

    run(body())


def test_ready_marks_go_with_the_ranks_lease(etcd, key_prefix):
    async def body():
        client, _ = await _leader(etcd, key_prefix, "s0")
        rank = ClusterClient(etcd.endpoint, prefix=key_prefix)
        await rank.connect()
        await rank.register("expert", "e1", "127.0.0.1:4")
        seen = []

        async def follow():
            async for ready in PlacementStore(client).watch_ready("g0"):
                seen.append(ready)

        task = asyncio.create_task(follow())
        await PlacementStore(rank).mark_ready("g0", 3, 1, "e1")
        assert await eventually(lambda: seen and seen[-1] == {3: {1}})
        await rank.close()  # revokes the lease: the mark goes
        assert await eventually(lambda: seen[-1] == {})
        task.cancel()
        await client.close()

    run(body())


def test_the_heir_of_a_graceful_handover_commits_and_the_old_term_cannot(etcd, key_prefix):
    """After a handover the term is the new mod revision of /leader (its
    create revision is the old term's): commits are fenced on it."""
    async def body():
        old, term = await _leader(etcd, key_prefix, "s0")
        heir = ClusterClient(etcd.endpoint, prefix=key_prefix)
        await heir.connect()
        await heir.register("scheduler", "s1", "127.0.0.1:5")
        new = await old.handover(term, "s0", await old.list_members("scheduler"))
        assert new is not None and new.member_id == "s1" and new.term > term
        with pytest.raises(LeaderTermError):
            await PlacementStore(old).commit(term, "g0", 0, HOT)
        committed, by = await commit_proposal(heir, "s1", "g0", 0, new.term, HOT)
        assert (committed.epoch, by) == (1, new.term)
        await heir.close()
        await old.close()

    run(body())


def test_propose_placement_over_grpc_maps_the_errors_to_status_codes(etcd, key_prefix):
    import grpc

    from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
    from scheduler_svc.cluster_view import ClusterView
    from scheduler_svc.servicer import SchedulerServicer
    from services import grpc_util

    def request(expected_epoch: int, term: int, spares=(4, 0)) -> scheduler_pb2.ProposePlacementRequest:
        return scheduler_pb2.ProposePlacementRequest(
            group_id="g0", expected_epoch=expected_epoch, term=term, num_experts=8, num_ranks=2, num_spare_slots=1,
            layers=[scheduler_pb2.LayerPlacement(layer=0, spare_experts=list(spares))])

    async def body():
        client, term = await _leader(etcd, key_prefix, "s0")
        servicers = {name: SchedulerServicer(client, name, lambda: None, ClusterView(client)) for name in ("s0", "s1")}
        servers = [await grpc_util.start_server(
            [lambda s, v=v: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(v, s)], [])
            for v in servicers.values()]
        leader_ch, follower_ch = (grpc_util.channel(f"127.0.0.1:{s.port}") for s in servers)
        leader = scheduler_pb2_grpc.SchedulerServiceStub(leader_ch)
        response = await leader.ProposePlacement(request(0, term), timeout=5)
        assert (response.epoch, response.term) == (1, term)
        codes = []
        for stub, req in [(leader, request(0, term)), (leader, request(1, term + 100)),
                          (scheduler_pb2_grpc.SchedulerServiceStub(follower_ch), request(1, term)),
                          (leader, request(1, term, spares=(1, 0)))]:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.ProposePlacement(req, timeout=5)
            codes.append(error.value.code())
        assert codes == [grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION,
                         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT]
        assert (await PlacementStore(client).get("g0")).epoch == 1
        for ch in (leader_ch, follower_ch):
            await ch.close()
        for server in servers:
            await server.stop(0.5)
        await client.close()

    run(body())
