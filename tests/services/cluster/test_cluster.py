"""ClusterClient against a real etcd.

Every body runs under a deadline (tests.bounded.run): a hang
fails the test with the stack of every task instead of stalling the run."""

import asyncio
import dataclasses
import signal

import pytest

from moemesh.etcd import free_port, start_etcd
from services.cluster import ClusterClient, ClusterUnavailableError, GroupAssignment, RankInfo, cancel_and_wait
from tests.bounded import eventually, run


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with start_etcd(tmp_path_factory.mktemp("etcd")) as running:
        yield running



def group(term: int, gateway_id: str | None = "w0", epoch: int = 1) -> GroupAssignment:
    return GroupAssignment("g0", epoch, term, 2, "127.0.0.1:29500",
                           [RankInfo(0, "e0", "127.0.0.1:1"), RankInfo(1, "e1", "127.0.0.1:2")], gateway_id)


def test_register_list_and_close_removes_member_at_once(etcd):
    async def body():
        watcher = ClusterClient(etcd.endpoint, prefix="/t-register")
        await watcher.connect()
        member = ClusterClient(etcd.endpoint, prefix="/t-register")
        await member.connect()
        await member.register("expert", "e0", "127.0.0.1:1", {"rendezvous_port": 29500}, ttl=1)
        await asyncio.sleep(1.5)  # past the TTL: the keepalive holds the key
        [listed] = await watcher.list_members("expert")
        assert (listed.member_id, listed.role, listed.address, listed.info) == (
            "e0", "expert", "127.0.0.1:1", {"rendezvous_port": 29500})
        assert await watcher.list_members("gateway") == []
        await member.close()
        assert await watcher.list_members() == []  # revoked: no TTL wait
        await watcher.close()

    run(body())


def test_watch_group_for_member_follows_changes(etcd):
    async def body():
        prefix = "/t-watch"
        leader = ClusterClient(etcd.endpoint, prefix=prefix)
        await leader.connect()
        await leader.register("scheduler", "s0", "127.0.0.1:3", ttl=1)
        term = (await leader.campaign("s0", "127.0.0.1:3")).term
        assert await leader.write_groups(term, [group(term, gateway_id=None)])
        seen: list = []

        async def follow():
            async for assignment in leader.watch_group_for_member("w0"):
                seen.append(assignment)

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        assert seen == []  # w0 is in no group yet: nothing yielded
        assert await leader.write_groups(term, [group(term)])
        assert await eventually(lambda: len(seen) == 1)
        assert seen[0] == group(term)
        assert await leader.write_groups(term, delete=["g0"])
        assert await eventually(lambda: len(seen) == 2)
        assert seen[1] is None
        assert await cancel_and_wait([task], 2.0)  # cancelling a watch's consumer ends it at once
        await leader.close()

    run(body())


def test_ready_marks_follow_the_assignment(etcd):
    async def body():
        prefix = "/t-ready"
        leader = ClusterClient(etcd.endpoint, prefix=prefix)
        rank0, rank1 = ClusterClient(etcd.endpoint, prefix=prefix), ClusterClient(etcd.endpoint, prefix=prefix)
        for client, (role, member_id) in [(leader, ("scheduler", "s0")), (rank0, ("expert", "e0")),
                                          (rank1, ("expert", "e1"))]:
            await client.connect()
            await client.register(role, member_id, "127.0.0.1:1", ttl=1)
        term = (await leader.campaign("s0", "127.0.0.1:1")).term
        assert not await rank0.mark_rank_ready("g0", 1, 0, "e0")  # no such group yet
        assert await leader.write_groups(term, [group(term)])
        assert not await rank0.mark_rank_ready("g0", 1, 1, "e0")  # not its rank
        assert not await rank0.mark_rank_ready("g0", 2, 0, "e0")  # not the epoch
        waiter = asyncio.create_task(leader.wait_group_ready(group(term)))
        assert await rank0.mark_rank_ready("g0", 1, 0, "e0")
        assert await leader.ready_ranks("g0", 1) == {0}
        await asyncio.sleep(0.2)
        assert not waiter.done()
        assert await rank1.mark_rank_ready("g0", 1, 1, "e1")
        await asyncio.wait_for(waiter, 5)
        snapshot = await leader.snapshot()
        assert [snapshot.is_rank_ready(snapshot.groups[0], r) for r in (0, 1)] == [True, True]
        await rank1.close()  # its ready key goes with its lease
        assert await leader.ready_ranks("g0", 1) == {0}
        assert await leader.write_groups(term, delete=["g0"])  # ready keys go with the group
        assert await leader.ready_ranks("g0", 1) == set()
        await rank0.close()
        await leader.close()

    run(body())


def test_depose_leader_only_revokes_the_lease_the_leader_key_holds(etcd):
    """A follower's view of the leader may be stale: deposing acts only if
    /leader still holds that term under that lease."""
    async def body():
        leader, follower = (ClusterClient(etcd.endpoint, prefix="/t-depose") for _ in range(2))
        for client, member_id in [(leader, "s0"), (follower, "s1")]:
            await client.connect()
            await client.register("scheduler", member_id, "127.0.0.1:1", ttl=1)
        info = await leader.campaign("s0", "127.0.0.1:1")
        assert info.lease_id == leader.session.lease_id
        assert not await follower.depose_leader(dataclasses.replace(info, term=info.term - 1))
        assert not await follower.depose_leader(dataclasses.replace(info, lease_id=follower.session.lease_id))
        assert await follower.get_leader() == info
        assert await follower.depose_leader(info)
        assert await follower.get_leader() is None
        assert not await follower.depose_leader(info)  # gone already: nothing to do
        await leader.close()
        await follower.close()

    run(body())


def test_connect_gives_up_after_budget_when_etcd_is_down():
    async def body():
        client = ClusterClient(f"127.0.0.1:{free_port()}")
        with pytest.raises(ClusterUnavailableError):
            await client.connect(wait_s=0.5)
        await client.close()

    run(body())


def test_session_resumes_on_its_lease_across_an_etcd_restart(tmp_path):
    """etcd down for longer than the TTL: the session is lost at the first
    failed keepalive, but etcd keeps leases across a restart (and restarts
    their TTL), so once it is back the same lease goes on in a new session:
    the member key was never deleted nor rewritten."""
    client_port, peer_port = free_port(), free_port()
    etcd = start_etcd(tmp_path, client_port=client_port, peer_port=peer_port)

    async def body():
        nonlocal etcd
        client = ClusterClient(etcd.endpoint, prefix="/t-restart")
        await client.connect()
        await client.register("router", "r0", "127.0.0.1:1", ttl=1)
        first = client.session
        key = client.keys.member("router", "r0").encode()
        written = (await client._etcd.get(key)).mod_revision
        etcd.stop()
        await asyncio.wait_for(first.lost.wait(), 1.0)  # at the first failed refresh
        await asyncio.sleep(1.2)
        etcd = start_etcd(tmp_path, client_port=client_port, peer_port=peer_port)
        session = await asyncio.wait_for(client.live_session(), 10)
        assert session is not first and session.lease_id == first.lease_id
        assert (await client._etcd.get(key)).mod_revision == written
        await client.close()

    try:
        run(body())
    finally:
        etcd.stop()


def test_session_whose_lease_is_gone_registers_again(etcd):
    async def body():
        client = ClusterClient(etcd.endpoint, prefix="/t-gone")
        other = ClusterClient(etcd.endpoint, prefix="/t-gone")
        await client.connect()
        await other.connect()
        await client.register("router", "r0", "127.0.0.1:1", ttl=1)
        first = client.session
        await other.revoke_lease(first.lease_id)  # the member key goes with it
        await asyncio.wait_for(first.lost.wait(), 2.0)
        session = await asyncio.wait_for(client.live_session(), 5)
        assert session.lease_id != first.lease_id
        assert await eventually(lambda: _member_lease(other, "router", "r0"))
        assert await _member_lease(other, "router", "r0") == session.lease_id  # put again, under the new lease
        await client.close()
        await other.close()

    run(body())


def test_member_watch_of_a_role_sees_each_registration_with_its_lease(etcd):
    """Members carry their lease and the revision of their registration (what
    a handover fences on): a re-registration under a new lease is a change
    for watch_members."""
    async def body():
        client, other = (ClusterClient(etcd.endpoint, prefix="/t-members") for _ in range(2))
        await client.connect()
        await other.connect()
        await client.register("scheduler", "s0", "127.0.0.1:1", ttl=1)
        seen: list = []

        async def follow():
            async for members in other.watch_members("scheduler"):
                seen.append(members)

        task = asyncio.create_task(follow())
        assert await eventually(lambda: len(seen) == 1)
        [first] = seen[0]
        assert (first.member_id, first.lease_id) == ("s0", client.session.lease_id) and first.revision > 0
        await other.revoke_lease(first.lease_id)  # s0 registers again under a new lease
        assert await eventually(lambda: seen[-1] and seen[-1][0].lease_id not in (0, first.lease_id))
        assert len(seen[-1]) == 1 and seen[-1][0].revision > first.revision
        assert await cancel_and_wait([task], 2.0)
        await client.close()
        await other.close()

    run(body())


def test_watch_snapshot_applies_each_change_at_its_revision(etcd):
    """The watched snapshot (what GetClusterState answers from) equals a read
    of everything at the same revision after each kind of change: a member
    joins, a leader is elected and hands over, a group is written, a member
    leaves (a delete: its lease revoked)."""
    async def body():
        prefix = "/t-watch-snapshot"
        s0, s1, reader = (ClusterClient(etcd.endpoint, prefix=prefix) for _ in range(3))
        for client in (s0, s1, reader):
            await client.connect()
        seen: list = []

        async def follow():
            async for snapshot in reader.watch_snapshot():
                seen.append(snapshot)

        async def matches_a_read() -> bool:
            read = await reader.snapshot()
            return bool(seen) and seen[-1] == read

        task = asyncio.create_task(follow())
        assert await eventually(lambda: seen and seen[-1].members == [])
        await s0.register("scheduler", "s0", "127.0.0.1:1", ttl=2)
        await s1.register("scheduler", "s1", "127.0.0.1:2", ttl=2)
        term = (await s0.campaign("s0", "127.0.0.1:1")).term
        assert await s0.write_groups(term, [group(term)])
        assert await eventually(matches_a_read)
        assert seen[-1].leader.term == term and [g.group_id for g in seen[-1].groups] == ["g0"]
        new_leader = await s0.handover(term, "s0", await s0.list_members("scheduler"))
        assert await eventually(lambda: seen[-1].leader == new_leader)
        await s0.close()  # its member key goes: a delete event
        assert await eventually(matches_a_read)
        assert [m.member_id for m in seen[-1].members] == ["s1"] and seen[-1].leader.member_id == "s1"
        revisions = [snapshot.revision for snapshot in seen]
        assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
        assert await cancel_and_wait([task], 2.0)
        await s1.close()
        await reader.close()

    run(body())


def test_writes_under_a_lease_that_is_gone_wait_for_the_next_session(etcd):
    """A lease revoked before the keepalive noticed: a campaign fails as etcd
    being unavailable (the election retries; no traceback), and marking a
    rank ready writes under the member's next lease."""
    async def body():
        prefix = "/t-lease-gone"
        leader, rank = ClusterClient(etcd.endpoint, prefix=prefix), ClusterClient(etcd.endpoint, prefix=prefix)
        for client, (role, member_id) in [(leader, ("scheduler", "s0")), (rank, ("expert", "e0"))]:
            await client.connect()
            await client.register(role, member_id, "127.0.0.1:1", ttl=2)
        term = (await leader.campaign("s0", "127.0.0.1:1")).term
        assert await leader.write_groups(term, [group(term)])
        first = rank.session
        await leader.revoke_lease(first.lease_id)
        assert await rank.mark_rank_ready("g0", 1, 0, "e0")
        got = await leader._etcd.get(leader.keys.ready("g0", 1, 0).encode())
        assert got.lease == rank.session.lease_id != first.lease_id
        refresh, may_refresh = leader._etcd.refresh_lease, asyncio.Event()

        async def held_refresh(lease_id):  # the keepalive must not notice first
            await may_refresh.wait()
            return await refresh(lease_id)

        leader._etcd.refresh_lease = held_refresh
        await rank.revoke_lease(leader.session.lease_id)  # and the leader's: /leader goes too
        with pytest.raises(ClusterUnavailableError, match="our lease is gone"):
            await leader.campaign("s0", "127.0.0.1:1")
        assert leader.session.lost.is_set()
        may_refresh.set()
        assert (await leader.campaign("s0", "127.0.0.1:1")).lease_id == leader.session.lease_id
        await rank.close()
        await leader.close()

    run(body())


async def _member_lease(client: ClusterClient, role: str, member_id: str) -> int | None:
    got = await client._etcd.get(client.keys.member(role, member_id).encode())
    return None if got is None else got.lease


def test_group_watch_ignores_a_record_older_than_a_term_seen(etcd):
    """A record of the member's group written in an older term than one
    already seen (a deposed leader's, or etcd restored from an old backup)
    is logged and ignored; newer records are followed again."""
    async def body():
        prefix = "/t-stale"
        leader = ClusterClient(etcd.endpoint, prefix=prefix)
        await leader.connect()
        key = leader.keys.group("g0").encode()
        seen: list = []

        async def follow():
            async for assignment in leader.watch_group_for_member("w0"):
                seen.append(assignment)

        await leader._etcd.put(key, group(10).to_json())
        task = asyncio.create_task(follow())
        assert await eventually(lambda: seen == [group(10)])
        await leader._etcd.put(key, group(7, gateway_id="w0", epoch=2).to_json())  # stale: bypasses the fence
        await leader._etcd.put(leader.keys.group("g1").encode(), group(7, gateway_id="w1").to_json())
        await asyncio.sleep(0.3)
        assert seen == [group(10)]
        await leader._etcd.put(key, group(11, epoch=2).to_json())
        assert await eventually(lambda: seen == [group(10), group(11, epoch=2)])
        await leader._etcd.delete(key)
        assert await eventually(lambda: seen == [group(10), group(11, epoch=2), None])
        assert await cancel_and_wait([task], 2.0)
        await leader.close()

    run(body())


def test_close_right_as_a_keepalive_reply_arrives(etcd):
    """The reply to a lease refresh and close()'s cancellation of the keepalive
    land in one loop iteration. asyncio.wait_for (Python 3.11) returned the
    reply and dropped the cancellation: the keepalive ran on, close() waited
    for it forever (the scheduler election tests hung about 1 run in 10)."""
    async def body():
        client = ClusterClient(etcd.endpoint, prefix="/t-close-race")
        await client.connect()
        await client.register("router", "r0", "127.0.0.1:1", ttl=3)
        refresh = client._etcd.refresh_lease
        reply = asyncio.get_running_loop().create_future()
        asked = asyncio.Event()

        async def held_refresh(lease_id):
            asked.set()
            return await reply

        client._etcd.refresh_lease = held_refresh
        await asyncio.wait_for(asked.wait(), 5)  # the keepalive is waiting for held_refresh
        reply.set_result(await refresh(client.session.lease_id))
        closing = asyncio.create_task(client.close())  # cancels it as the reply is delivered
        done, _ = await asyncio.wait([closing], timeout=10)
        assert done, "close() hung: the keepalive lost its cancellation"
        closing.result()
        async with ClusterClient(etcd.endpoint, prefix="/t-close-race") as other:
            assert await other.list_members() == []  # and the lease was revoked

    run(body())


def _process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat: R, S, T (stopped), ..."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_calls_watches_and_close_are_bounded_when_etcd_hangs(tmp_path):
    """etcd stops answering but keeps its connections open (SIGSTOP): one-shot
    calls give up after retry_s, a watch's consumer ends when cancelled, and
    close() returns within a few call deadlines, instead of waiting forever."""
    etcd = start_etcd(tmp_path)

    async def body():
        loop = asyncio.get_running_loop()
        client = ClusterClient(etcd.endpoint, prefix="/t-hang", call_timeout_s=0.5, retry_s=1.0)
        await client.connect()
        await client.register("router", "r0", "127.0.0.1:1", ttl=1)
        seen = []

        async def follow():
            async for leader in client.watch_leader():
                seen.append(leader)

        follower = asyncio.create_task(follow())
        assert await eventually(lambda: seen == [None])
        etcd.process.send_signal(signal.SIGSTOP)
        try:
            assert await eventually(lambda: _process_state(etcd.process.pid) == "T")  # stopped, not stopping
            started = loop.time()
            with pytest.raises(ClusterUnavailableError):
                await client.get_leader()
            assert loop.time() - started < 5
            assert await cancel_and_wait([follower], 1.0)
            started = loop.time()
            await client.close()
            assert loop.time() - started < 5
        finally:
            etcd.process.send_signal(signal.SIGCONT)

    try:
        run(body())
    finally:
        etcd.stop()
