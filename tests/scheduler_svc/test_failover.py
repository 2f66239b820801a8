"""Failover of the scheduler leader, in one process on a real etcd: the
followers' probes, their guards, a leader cut off from etcd, fencing.

Candidates probe each other through a FakeProbe (tests/scheduler_svc/
candidates.py); a TcpProxy between one candidate and etcd partitions it.
Process-level failover (kill -9, SIGSTOP, etcd restarted under a mesh) is
in tests/e2e/test_failover_e2e.py.
"""

import asyncio
import time

import pytest

from moemesh.etcd import free_port
from scheduler_svc.election import SILENT, LeaderProbe, LeadershipLost
from scheduler_svc.health import Health
from scheduler_svc.health_client import HealthCheck
from scheduler_svc.state import reconcile_once
from services.cluster import ClusterClient, GroupAssignment, RankInfo
from services.grpc_util import start_server
from tests.bounded import run
from tests.scheduler_svc.candidates import Candidate, FakeProbe, eventually, leaders, start_all, start_three
from tests.scheduler_svc.tcp_proxy import TcpProxy


def test_followers_depose_a_leader_that_stops_answering(etcd, key_prefix):
    """Two failed checks 50 ms apart: a follower revokes the leader's lease and
    another replica leads well within the 1 s TTL. The old leader, alive but
    deposed, steps down and campaigns again under a fresh lease."""
    async def body():
        probe = FakeProbe()
        candidates = await start_three(etcd, key_prefix, probe.policy(interval_s=0.05, misses=2))
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        old_lease = old.client.session.lease_id
        started = time.monotonic()
        probe.alive[old.address] = False
        assert await eventually(lambda: any(c.terms and c.terms[-1] > old_term for c in candidates))
        [new] = [c for c in candidates if c.terms and c.terms[-1] > old_term]
        assert new is not old
        assert new.elected[-1][1] - started < 0.8  # the probes: the 1 s lease alone takes longer
        assert await eventually(lambda: [t for t, _ in old.stepped_down] == [old_term])
        assert await eventually(lambda: old.client.session.lease_id != old_lease
                                and not old.client.session.lost.is_set())
        await asyncio.sleep(0.3)  # the deposed replica, still "unhealthy", does not win again
        assert leaders(candidates) == [new] and len(new.terms) == 1
        for c in candidates:
            await c.stop()

    run(body())


def test_a_follower_cut_off_from_etcd_deposes_nobody(etcd, key_prefix):
    """A follower whose probes fail because of its own trouble (here: it is
    partitioned from etcd too) must not revoke a healthy leader's lease."""
    async def body():
        probe, lonely_probe = FakeProbe(), FakeProbe()
        proxy = TcpProxy(etcd.endpoint)
        endpoint = await proxy.start()
        candidates = await start_all([Candidate(etcd.endpoint, key_prefix, f"s{i}", probe.policy())
                                      for i in range(2)])
        [leader] = leaders(candidates)
        term = leader.election.leadership.term
        lonely = await Candidate(endpoint, key_prefix, "s9", lonely_probe.policy()).start()
        assert await eventually(lambda: lonely.client.session is not None)
        await asyncio.sleep(0.2)  # s9 follows the leader
        proxy.cut()
        lonely_probe.alive[leader.address] = False
        await asyncio.sleep(1.2)  # s9's own lease expires meanwhile: that deposes nobody either
        assert leaders(candidates) == [leader] and leader.election.leadership.term == term
        assert (await leader.client.get_leader()).term == term
        proxy.heal()
        lonely_probe.alive[leader.address] = True
        assert await eventually(lambda: lonely.client.session is not None and not lonely.client.session.lost.is_set())
        assert leaders([*candidates, lonely]) == [leader]
        for c in [*candidates, lonely]:
            await c.stop()
        await proxy.close()

    run(body())


def test_failed_checks_that_answer_late_do_not_count(etcd, key_prefix):
    """A check that took longer than max_answer_s to fail says that the
    follower's own event loop was starved, not that the leader is dead."""
    async def body():
        probe = FakeProbe(delay_s=0.25)
        candidates = await start_all([Candidate(etcd.endpoint, key_prefix, f"s{i}",
                                                probe.policy(interval_s=0.05, misses=2, max_answer_s=0.2))
                                      for i in range(2)])
        [leader] = leaders(candidates)
        term = leader.election.leadership.term
        probe.alive[leader.address] = False
        await asyncio.sleep(1.0)
        assert leaders(candidates) == [leader] and leader.election.leadership.term == term
        probe.delay_s = 0.01  # the same failures, answered in time: deposed
        assert await eventually(lambda: any(c.terms and c.terms[-1] > term for c in candidates), timeout_s=2.0)
        for c in candidates:
            await c.stop()

    run(body())


def test_a_leader_that_only_answers_late_keeps_its_term_for_silent_s(etcd, key_prefix):
    """Checks that run into their deadline (SILENT: a hung leader, or one only
    starved of CPU) depose the leader only once they have lasted silent_s,
    whatever the number of misses; then it is deposed."""
    async def body():
        probe = FakeProbe()
        policy = LeaderProbe(probe, interval_s=0.05, misses=2, max_answer_s=0.3, silent_s=0.6)
        candidates = await start_all([Candidate(etcd.endpoint, key_prefix, f"s{i}", policy) for i in range(2)])
        [leader] = leaders(candidates)
        term = leader.election.leadership.term
        started = time.monotonic()
        probe.alive[leader.address] = SILENT
        await asyncio.sleep(0.4)  # 8 silent misses, but not yet 0.6 s of them
        assert leaders(candidates) == [leader] and leader.election.leadership.term == term
        assert await eventually(lambda: any(c.terms and c.terms[-1] > term for c in candidates), timeout_s=2.0)
        new_at = max(t for c in candidates for _, t in c.elected)
        assert new_at - started >= 0.6
        for c in candidates:
            await c.stop()

    run(body())


def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_can_expire(etcd, key_prefix):
    """The leader's first failed keepalive ends its term's work (it can no
    longer know that it holds the lease): well before the lease expires and
    another replica can be elected. Healed, it follows the new leader."""
    async def body():
        proxy = TcpProxy(etcd.endpoint)
        endpoint = await proxy.start()
        old = await start_all([Candidate(endpoint, key_prefix, "s0")])
        old = old[0]
        old_term = old.election.leadership.term
        others = await asyncio.gather(*(Candidate(etcd.endpoint, key_prefix, f"s{i}").start() for i in (1, 2)))
        await asyncio.sleep(0.2)
        cut_at = time.monotonic()
        proxy.cut()
        assert await eventually(lambda: old.stepped_down, timeout_s=2.0)
        assert not old.election.is_leader
        stepped_down_at = old.stepped_down[0][1]
        assert stepped_down_at - cut_at < 0.95  # keepalive every ttl/3 = 0.33 s, each with a 0.33 s deadline
        # Leading, and its term's work begun (is_leader is set a moment before the work task runs).
        assert await eventually(lambda: len(leaders(others)) == 1 and leaders(others)[0].elected, timeout_s=5.0)
        [new] = leaders(others)
        assert new.terms[0] > old_term and new.elected[0][1] > stepped_down_at
        proxy.heal()
        assert await eventually(lambda: not old.client.session.lost.is_set(), timeout_s=5.0)
        await asyncio.sleep(0.3)
        assert leaders([old, *others]) == [new] and old.terms == [old_term]
        for c in [old, *others]:
            await c.stop()
        await proxy.close()

    run(body())


def test_a_deposed_leaders_late_write_is_rejected(etcd, key_prefix):
    """A leader paused past its deposition that wakes up and writes: the write
    is fenced on its old term and rejected, and the lead loop raises
    LeadershipLost (the election steps down on it); nothing changed."""
    async def body():
        candidates = await start_three(etcd, key_prefix)
        [old] = leaders(candidates)
        old_term = old.election.leadership.term
        observer = candidates[(candidates.index(old) + 1) % 3]
        await observer.client.revoke_lease((await observer.client.get_leader()).lease_id)
        assert await eventually(lambda: len(leaders(candidates)) == 1
                                and leaders(candidates)[0].election.leadership.term > old_term)
        [new] = leaders(candidates)
        group = GroupAssignment("g0", 1, old_term, 1, "127.0.0.1:1", [RankInfo(0, "e0", "127.0.0.1:2")], None)
        assert not await old.client.write_groups(old_term, [group])
        members = [await _member(etcd, key_prefix, "expert", "e0", {"rendezvous_port": 29500}),
                   await _member(etcd, key_prefix, "gateway", "w0")]  # enough for a plan to write a group
        with pytest.raises(LeadershipLost):
            await reconcile_once(old.client, old_term, group_size=1)
        assert await new.client.list_groups() == []
        for client in members:
            await client.close()
        for c in candidates:
            await c.stop()

    run(body())


async def _member(etcd, prefix: str, role: str, member_id: str, info: dict | None = None) -> ClusterClient:
    client = ClusterClient(etcd.endpoint, prefix=prefix)
    await client.connect()
    await client.register(role, member_id, f"127.0.0.1:{len(member_id)}", info, ttl=1)
    return client


def test_health_check_answers_whether_the_address_serves():
    """The probe's transport: True only for SERVING; a NOT_SERVING, stopped
    or absent server is a failed check, answered within the deadline."""
    async def body():
        loop = asyncio.get_running_loop()
        server = await start_server([], [], port=0)
        address = f"127.0.0.1:{server.port}"
        check = HealthCheck(timeout_s=0.2)
        assert await check(address) is False  # servers start NOT_SERVING
        assert await check.health(address) is Health.NOT_SERVING
        await server.set_serving(True)
        assert await check(address) is True
        assert await check.health(address) is Health.SERVING
        await server.stop(grace_s=0)
        started = loop.time()
        assert await check(address) is False  # refused: definite, not SILENT
        assert await check.health(address) is Health.REFUSED
        assert await check(f"127.0.0.1:{free_port()}") is False  # another address: a channel of its own
        assert loop.time() - started < 1.0
        await check.close()

    run(body())
