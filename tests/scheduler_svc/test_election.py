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


async def _hand_over_and_close(candidate):
    """What a leader's main does on SIGTERM: hand the term over, then close (revoke)."""
    new = await candidate.election.hand_over(candidate.task)
    await candidate.client.close()
    return new


def test_graceful_handover_names_a_follower_whose_term_fences_the_old(etcd, key_prefix):
    """SIGTERM on the leader: the first follower by member id leads under its
    own lease, with a term that is a new create revision of /leader (so the old
    term's writes are rejected), within milliseconds and without the third
    replica ever leading; no handover marker is left behind."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        rest = [c for c in candidates if c is not old]
        heir, other = sorted(rest, key=lambda c: c.member_id)
        started = asyncio.get_running_loop().time()
        new = await _hand_over_and_close(old)
        assert new is not None and new.member_id == heir.member_id
        assert await eventually(lambda: heir.election.is_leader)
        assert asyncio.get_running_loop().time() - started < 0.5
        raw = await heir.client._etcd.get(heir.client.keys.leader.encode())
        assert heir.election.leadership.term == new.term == raw.create_revision > old_term
        assert raw.lease == heir.client.session.lease_id
        await asyncio.sleep(0.3)
        assert leaders(rest) == [heir] and heir.terms == [new.term] and other.terms == []
        assert await heir.client._etcd.get(heir.client.keys.handover.encode()) is None

        assignment = GroupAssignment("g0", 1, old_term, 1, "127.0.0.1:1", [RankInfo(0, "e0", "x:1")], None)
        assert not await heir.client.write_groups(old_term, [assignment])  # the old term is fenced off
        assert await heir.client.list_groups() == []
        assert await heir.client.write_groups(new.term, [assignment])
        for c in rest:
            await c.stop()

    run(body())


def test_handover_to_a_follower_that_dies_midway_falls_back_to_an_election(etcd, key_prefix):
    """The named follower stops between the two steps of the handover (its
    lease, and the marker with it, are gone): the handover fails, nothing
    half-done remains, and the remaining replica wins the election at once."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        heir, other = sorted((c for c in candidates if c is not old), key=lambda c: c.member_id)
        complete = old.client._complete_handover

        async def heir_dies_first(pending):
            assert pending.member_id == heir.member_id
            await heir.stop()
            return await complete(pending)

        old.client._complete_handover = heir_dies_first
        started = asyncio.get_running_loop().time()
        assert await _hand_over_and_close(old) is None
        assert await eventually(lambda: other.election.is_leader)
        assert asyncio.get_running_loop().time() - started < 1.0
        assert other.election.leadership.term > old_term
        leader = await other.client.get_leader()
        assert (leader.member_id, leader.lease_id) == (other.member_id, other.client.session.lease_id)
        assert await other.client._etcd.get(other.client.keys.handover.encode()) is None
        await other.stop()

    run(body())


def test_handover_whose_leader_dies_midway_is_completed_by_the_follower(etcd, key_prefix):
    """The leader dies after it ended its term and named the follower, before
    it created the follower's /leader: the follower completes the handover
    itself, and the other replica does not win meanwhile."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        heir, other = sorted((c for c in candidates if c is not old), key=lambda c: c.member_id)

        async def dies(pending):
            raise ConnectionError("the old leader died")

        old.client._complete_handover = dies
        assert await _hand_over_and_close(old) is None
        assert await eventually(lambda: heir.election.is_leader)
        assert heir.election.leadership.term > old_term
        await asyncio.sleep(0.3)
        assert leaders([heir, other]) == [heir] and other.terms == []
        for c in (heir, other):
            await c.stop()

    run(body())
