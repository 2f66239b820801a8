"""The leader's probes of the members, on a real etcd: a gateway that
answered and then refuses connections loses its lease at once; one that
answers NOT_SERVING (a standby, or draining), or one never seen alive,
keeps it. A rank that stops answering (hung) loses its lease within the
probe's detection bound; a gateway that does keeps it."""

import asyncio
import json
import time

from moemesh.etcd import free_port
from scheduler_svc.health import Health
from scheduler_svc.member_probe import MemberProbe, probe_members
from scheduler_svc.health_client import HealthCheck
from services.cluster import ClusterClient, cancel_and_wait
from services.grpc_util import start_server
from tests.bounded import run


async def _gateway(etcd, prefix: str, member_id: str, address: str) -> ClusterClient:
    client = ClusterClient(etcd.endpoint, prefix=prefix)
    await client.connect()
    await client.register("gateway", member_id, address, ttl=5)  # the TTL alone would take 5 s
    return client


def test_a_gateway_that_dies_loses_its_lease_and_a_standby_keeps_it(etcd, key_prefix):
    async def body():
        standby_server = await start_server([], [], port=0)  # NOT_SERVING, as a standby is
        standby = await _gateway(etcd, key_prefix, "gw-standby", f"127.0.0.1:{standby_server.port}")
        leader = ClusterClient(etcd.endpoint, prefix=key_prefix)
        await leader.connect()
        # A gateway that will die: its key under a lease nobody keeps alive (TTL 5 s), and one
        # registered where nothing ever listened (never seen alive: left to its lease).
        dying_server = await start_server([], [], port=0)
        for member_id, port in (("gw-dead", dying_server.port), ("gw-never", free_port())):
            lease = await leader._etcd.lease(5)
            await leader._etcd.put(leader.keys.member("gateway", member_id).encode(), json.dumps(
                {"member_id": member_id, "role": "gateway", "address": f"127.0.0.1:{port}"}).encode(),
                lease=lease.id)
        probing = asyncio.create_task(probe_members(leader, MemberProbe("gateway", interval_s=0.05, refusals=2), HealthCheck))

        async def gateway_ids() -> set[str]:
            return {m.member_id for m in await leader.list_members("gateway")}

        await asyncio.sleep(0.3)  # the probe has seen gw-dead answer
        assert await gateway_ids() == {"gw-standby", "gw-dead", "gw-never"}
        await dying_server.stop(0)
        started = time.monotonic()

        while "gw-dead" in await gateway_ids():
            assert time.monotonic() - started < 2.0, "the dead gateway kept its lease"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        assert await gateway_ids() == {"gw-standby", "gw-never"}
        assert await cancel_and_wait([probing], 5.0)
        for client in (standby, leader):
            await client.close()
        await standby_server.stop(0)

    run(body())


class _Scripted:
    """A HealthChecker whose answers the test sets, per address."""

    answers: dict[str, Health] = {}
    latency_s: dict[str, float] = {}

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s

    async def health(self, address: str) -> Health:
        answer = self.answers[address]
        if answer is Health.NO_ANSWER:
            await asyncio.sleep(self.deadline_s)  # as a hung process: the deadline passes
        elif address in self.latency_s:
            await asyncio.sleep(self.latency_s[address])  # as a loaded one: late, but it answers
        return answer

    async def close(self) -> None:
        pass


def test_a_hung_rank_loses_its_lease_and_a_hung_gateway_keeps_it(etcd, key_prefix):
    async def body():
        leader = ClusterClient(etcd.endpoint, prefix=key_prefix)
        await leader.connect()
        for role, member_id in (("expert", "rank-hung"), ("expert", "rank-ok"), ("expert", "rank-slow"),
                                ("gateway", "gw-hung")):
            lease = await leader._etcd.lease(5)
            await leader._etcd.put(leader.keys.member(role, member_id).encode(), json.dumps(
                {"member_id": member_id, "role": role, "address": member_id}).encode(), lease=lease.id)
        _Scripted.answers = {"rank-hung": Health.SERVING, "rank-ok": Health.NOT_SERVING, "rank-slow": Health.SERVING,
                             "gw-hung": Health.SERVING}
        # rank-slow answers every check 0.2 s late, four times the interval: a short deadline would lose it.
        _Scripted.latency_s = {"rank-slow": 0.2}
        ranks = MemberProbe("expert", interval_s=0.05, refusals=3, silent_s=0.3)
        gateways = MemberProbe("gateway", interval_s=0.05, refusals=2)
        probing = [asyncio.create_task(probe_members(leader, p, _Scripted)) for p in (ranks, gateways)]

        async def member_ids() -> set[str]:
            return {m.member_id for m in await leader.list_members()}

        await asyncio.sleep(0.5)  # every member has answered once
        _Scripted.answers.update({"rank-hung": Health.NO_ANSWER, "gw-hung": Health.NO_ANSWER})
        frozen_at = time.monotonic()
        while "rank-hung" in await member_ids():
            assert time.monotonic() - frozen_at < 2.0, "the hung rank kept its lease"
            await asyncio.sleep(0.02)
        took = time.monotonic() - frozen_at
        low, high = ranks.detection_s
        assert low - 0.05 <= took <= high + 0.5, (took, ranks.detection_s)
        await asyncio.sleep(0.5)
        # NOT_SERVING answers, so does the slow rank, however late; a silent gateway is left to its lease.
        assert await member_ids() == {"rank-ok", "rank-slow", "gw-hung"}
        assert await cancel_and_wait(probing, 5.0)
        await leader.close()

    run(body())
