"""The leader's probe of the gateways, on a real etcd: a gateway that
answered and then refuses connections loses its lease at once; one that
answers NOT_SERVING (a standby, or draining), or one never seen alive,
keeps it."""

import asyncio
import json
import time

from moemesh.etcd import free_port
from scheduler_svc.gateway_probe import GatewayProbe, probe_gateways
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
        probing = asyncio.create_task(probe_gateways(leader, GatewayProbe(interval_s=0.05, timeout_s=0.1, misses=2), HealthCheck))

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
