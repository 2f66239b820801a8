"""Mutual TLS between roles (services/tls.py, services/grpc_util.py): each
RPC answers only the roles services.tls.ACCESS names; callers without a
certificate, with another CA's, or with the wrong role's are refused; a
server that cannot prove its role is refused by its callers; replacing the
files rotates the certificates without breaking open streams."""

import asyncio
import pathlib
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from moe.router.v1 import router_pb2
from moe.scheduler.v1 import scheduler_pb2
from services import certs, grpc_util, tls


class FakeExpert(expert_pb2_grpc.ExpertServiceServicer):
    """Answers every call; remembers the certificate each caller presented."""

    def __init__(self):
        self.peer_certs: list[bytes] = []

    async def GetRankInfo(self, request, context):
        self.peer_certs.append(context.auth_context()["x509_pem_cert"][0])
        return expert_pb2.GetRankInfoResponse()

    async def ExecuteSteps(self, request_iterator, context):
        async for _ in request_iterator:
            yield expert_pb2.ExecuteStepsResponse()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[pathlib.Path, certs.Pem]:
    root = tmp_path_factory.mktemp("pki")
    ca = certs.make_ca()
    for role in tls.ROLES:
        certs.write_member(root / role, ca.cert, certs.issue_role(ca, role))
    other = certs.make_ca("another CA")
    certs.write_member(root / "foreign-gateway", other.cert, certs.issue_role(other, "gateway"))
    certs.write_member(root / "no-role", ca.cert, certs.issue(ca, "nobody", ("nobody.example",)))
    return root, ca


def member(root: pathlib.Path, name: str, role: str | None = None) -> tls.MeshTls:
    return tls.MeshTls(tls.TlsFiles.from_dir(root / name), role or name)


async def start_expert(mesh_tls: tls.MeshTls, servicer=None):
    servicer = servicer or FakeExpert()
    return await grpc_util.start_server(
        [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(servicer, s)],
        ["moe.expert.v1.ExpertService"], mesh_tls=mesh_tls)


async def rank_info(channel) -> grpc.StatusCode:
    try:
        await expert_pb2_grpc.ExpertServiceStub(channel).GetRankInfo(expert_pb2.GetRankInfoRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        return error.code()


async def one_step(channel) -> grpc.StatusCode:
    call = expert_pb2_grpc.ExpertServiceStub(channel).ExecuteSteps(timeout=5)
    try:
        await call.write(expert_pb2.ExecuteStepsRequest())
        await call.read()
        await call.done_writing()
        return await call.code()
    except grpc.aio.AioRpcError as error:
        return error.code()


def test_every_role_rpc_has_an_access_rule():
    rpcs = {f"/{service.full_name}/{method.name}"
            for pb in (expert_pb2, router_pb2, scheduler_pb2) for service in pb.DESCRIPTOR.services_by_name.values()
            for method in service.methods}
    assert rpcs == set(tls.ACCESS)
    assert all(roles <= set(tls.ROLES) for roles in tls.ACCESS.values())


def test_each_rpc_answers_only_its_roles(pki):
    root, _ = pki

    async def body():
        server = await start_expert(member(root, "expert"))
        target = f"127.0.0.1:{server.port}"
        try:
            codes = {}
            for name in ("gateway", "operator", "router", "scheduler"):
                async with grpc_util.channel(target, "expert", mesh_tls=member(root, name)) as channel:
                    codes[name] = (await rank_info(channel), await one_step(channel))
            return codes
        finally:
            await server.stop(0)

    codes = asyncio.run(body())
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert codes == {"gateway": (grpc.StatusCode.OK, grpc.StatusCode.OK),
                     "operator": (grpc.StatusCode.OK, denied),
                     "router": (denied, denied), "scheduler": (denied, denied)}


def test_callers_without_a_certificate_of_the_ca_are_refused(pki):
    root, ca = pki

    async def body():
        server = await start_expert(member(root, "expert"))
        target = f"127.0.0.1:{server.port}"
        override = tls.channel_options("expert")
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca.cert)
        channels = {
            "plaintext": grpc.aio.insecure_channel(target),
            "no certificate": grpc.aio.secure_channel(target, no_cert, options=override),
            "another CA": grpc_util.channel(target, "expert", mesh_tls=member(root, "foreign-gateway", "gateway")),
        }
        try:
            return {name: await rank_info(channel) for name, channel in channels.items()}
        finally:
            for channel in channels.values():
                await channel.close()
            await server.stop(0)

    # Refused in the handshake: the call never reaches a handler.
    assert asyncio.run(body()) == dict.fromkeys(("plaintext", "no certificate", "another CA"),
                                                grpc.StatusCode.UNAVAILABLE)


def rank_info_between(server_tls: tls.MeshTls, caller_tls: tls.MeshTls) -> grpc.StatusCode:
    """GetRankInfo's status from a caller, asking for an expert, to a server with server_tls."""
    async def body():
        server = await start_expert(server_tls)
        try:
            async with grpc_util.channel(f"127.0.0.1:{server.port}", "expert", mesh_tls=caller_tls) as channel:
                return await rank_info(channel)
        finally:
            await server.stop(0)

    return asyncio.run(body())


def test_a_certificate_naming_no_role_is_unauthenticated(pki):
    root, _ = pki
    code = rank_info_between(member(root, "expert"), member(root, "no-role", "gateway"))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_a_server_that_cannot_prove_its_role_is_refused_by_its_callers(pki):
    """A process serving with a router's certificate where the gateway expects an expert."""
    root, _ = pki
    assert rank_info_between(member(root, "router"), member(root, "gateway")) == grpc.StatusCode.UNAVAILABLE


def test_the_gateway_port_takes_clients_without_a_certificate(pki):
    """Its public API is for clients (API keys authenticate them); role RPCs still need a role."""
    root, ca = pki

    async def body():
        server = await start_expert(member(root, "gateway"))  # a gateway's port, serving a role service
        target = f"127.0.0.1:{server.port}"
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca.cert)
        try:
            async with grpc.aio.secure_channel(target, no_cert, options=tls.channel_options("gateway")) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return health.status, await rank_info(channel)
        finally:
            await server.stop(0)

    status, code = asyncio.run(body())
    assert status == grpc_util.NOT_SERVING  # answered: the handshake passed without a certificate
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_rotation_keeps_streams_and_new_connections_use_the_new_files(tmp_path):
    """The expert's files are replaced by a certificate of a new CA (its bundle
    trusting both): the open stream goes on, a new client trusting only the new
    CA connects, one trusting only the old CA no longer does; the gateway's
    replaced certificate is the one its next new channel presents."""
    old_ca, new_ca = certs.make_ca("old"), certs.make_ca("new")
    expert = member_of(tmp_path / "expert", old_ca.cert, certs.issue_role(old_ca, "expert"), "expert")
    gateway = member_of(tmp_path / "gateway", old_ca.cert + new_ca.cert, certs.issue_role(old_ca, "gateway"),
                        "gateway")
    old_only = member_of(tmp_path / "old-only", old_ca.cert, certs.issue_role(old_ca, "gateway"), "gateway")
    new_only = member_of(tmp_path / "new-only", new_ca.cert, certs.issue_role(new_ca, "gateway"), "gateway")
    servicer = FakeExpert()

    async def body():
        server = await start_expert(expert, servicer)
        target = f"127.0.0.1:{server.port}"
        try:
            async with grpc_util.channel(target, "expert", mesh_tls=gateway) as channel:
                call = expert_pb2_grpc.ExpertServiceStub(channel).ExecuteSteps(timeout=30)
                await call.write(expert_pb2.ExecuteStepsRequest())
                await call.read()
                assert await rank_info(channel) == grpc.StatusCode.OK
                new_gateway_cert = certs.issue_role(new_ca, "gateway")
                certs.write_member(tmp_path / "expert", old_ca.cert + new_ca.cert, certs.issue_role(new_ca, "expert"))
                certs.write_member(tmp_path / "gateway", old_ca.cert + new_ca.cert, new_gateway_cert)
                codes = {}
                for name, caller in (("new CA", new_only), ("old CA", old_only), ("gateway", gateway)):
                    async with grpc_util.channel(target, "expert", mesh_tls=caller) as fresh:
                        codes[name] = await rank_info(fresh)
                for _ in range(3):  # the stream opened before the rotation still steps
                    await call.write(expert_pb2.ExecuteStepsRequest())
                    assert (await call.read()).HasField("result") is False
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
                return codes, new_gateway_cert
        finally:
            await server.stop(0)

    codes, new_gateway_cert = asyncio.run(body())
    assert codes == {"new CA": grpc.StatusCode.OK, "old CA": grpc.StatusCode.UNAVAILABLE,
                     "gateway": grpc.StatusCode.OK}
    assert servicer.peer_certs[-1].strip() == new_gateway_cert.cert.strip()
    assert servicer.peer_certs[0] != servicer.peer_certs[-1]


def test_a_half_written_pair_keeps_the_current_certificate(tmp_path):
    """A key that is not the certificate's (files caught mid-rotation) is not loaded."""
    ca = certs.make_ca()
    files = certs.write_member(tmp_path, ca.cert, certs.issue_role(ca, "expert"))
    other = certs.issue_role(ca, "expert")
    (tmp_path / tls.CERT_FILE).write_bytes(other.cert)
    with pytest.raises(ValueError, match="is not the key of"):
        tls.server_credentials(files)


def member_of(directory: pathlib.Path, ca_cert: bytes, pem: certs.Pem, role: str) -> tls.MeshTls:
    return tls.MeshTls(certs.write_member(directory, ca_cert, pem), role)


def test_tls_dir_missing_a_file_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="has no ca.crt"):
        tls.TlsFiles.from_dir(tmp_path)


def test_a_role_started_with_an_incomplete_tls_dir_stops_naming_the_file(tmp_path):
    result = subprocess.run([sys.executable, "-m", "router_svc.main", "--member-id", "r0", "--metrics-port", "0",
                             "--tls-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "has no ca.crt" in result.stderr


def test_a_kept_channel_is_reopened_once_the_certificate_rotates(tmp_path):
    """LastAddressStub (the router's channel to the scheduler leader, the
    schedulers' health probes) presents the new certificate after a rotation."""
    ca = certs.make_ca()
    gateway = member_of(tmp_path / "gateway", ca.cert, certs.issue_role(ca, "gateway"), "gateway")
    servicer = FakeExpert()

    async def body():
        server = await start_expert(member_of(tmp_path / "expert", ca.cert, certs.issue_role(ca, "expert"),
                                              "expert"), servicer)
        stubs = grpc_util.LastAddressStub(expert_pb2_grpc.ExpertServiceStub, "expert")
        target = f"127.0.0.1:{server.port}"
        tls.configure(gateway)
        try:
            first = await stubs.to(target)
            await first.GetRankInfo(expert_pb2.GetRankInfoRequest(), timeout=5)
            assert await stubs.to(target) is first  # kept while nothing changed
            certs.write_member(tmp_path / "gateway", ca.cert, certs.issue_role(ca, "gateway"))
            second = await stubs.to(target)
            await second.GetRankInfo(expert_pb2.GetRankInfoRequest(), timeout=5)
            return first is not second
        finally:
            tls.configure(None)
            await stubs.close()
            await server.stop(0)

    assert asyncio.run(body())
    assert servicer.peer_certs[0] != servicer.peer_certs[1]
    assert servicer.peer_certs[1].strip() == (tmp_path / "gateway" / tls.CERT_FILE).read_bytes().strip()
