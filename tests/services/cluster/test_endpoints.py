"""etcd's endpoints (services/cluster/connection.py): several endpoints make one channel that
uses the first that answers, and an etcd that no endpoint accepts a connection for fails
connect() quickly, naming every endpoint."""

import asyncio
import socket
import time

import pytest

from moemesh.etcd import start_etcd
from services.cluster import ClusterClient
from services.cluster.connection import ClusterUnavailableError, channel_target, check_reachable


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_channel_target_of_one_or_several_endpoints():
    assert channel_target([("etcd.example", 2379)]) == "etcd.example:2379"
    assert channel_target([("::1", 2379)]) == "[::1]:2379"
    assert channel_target([("127.0.0.1", 2379), ("localhost", 2380)]) == "ipv4:127.0.0.1:2379,127.0.0.1:2380"
    with pytest.raises(ValueError, match="etcd endpoint no-such-host.invalid:2379 does not resolve"):
        channel_target([("127.0.0.1", 2379), ("no-such-host.invalid", 2379)])


def test_no_endpoint_reachable_fails_quickly_naming_each():
    ports = [closed_port(), closed_port()]
    started = time.monotonic()
    with pytest.raises(ClusterUnavailableError) as error:
        asyncio.run(check_reachable([("127.0.0.1", p) for p in ports], timeout_s=1.0))
    assert time.monotonic() - started < 3.0
    for port in ports:
        assert f"127.0.0.1:{port}: " in str(error.value)
    assert "etcd unreachable within 1 s" in str(error.value) and "check --etcd" in str(error.value)


def test_client_connect_fails_within_its_reach_timeout():
    async def connect():
        client = ClusterClient(f"127.0.0.1:{closed_port()}", reach_timeout_s=0.5)
        try:
            await client.connect(wait_s=None)  # would wait forever for an etcd that listens
        finally:
            await client.close()

    started = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match="etcd unreachable within 0.5 s"):
        asyncio.run(connect())
    assert time.monotonic() - started < 3.0


def test_several_endpoints_use_the_one_that_answers(tmp_path):
    with start_etcd(tmp_path / "etcd") as etcd:
        async def roundtrip():
            async with ClusterClient(f"127.0.0.1:{closed_port()},{etcd.endpoint}", reach_timeout_s=5) as client:
                await client.register("router", "r0", "127.0.0.1:1", ttl=2)
                return [m.member_id for m in await client.list_members("router")]

        assert asyncio.run(roundtrip()) == ["r0"]


def test_a_role_exits_with_status_1_and_one_line_naming_etcd(capsys):
    from services import process

    with pytest.raises(SystemExit) as exit_info:
        with process.exit_unreachable("router"):
            raise ClusterUnavailableError("etcd unreachable within 1 s (10.0.0.1:2379: timed out)")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "router: etcd unreachable within 1 s (10.0.0.1:2379: timed out)\n"
