"""The router service over gRPC, registered in a real etcd."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from moe.router.v1 import router_pb2, router_pb2_grpc
from moemesh.etcd import start_etcd
from router_svc.config import RouterConfig
from router_svc.server import serve
from services.cluster import ClusterClient
from services.grpc_util import channel
from services.process import read_port_file


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with start_etcd(tmp_path_factory.mktemp("etcd")) as running:
        yield running


def hits(group_id: str, rank: int, layers: dict[int, list[int]]) -> router_pb2.ReportExpertHitsRequest:
    return router_pb2.ReportExpertHitsRequest(
        group_id=group_id, rank=rank, first_step_id=0, last_step_id=15,
        layers=[router_pb2.LayerHits(layer=layer, counts=counts) for layer, counts in layers.items()])


def test_reports_accumulate_and_stats_filter_by_group(etcd, tmp_path):
    config = RouterConfig(member_id="r0", etcd=etcd.endpoint, key_prefix="/t-router",
                          port_file=str(tmp_path / "router.port"), lease_ttl_s=1, metrics_port=0)

    async def body():
        stop = asyncio.Event()
        server = asyncio.create_task(serve(config, stop))
        while (port := read_port_file(config.port_file)) is None:
            assert not server.done(), server.exception()
            await asyncio.sleep(0.02)
        observer = ClusterClient(etcd.endpoint, prefix=config.key_prefix)
        await observer.connect()
        [member] = await observer.list_members("router")
        assert (member.member_id, member.address) == ("r0", f"127.0.0.1:{port}")

        async with channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            await stub.ReportExpertHits(hits("g0", 0, {0: [3, 1, 0, 0], 1: [0, 0, 2, 2]}), timeout=3)
            await stub.ReportExpertHits(hits("g0", 1, {0: [1, 1, 0, 2]}), timeout=3)
            await stub.ReportExpertHits(hits("g1", 0, {0: [0, 0, 0, 8]}), timeout=3)

            g0 = await stub.GetExpertStats(router_pb2.GetExpertStatsRequest(group_id="g0"), timeout=3)
            assert g0.num_reports == 2
            assert [(s.layer, list(s.counts)) for s in g0.layers] == [(0, [4, 2, 0, 2]), (1, [0, 0, 2, 2])]
            assert list(g0.layers[0].hit_rates) == [0.5, 0.25, 0.0, 0.25]

            every = await stub.GetExpertStats(router_pb2.GetExpertStatsRequest(), timeout=3)
            assert every.num_reports == 3
            assert list(every.layers[0].counts) == [4, 2, 0, 10]

            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.ReportExpertHits(hits("g0", 0, {0: [1, 1]}), timeout=3)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "layer 0 of group 'g0' has 4 experts, the report has 2" in error.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.ReportExpertHits(hits("", 0, {0: [1]}), timeout=3)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        stop.set()
        await asyncio.wait_for(server, 10)
        assert await observer.list_members("router") == []  # lease revoked on stop
        await observer.close()

    asyncio.run(body())


def test_process_registers_and_stops_on_sigterm(etcd, tmp_path):
    port_file = tmp_path / "r1.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "router_svc.main", "--member-id", "r1", "--port-file", str(port_file),
         "--lease-ttl-s", "1"],
        env={**os.environ, "MOEMESH_ETCD": etcd.endpoint, "MOEMESH_KEY_PREFIX": "/t-router-proc"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while (port := read_port_file(port_file)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.05)

        async def members():
            client = ClusterClient(etcd.endpoint, prefix="/t-router-proc")
            await client.connect()
            listed = [(m.member_id, m.address) for m in await client.list_members("router")]
            await client.close()
            return listed

        assert asyncio.run(members()) == [("r1", f"127.0.0.1:{port}")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert f"router r1 listening on 127.0.0.1:{port}" in proc.stdout.read().decode()
        assert asyncio.run(members()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
