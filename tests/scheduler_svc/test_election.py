"""Leader election and fencing among candidates in one process, on a real etcd.

Every body runs under a deadline (tests.bounded.run): a hang
fails the test with the stack of every task instead of stalling the run."""

import asyncio

from services.cluster import GroupAssignment, RankInfo
from tests.bounded import run
from tests.scheduler_svc.candidates import Candidate, eventually, leaders, start_all, start_three


def test_exactly_one_leader_and_term_is_the_keys_mod_revision(etcd, key_prefix):
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [leader] = leaders(candidates)
        info = await leader.client.get_leader()
        raw = await leader.client._etcd.get(leader.client.keys.leader.encode())
        assert info.member_id == leader.member_id
        assert info.term == raw.mod_revision == raw.create_revision == leader.election.leadership.term
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


class EtcdCalls:
    """Counts the unary etcd calls a client makes, by method name."""

    def __init__(self, client, names=("get", "get_prefix", "transaction")):
        self.counts = dict.fromkeys(names, 0)
        for name in names:
            setattr(client._etcd, name, self._counted(name, getattr(client._etcd, name)))

    def _counted(self, name, fn):
        async def counted(*args, **kwargs):
            self.counts[name] += 1
            return await fn(*args, **kwargs)
        return counted


async def _leaders_seen(client, seen: list) -> None:
    async for leader in client.watch_leader():
        seen.append(leader)


def test_graceful_handover_is_one_transaction_and_fences_the_old_term(etcd, key_prefix):
    """SIGTERM on the leader: one etcd transaction (the followers known from
    the term's own watch) puts /leader again under the lease of the follower
    registered longest. The key never disappears, so nobody campaigns; the
    heir leads within milliseconds with a larger term (the key's new mod
    revision), and the old term's writes and resignation are rejected."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        rest = [c for c in candidates if c is not old]
        registered_at = {m.member_id: m.revision for m in await old.client.list_members("scheduler")}
        heir, other = sorted(rest, key=lambda c: registered_at[c.member_id])  # the longest registered leads
        seen: list = []
        watching = asyncio.create_task(_leaders_seen(other.client, seen))
        assert await eventually(lambda: len(seen) == 1)
        calls = EtcdCalls(old.client)
        started = asyncio.get_running_loop().time()
        new = await _hand_over_and_close(old)
        assert calls.counts == {"get": 0, "get_prefix": 0, "transaction": 1}
        assert new is not None and new.member_id == heir.member_id
        assert await eventually(lambda: heir.election.is_leader)
        assert asyncio.get_running_loop().time() - started < 0.5
        raw = await heir.client._etcd.get(heir.client.keys.leader.encode())
        assert heir.election.leadership.term == new.term == raw.mod_revision > old_term
        assert raw.create_revision == old_term and raw.lease == heir.client.session.lease_id
        await asyncio.sleep(0.3)
        assert leaders(rest) == [heir] and heir.terms == [new.term] and other.terms == []
        assert [(s.member_id, s.term) for s in seen] == [(old.member_id, old_term), (heir.member_id, new.term)]
        watching.cancel()

        assignment = GroupAssignment("g0", 1, old_term, 1, "127.0.0.1:1", [RankInfo(0, "e0", "x:1")], None)
        assert not await heir.client.write_groups(old_term, [assignment])  # the old term is fenced off
        await heir.client.resign(old_term)
        assert (await heir.client.get_leader()).term == new.term
        assert await heir.client.list_groups() == []
        assert await heir.client.write_groups(new.term, [assignment])
        for c in rest:
            await c.stop()

    run(body())


def test_handover_with_stale_heirs_reads_the_members_again(etcd, key_prefix):
    """The only follower the leader knows of has left since (its member key
    and lease are gone) and another has joined: the transaction naming the
    old one fails, the members are read again and the term goes to the new
    one, still without an election."""
    async def body():
        pair = await start_all([Candidate(etcd.endpoint, key_prefix, f"s{i}") for i in range(2)])
        [old] = leaders(pair)
        [gone] = [c for c in pair if c is not old]
        old_term = old.election.leadership.term
        heirs = await old.client.list_members("scheduler")
        await gone.stop()
        joined = await Candidate(etcd.endpoint, key_prefix, "s9").start()
        assert await eventually(lambda: joined.client.session is not None)
        calls = EtcdCalls(old.client)
        new = await old.client.handover(old_term, old.member_id, heirs)
        assert new is not None and (new.member_id, new.lease_id) == (joined.member_id, joined.client.session.lease_id)
        # One transaction naming the stale heir, one read of the members, one naming the new heir; the
        # old leader's election, seeing its term end, may also have sent its fenced resign (a no-op now).
        counts = calls.counts
        assert (counts["get"], counts["get_prefix"]) == (0, 1) and counts["transaction"] in (2, 3), counts
        assert await eventually(lambda: joined.terms == [new.term]) and new.term > old_term
        await old.stop()
        await joined.stop()

    run(body())


def test_a_deposed_leader_cannot_hand_its_old_term_over(etcd, key_prefix):
    """A leader paused past its deposition that then stops gracefully: the
    handover is fenced on its old term, so it changes nothing and says so
    (even with the next leader among its heirs). The same transaction sent
    again (a retry after a lost reply) recognizes its own write."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        heirs = await old.client.list_members("scheduler")
        transaction = old.client._etcd.transaction

        async def sent_twice(*args, **kwargs):
            await transaction(*args, **kwargs)
            return await transaction(*args, **kwargs)  # the first reply "lost"

        old.client._etcd.transaction = sent_twice
        handed = await old.client.handover(old_term, old.member_id, heirs)
        old.client._etcd.transaction = transaction
        assert handed is not None and handed.term > old_term
        assert await eventually(lambda: len(leaders(candidates)) == 1 and not old.election.is_leader)
        [heir] = leaders(candidates)
        await old.client.revoke_lease(heir.client.session.lease_id)  # the heir is deposed in turn
        assert await eventually(lambda: len(leaders(candidates)) == 1
                                and leaders(candidates)[0].election.leadership.term > handed.term)
        [new] = leaders(candidates)
        current = await new.client.get_leader()
        assert await heir.client.handover(handed.term, heir.member_id, heirs) is None
        assert await new.client.get_leader() == current
        for c in candidates:
            await c.stop()

    run(body())
