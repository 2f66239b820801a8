"""Three scheduler processes on a real etcd: group formation and failover."""

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.server import SERVICE_NAME
from services.cluster import ClusterClient
from services.grpc_util import SERVING, channel
from services.process import read_port_file
from tests.bounded import run


@pytest.fixture
def schedulers(etcd, tmp_path, key_prefix):
    """Three replicas, lease TTL 1 s, groups of 2; yields {member_id: (process, address)}."""
    procs = {}
    for i in range(3):
        member_id = f"s{i}"
        port_file = tmp_path / f"{member_id}.port"
        with open(tmp_path / f"{member_id}.log", "wb") as log:  # the child keeps its own descriptor
            procs[member_id] = (subprocess.Popen(
                [sys.executable, "-m", "scheduler_svc.main", "--member-id", member_id, "--etcd", etcd.endpoint,
                 "--port", "0", "--port-file", str(port_file), "--group-size", "2", "--lease-ttl-s", "1",
                 "--key-prefix", key_prefix],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}), port_file)
    running = {}
    try:
        deadline = time.monotonic() + 30
        for member_id, (proc, port_file) in procs.items():
            while (port := read_port_file(port_file)) is None:
                assert proc.poll() is None, _log(tmp_path, member_id)
                assert time.monotonic() < deadline, f"{member_id} wrote no port file"
                time.sleep(0.05)
            running[member_id] = (proc, f"127.0.0.1:{port}")
        yield running
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for member_id, (proc, _) in procs.items():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(f"{member_id} ignored SIGTERM:\n{_log(tmp_path, member_id)}")


def _log(tmp_path: pathlib.Path, member_id: str) -> str:
    return (tmp_path / f"{member_id}.log").read_text(errors="replace")[-3000:]


async def cluster_state(address: str) -> scheduler_pb2.GetClusterStateResponse:
    async with channel(address) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        return await stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=3)


async def health(address: str) -> list[int]:
    """The overall and the SchedulerService health status."""
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return [(await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=3)).status
                for name in ("", SERVICE_NAME)]


async def poll(fn, timeout_s: float = 10.0):
    """Calls async fn until it returns a truthy value; returns the last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = await fn()
        if value or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.05)


async def registered(etcd, prefix: str, role: str, member_id: str, port: int,
                     info: dict | None = None) -> ClusterClient:
    client = ClusterClient(etcd.endpoint, prefix=prefix)
    await client.connect()
    await client.register(role, member_id, f"127.0.0.1:{port}", info, ttl=1)
    return client


def test_group_forms_and_survives_leader_kill(etcd, schedulers, key_prefix):
    async def body():
        e0 = await registered(etcd, key_prefix, "expert", "e0", 7000, {"rendezvous_port": 29500})
        e1 = await registered(etcd, key_prefix, "expert", "e1", 7001, {"rendezvous_port": 29501})
        w0 = await registered(etcd, key_prefix, "gateway", "w0", 8000)

        group = await poll(lambda: w0.get_group("g0"))
        assert group is not None, "no group formed"
        assert [(r.rank, r.member_id, r.address) for r in group.ranks] == [
            (0, "e0", "127.0.0.1:7000"), (1, "e1", "127.0.0.1:7001")]
        assert (group.epoch, group.world_size, group.gateway_id) == (1, 2, "w0")
        assert group.rendezvous_address == "127.0.0.1:29500"
        assert await e0.mark_rank_ready("g0", 1, 0, "e0")

        states = [await cluster_state(address) for _, address in schedulers.values()]
        assert {s.leader.member_id for s in states} == {states[0].leader.member_id}
        assert {s.leader.term for s in states} == {group.term}
        assert [s.replica_id for s in states if s.is_leader] == [states[0].leader.member_id]
        assert [await health(a) for _, a in schedulers.values()] == [[SERVING, SERVING]] * 3
        [group_pb] = states[0].groups
        assert (group_pb.group_id, group_pb.gateway_id, group_pb.rendezvous_address) == (
            "g0", "w0", "127.0.0.1:29500")
        assert [(r.member_id, r.is_ready) for r in group_pb.ranks] == [("e0", True), ("e1", False)]
        assert {m.member_id for m in states[0].members} == {"s0", "s1", "s2", "e0", "e1", "w0"}

        old = states[0].leader
        schedulers[old.member_id][0].send_signal(signal.SIGKILL)
        survivors = [a for m, (_, a) in schedulers.items() if m != old.member_id]

        async def new_leader():
            leader = await w0.get_leader()
            return leader if leader is not None and leader.term > old.term else None

        leader = await poll(new_leader)
        assert leader is not None and leader.member_id != old.member_id
        states = [await cluster_state(a) for a in survivors]
        assert {(s.leader.member_id, s.leader.term) for s in states} == {(leader.member_id, leader.term)}
        assert await w0.get_group("g0") == group  # intact: not rewritten by the new leader

        # The new leader acts: a rank leaves, the group waits for a member; a standby
        # registers and takes the rank in a new epoch.
        await e1.close()
        await asyncio.sleep(0.5)
        assert await w0.get_group("g0") == group
        e2 = await registered(etcd, key_prefix, "expert", "e2", 7002, {"rendezvous_port": 29502})

        async def regrouped_epoch():
            got = await w0.get_group("g0")
            return got if got is not None and got.epoch > group.epoch else None

        regrouped = await poll(regrouped_epoch)
        assert [r.member_id for r in regrouped.ranks] == ["e0", "e2"] and regrouped.epoch == 2
        assert (regrouped.term, regrouped.gateway_id) == (leader.term, "w0")
        for client in (e0, e2, w0):
            await client.close()

    run(body())


def test_sigterm_resigns_at_once(etcd, schedulers, key_prefix):
    """A graceful stop revokes the lease: a follower leads well within the TTL."""
    async def body():
        client = ClusterClient(etcd.endpoint, prefix=key_prefix)
        await client.connect()
        old = await poll(client.get_leader)
        started = time.monotonic()
        proc = schedulers[old.member_id][0]
        proc.send_signal(signal.SIGTERM)

        async def new_leader():
            leader = await client.get_leader()
            return leader if leader is not None and leader.term > old.term else None

        leader = await poll(new_leader, timeout_s=5)
        assert leader is not None
        # The lease was refreshed at most ttl/3 ago, so it cannot expire within
        # 0.66 s: a new leader sooner than that means the lease was revoked.
        assert time.monotonic() - started < 0.5
        assert await asyncio.to_thread(proc.wait, 10) == 0
        await client.close()

    run(body())


def test_config_from_flags_then_env_then_defaults():
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.server import leader_probe
    from services.settings import parse_config

    env = {"MOEMESH_GROUP_SIZE": "4", "MOEMESH_ETCD": "10.0.0.1:2379", "MOEMESH_MEMBER_ID": "s9"}
    config = parse_config(SchedulerConfig, ["--group-size", "3", "--port-file", "/tmp/p"], env=env)
    assert (config.member_id, config.group_size, config.etcd) == ("s9", 3, "10.0.0.1:2379")
    assert (config.port, config.port_file, config.lease_ttl_s, config.key_prefix) == (0, "/tmp/p", 2, "/moemesh")
    with pytest.raises(SystemExit):  # __post_init__'s ValueError is a usage error
        parse_config(SchedulerConfig, ["--member-id", "s0", "--group-size", "0"], env={})
    with pytest.raises(SystemExit):  # member_id has no default
        parse_config(SchedulerConfig, [], env={})
    with pytest.raises(ValueError, match="lease_ttl_s must be >= 1"):
        SchedulerConfig(member_id="s0", lease_ttl_s=0)
    assert (config.leader_probe_interval_s, config.leader_probe_timeout_s, config.leader_probe_misses) == (0.1, 0.1, 2)
    probe = parse_config(SchedulerConfig, ["--leader-probe-misses", "3", "--leader-probe-interval-s", "0"],
                         env={"MOEMESH_MEMBER_ID": "s1", "MOEMESH_LEADER_PROBE_TIMEOUT_S": "0.25"})
    assert (probe.leader_probe_interval_s, probe.leader_probe_timeout_s, probe.leader_probe_misses) == (0.0, 0.25, 3)
    assert leader_probe(probe, None) is None  # interval 0: probing off
    for bad in ({"leader_probe_misses": 0}, {"leader_probe_timeout_s": 0.0}, {"leader_probe_interval_s": -1.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            SchedulerConfig(member_id="s0", **bad)
