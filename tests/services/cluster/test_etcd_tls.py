"""etcd over mutual TLS with its authentication on (services/cluster/etcd_tls.py):
each role's user writes exactly the keys of docs/internals.md's layout that
the role writes, reads the whole prefix, and enabling twice is harmless."""

import asyncio

import pytest

from moemesh import etcd
from services import certs, tls
from services.cluster import etcd_tls
from services.cluster.client import ClusterClient

PREFIX = "/moemesh/"
# Key -> the roles that write it (docs/internals.md, "etcd layout").
WRITERS = {
    "members/expert/e0": {"expert", "scheduler"},
    "members/gateway/g0": {"gateway", "scheduler"},
    "members/router/r0": {"router", "scheduler"},
    "members/scheduler/s0": {"scheduler"},
    "leader": {"scheduler"},
    "groups/g": {"scheduler"},
    "ready/g/1/0": {"expert", "scheduler"},
    "failures/g/1/0": {"expert", "scheduler"},
    "placement/g": {"scheduler"},
    "placement_ready/g/1/0": {"expert", "scheduler"},
}


@pytest.fixture(scope="module")
def secured_etcd(tmp_path_factory):
    root = tmp_path_factory.mktemp("etcd-tls")
    dirs = certs.make_local_pki(root / "tls")
    server = etcd.start_etcd(root / "etcd", tls_dir=dirs["etcd"])
    try:
        etcd_tls.enable_auth(server.endpoint, tls.TlsFiles.from_dir(dirs[certs.ETCD_ROOT]))
        etcd_tls.enable_auth(server.endpoint, tls.TlsFiles.from_dir(dirs[certs.ETCD_ROOT]))  # a no-op now
        yield server, dirs
    finally:
        server.stop()


async def outcomes(endpoint: str, files: tls.TlsFiles, role: str) -> dict[str, bool]:
    """Key -> whether role could write it; and it reads every key it wrote."""
    tls.configure(tls.MeshTls(files, role))
    client = ClusterClient(endpoint, call_timeout_s=2.0, retry_s=2.0)
    try:
        await client.connect(wait_s=5)
        written = {}
        for key in WRITERS:
            try:
                await client._etcd.put((PREFIX + key).encode(), role.encode())
                written[key] = True
            except Exception as error:  # aetcd's error for etcd's answer
                assert "permission denied" in str(error), error
                written[key] = False
        kvs = list(await client._etcd.get_prefix(PREFIX.encode()))
        assert kvs, f"{role} reads nothing under {PREFIX}"
        return written
    finally:
        await client.close()
        tls.configure(None)


@pytest.mark.parametrize("role", tls.ROLES)
def test_each_role_writes_exactly_its_keys(secured_etcd, role):
    server, dirs = secured_etcd
    if role == "operator":  # writes nothing: read with another role's keys in place first
        asyncio.run(outcomes(server.endpoint, tls.TlsFiles.from_dir(dirs["scheduler"]), "scheduler"))
    written = asyncio.run(outcomes(server.endpoint, tls.TlsFiles.from_dir(dirs[role]), role))
    assert written == {key: role in writers for key, writers in WRITERS.items()}


def test_permissions_name_every_role():
    assert set(etcd_tls.permissions()) == set(tls.ROLES)
    assert etcd_tls._prefix_range("/moemesh/") == (b"/moemesh/", b"/moemesh0")
