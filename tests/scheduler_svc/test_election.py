"""Leader election and fencing among candidates in one process, on a real etcd.

Every body runs under a deadline (tests.bounded.run): a hang
fails the test with the stack of every task instead of stalling the run."""

import asyncio

from services.cluster import GroupAssignment, RankInfo
from tests.bounded import run
from tests.scheduler_svc.candidates import eventually, leaders, start_three


def test_exactly_one_leader_and_term_is_create_revision(etcd, key_prefix):
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [leader] = leaders(candidates)
        info = await leader.client.get_leader()
        raw = await leader.client._etcd.get(leader.client.keys.leader.encode())
        assert info.member_id == leader.member_id
        assert info.term == raw.create_revision == leader.election.leadership.term
        assert leader.terms == [info.term]
        assert all(c.terms == [] for c in candidates if c is not leader)
        for c in candidates:
            await c.stop()

    run(body())


def test_leader_close_hands_over_to_larger_term_and_fences_the_old(etcd, key_prefix):
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        rest = [c for c in candidates if c is not old]
        started = asyncio.get_running_loop().time()
        await old.stop()  # revokes its lease: the key goes now
        assert await eventually(lambda: len(leaders(rest)) == 1)
        assert asyncio.get_running_loop().time() - started < 1.0
        [new] = leaders(rest)
        new_term = new.election.leadership.term
        assert new_term > old_term
        assert (await new.client.get_leader()).member_id == new.member_id

        assignment = GroupAssignment("g0", 1, old_term, 1, "127.0.0.1:1", [RankInfo(0, "e0", "x:1")], None)
        assert not await new.client.write_groups(old_term, [assignment])  # stale term
        assert await new.client.list_groups() == []
        assert await new.client.write_groups(new_term, [assignment])
        assert [g.group_id for g in await new.client.list_groups()] == ["g0"]
        for c in rest:
            await c.stop()

    run(body())


def test_leader_steps_down_when_its_lease_is_revoked(etcd, key_prefix):
    """What a follower that finds the leader dead does: revoke its lease.
    A live leader in that position must stop acting and campaign again."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        info = await old.client.get_leader()
        probe = next(c for c in candidates if c is not old)
        await probe.client.revoke_lease(info.lease_id)
        assert await eventually(lambda: [t for t, _ in old.stepped_down] == [old_term])
        assert await eventually(
            lambda: len(leaders(candidates)) == 1 and leaders(candidates)[0].election.leadership.term > old_term)
        # The deposed replica registered again under a fresh lease and is a candidate once more.
        assert await eventually(lambda: old.client.session.lease_id != info.lease_id
                                and not old.client.session.lost.is_set())
        members = await probe.client.list_members("scheduler")
        assert sorted(m.member_id for m in members) == ["s0", "s1", "s2"]
        for c in candidates:
            await c.stop()

    run(body())
