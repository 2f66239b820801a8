"""etcd over mutual TLS, and etcd's users and roles for the mesh's members.

`TlsClient` is aetcd's client on a TLS channel (aetcd 1.0 only opens
plaintext channels): it presents the member's certificate, whose CN etcd
(started with --client-cert-auth) takes as the user name, and checks that
etcd's certificate names `etcd.moemesh`.

`PERMISSIONS` is what each role's etcd user may touch under the key prefix,
from who writes which key (services/cluster/records.Keys and
services/placement_store.py): every member reads the whole prefix (it
watches the cluster state); a member writes its own role's registrations;
an expert service also writes its ready marks and failure reports; the
scheduler owns the rest (leader, groups, placements, and deleting stale
marks and deposed members' leases), so it reads and writes everything.
etcd's permissions are per key range, not per member: any expert can write
another expert's registration (docs/security.md, "etcd").

`enable_auth` creates those users and roles plus `root`, and turns etcd's
authentication on; `python -m services.cluster.etcd_tls --endpoint H:P
--tls-dir ROOT_DIR [--key-prefix /moemesh]` does it for a cluster's etcd
(a Kubernetes Job, with the root user's certificate).
"""

import argparse
import asyncio
import logging

import aetcd
import grpc
from aetcd import client as aetcd_client
from aetcd import rpc as etcd_rpc

from services import tls

log = logging.getLogger(__name__)

_READ, _WRITE, _READWRITE = 0, 1, 2
ROOT_USER = "root"


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """[key, range_end) of every key starting with prefix."""
    key = prefix.encode()
    return key, key[:-1] + bytes([key[-1] + 1])


def permissions(prefix: str = "/moemesh") -> dict[str, list[tuple[int, str]]]:
    """role -> [(permission type, key prefix)] under prefix."""
    root = prefix.rstrip("/") + "/"
    read_all = (_READ, root)
    return {
        "scheduler": [(_READWRITE, root)],
        "expert": [read_all, (_WRITE, root + "members/expert/"), (_WRITE, root + "ready/"),
                   (_WRITE, root + "failures/"), (_WRITE, root + "placement_ready/")],
        "gateway": [read_all, (_WRITE, root + "members/gateway/")],
        "router": [read_all, (_WRITE, root + "members/router/")],
        "operator": [read_all],
    }


class TlsClient(aetcd.Client):
    """aetcd.Client on a mutual-TLS channel (certificate authentication: no password)."""

    def __init__(self, host: str, port: int, *, files: tls.TlsFiles, **kwargs):
        super().__init__(host=host, port=port, **kwargs)
        self._files = files

    @aetcd_client._handle_errors
    async def connect(self) -> None:
        """aetcd.Client.connect with a secure channel (the files read now)."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            options = [*self._options.items(), ("grpc.ssl_target_name_override", tls.ETCD_SAN)]
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}",
                                                   tls.channel_credentials(self._files), options=options)
            self.kvstub = etcd_rpc.KVStub(self.channel)
            self.clusterstub = etcd_rpc.ClusterStub(self.channel)
            self.leasestub = etcd_rpc.LeaseStub(self.channel)
            self.maintenancestub = etcd_rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd_client.watcher.Watcher(etcd_rpc.WatchStub(self.channel), timeout=self._timeout,
                                                         metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(target: str, **kwargs) -> aetcd.Client:
    """An etcd client of the gRPC target (host:port, or a list of addresses:
    services/cluster/connection.channel_target): on TLS when the process has
    it (tls.active()), else plaintext. aetcd dials f"{host}:{port}", so the
    target is handed over split at its last colon."""
    host, _, port = target.rpartition(":")
    mesh_tls = tls.active()
    if mesh_tls is None:
        return aetcd.Client(host=host, port=port, **kwargs)
    return TlsClient(host, port, files=mesh_tls.files, **kwargs)


def _call_tolerating_exists(call, request) -> None:
    """An auth call that may already have been made (a restarted `moemesh up` on the same etcd)."""
    try:
        call(request, timeout=5)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION or "already exists" not in (error.details() or ""):
            raise


def enable_auth(endpoint: str, root_files: tls.TlsFiles, prefix: str = "/moemesh") -> None:
    """Creates a passwordless user and a role per mesh role with PERMISSIONS, and
    `root`, then enables authentication (a no-op where it already is)."""
    ca, cert, key = root_files.read()
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    with grpc.secure_channel(endpoint, credentials, options=[("grpc.ssl_target_name_override", tls.ETCD_SAN)]) as ch:
        auth = etcd_rpc.AuthStub(ch)
        if auth.AuthStatus(etcd_rpc.AuthStatusRequest(), timeout=5).enabled:
            return
        no_password = etcd_rpc.UserAddOptions(no_password=True)
        for role, perms in {ROOT_USER: [], **permissions(prefix)}.items():
            _call_tolerating_exists(auth.RoleAdd, etcd_rpc.AuthRoleAddRequest(name=role))
            for perm_type, key_prefix in perms:
                start, end = _prefix_range(key_prefix)
                auth.RoleGrantPermission(etcd_rpc.AuthRoleGrantPermissionRequest(
                    name=role, perm=etcd_rpc.Permission(permType=perm_type, key=start, range_end=end)), timeout=5)
            _call_tolerating_exists(auth.UserAdd, etcd_rpc.AuthUserAddRequest(name=role, options=no_password))
            auth.UserGrantRole(etcd_rpc.AuthUserGrantRoleRequest(user=role, role=role), timeout=5)
        auth.AuthEnable(etcd_rpc.AuthEnableRequest(), timeout=5)
    log.info("etcd authentication enabled on %s for %s", endpoint, ", ".join(permissions(prefix)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.cluster.etcd_tls",
                                     description="create the mesh's etcd users and roles and enable authentication")
    parser.add_argument("--endpoint", required=True, help="etcd host:port")
    parser.add_argument("--tls-dir", required=True, help="ca.crt, tls.crt, tls.key of etcd's root user (CN root)")
    parser.add_argument("--key-prefix", default="/moemesh")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    enable_auth(args.endpoint, tls.TlsFiles.from_dir(args.tls_dir), args.key_prefix)


if __name__ == "__main__":
    main()
