"""The whole mesh with mutual TLS (`moemesh up --tls`): it serves as the
plaintext mesh does, the operator's CLI reaches it with its certificate, etcd
refuses clients without the CA's certificate and writes outside a role's keys,
an expert service that cannot prove its identity never joins a group, and a
rank's certificate rotates in place while it serves."""

import asyncio
import contextlib
import io
import socket
import ssl
import subprocess
import sys
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moe.router.v1 import router_pb2, router_pb2_grpc
from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from moemesh import cli, launcher
from services import certs, tls
from services.cluster.client import ClusterClient
from services.cluster.connection import ClusterUnavailableError
from tests.conftest import hf_greedy

PROMPTS = ["Hello", "Mixture-of-experts models route each token to a few experts. " * 4]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def tls_mesh(tiny_model_dir):
    """A mesh of its own with TLS on (1 rank, CPU)."""
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=1, device="cpu", http_port=-1, tls=True)
    with launcher.Mesh(spec) as running:
        yield running


def client_channel(mesh, with_cert: bool) -> grpc.Channel:
    """A client of the gateway: with the operator's certificate, or only trusting the CA."""
    files = mesh.tls_files("operator")
    credentials = tls.channel_credentials(files) if with_cert else \
        grpc.ssl_channel_credentials(root_certificates=files.ca.read_bytes())
    return grpc.secure_channel(mesh.gateway_address, credentials, options=tls.channel_options("gateway"))


def generate_ids(channel, request_id: str, prompt: str) -> tuple[list[int], list[int]]:
    stub = gateway_pb2_grpc.GenerationServiceStub(channel)
    prompt_ids = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=prompt), timeout=10).token_ids)
    sampling = gateway_pb2.SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    token_ids = []
    for response in stub.Generate(gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt,
                                                              sampling=sampling), timeout=120):
        token_ids += response.token_ids
    return prompt_ids, token_ids


def test_tls_mesh_serves_as_the_plaintext_one(tls_mesh, hf_model):
    for with_cert in (False, True):
        with client_channel(tls_mesh, with_cert) as channel:
            for i, prompt in enumerate(PROMPTS):
                prompt_ids, token_ids = generate_ids(channel, f"tls-{with_cert}-{i}", prompt)
                assert token_ids == hf_greedy(hf_model, prompt_ids, NUM_TOKENS)


def test_ranks_report_their_hits_to_the_router_over_tls(tls_mesh):
    """Runs after serving: the expert service's reports reached the router (ReportExpertHits, expert role)."""
    router = next(r for r in tls_mesh.roles if r.name == "router")
    with tls_mesh.operator_channel(f"127.0.0.1:{router.port}", "router") as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        deadline = time.monotonic() + 30
        while (stats := stub.GetExpertStats(router_pb2.GetExpertStatsRequest(), timeout=5)).num_reports == 0:
            assert time.monotonic() < deadline, "no hit report reached the router"
            time.sleep(0.2)
    assert sum(sum(layer.counts) for layer in stats.layers) > 0


def test_plaintext_clients_are_refused(tls_mesh):
    with grpc.insecure_channel(tls_mesh.gateway_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            gateway_pb2_grpc.GenerationServiceStub(channel).Tokenize(gateway_pb2.TokenizeRequest(text="x"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_operator_reads_the_state_with_its_certificate_only(tls_mesh):
    scheduler = tls_mesh.scheduler_addresses[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["status", "--target", scheduler, "--tls-dir", str(tls_mesh.tls_dirs["operator"])])
    assert code == 0
    assert "rank 0: expert-0" in out.getvalue() and "ready" in out.getvalue()
    codes = {}
    for role in ("gateway", "expert"):  # mesh certificates of roles the RPC is not for
        with grpc.secure_channel(scheduler, tls.channel_credentials(tls_mesh.tls_files(role)),
                                 options=tls.channel_options("scheduler")) as channel:
            try:
                scheduler_pb2_grpc.SchedulerServiceStub(channel).GetClusterState(
                    scheduler_pb2.GetClusterStateRequest(), timeout=5)
            except grpc.RpcError as error:
                codes[role] = error.code()
    assert codes == dict.fromkeys(("gateway", "expert"), grpc.StatusCode.PERMISSION_DENIED)


def test_etcd_refuses_other_certificates_and_other_roles_keys(tls_mesh, tmp_path):
    other = certs.make_ca("another CA")
    foreign = certs.write_member(tmp_path / "foreign", other.cert, certs.issue_role(other, "expert"))

    async def attempt(files: tls.TlsFiles | None, role: str, key: str) -> str:
        tls.configure(None if files is None else tls.MeshTls(files, role))
        client = ClusterClient(tls_mesh.etcd_endpoint, call_timeout_s=1.0, retry_s=2.0)
        try:
            await client.connect(wait_s=2)
            await client._retry("put", client._etcd.put, key.encode(), b"{}", budget_s=2)
            return "written"
        except ClusterUnavailableError:
            return "unreachable"
        except Exception as error:  # the etcd error as aetcd raises it
            return "denied" if "permission denied" in str(error) else repr(error)
        finally:
            await client.close()
            tls.configure(None)

    outcomes = {
        "plaintext": asyncio.run(attempt(None, "expert", "/moemesh/members/expert/x")),
        "another CA": asyncio.run(attempt(foreign, "expert", "/moemesh/members/expert/x")),
        "router as expert": asyncio.run(attempt(tls_mesh.tls_files("router"), "router", "/moemesh/members/expert/x")),
        "expert as leader": asyncio.run(attempt(tls_mesh.tls_files("expert"), "expert", "/moemesh/leader")),
    }
    assert outcomes == {"plaintext": "unreachable", "another CA": "unreachable",
                        "router as expert": "denied", "expert as leader": "denied"}


def test_an_expert_that_cannot_prove_its_identity_never_joins(tls_mesh, tiny_model_dir):
    """An expert service started with the router's certificate: etcd refuses its registration."""
    log_path = tls_mesh.work_dir / "impostor.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "expert_svc.main", "--member-id", "impostor", "--etcd", tls_mesh.etcd_endpoint,
             "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--metrics-port", "0",
             "--tls-dir", str(tls_mesh.tls_dirs["router"])], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "permission denied" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None or time.monotonic() < deadline, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        time.sleep(2)  # a few more registration attempts
        with tls_mesh.operator_channel(tls_mesh.scheduler_addresses[0], "scheduler") as channel:
            state = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetClusterState(
                scheduler_pb2.GetClusterStateRequest(), timeout=5)
    finally:
        proc.terminate()
        proc.wait(30)
    assert "impostor" not in {m.member_id for m in state.members}
    assert all(r.member_id != "impostor" for g in state.groups for r in g.ranks)
    assert [r.member_id for g in state.groups for r in g.ranks] == ["expert-0"]


def served_certificate(address: str, files: tls.TlsFiles, server_name: str) -> bytes:
    """The DER certificate a new TLS connection to address is served (presenting files)."""
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=server_name) as conn:
            return conn.getpeercert(binary_form=True)


def group_state(mesh) -> scheduler_pb2.GetClusterStateResponse:
    with mesh.operator_channel(mesh.scheduler_addresses[0], "scheduler") as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).GetClusterState(
            scheduler_pb2.GetClusterStateRequest(), timeout=5)


def test_rotating_a_ranks_certificate_keeps_its_streams_and_serves_the_new_one(tls_mesh, hf_model):
    """expert-0's files are replaced while it serves: new connections get the new
    certificate, the gateway's open step streams go on (the group keeps its epoch)."""
    expert = next(r for r in tls_mesh.roles if r.name == "expert-0")
    address = f"127.0.0.1:{expert.port}"
    operator = tls_mesh.tls_files("operator")
    before = served_certificate(address, operator, tls.san("expert"))
    epochs = [g.placement_epoch for g in group_state(tls_mesh).groups]
    assert len(epochs) == 1
    root = tls_mesh.work_dir / "tls"
    ca = certs.Pem((root / "ca.crt").read_bytes(), (root / "ca.key").read_bytes())
    rotated = certs.issue_role(ca, "expert")
    certs.write_member(tls_mesh.tls_dirs["expert"], ca.cert, rotated)

    after = served_certificate(address, operator, tls.san("expert"))
    assert after != before
    assert after == x509.load_pem_x509_certificate(rotated.cert).public_bytes(serialization.Encoding.DER)
    with client_channel(tls_mesh, with_cert=False) as channel:
        prompt_ids, token_ids = generate_ids(channel, "after-rotation", PROMPTS[0])
    assert token_ids == hf_greedy(hf_model, prompt_ids, NUM_TOKENS)
    assert [g.placement_epoch for g in group_state(tls_mesh).groups] == epochs
    assert expert.proc.poll() is None
