"""The mesh spread over "hosts" on one machine: a 3-member etcd cluster started with
`moemesh etcd`, the control plane and gateway started by one `moemesh up --roles ...` and the
expert services by another, each bound to its own loopback address (Linux routes all of 127/8
through lo, so 127.0.0.1, .2 and .3 stand for three hosts). Greedy outputs through the
gateway equal transformers'; every role registered the address of its own host; the mesh
keeps serving when the etcd member its clients talk to is killed.

The network-namespace version, with real links between the hosts, is tests/e2e/test_multihost.py.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.cluster import ClusterClient
from tests.conftest import hf_greedy
from tests.e2e.test_mesh_e2e import generate, greedy
from tests.moemesh.test_metrics_relay import readyz_until_200, scrape_until_all_up

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
CONTROL_HOST, EXPERT_HOST = "127.0.0.2", "127.0.0.3"
PROMPTS = ["Hello, world!", "Expert parallelism splits the experts over the ranks."]
NUM_NEW_TOKENS = 8
READY_TIMEOUT_S = 240


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def spawn(args: list[str], log_path: pathlib.Path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "moemesh.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_line(proc: subprocess.Popen, log_path: pathlib.Path, prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
        assert proc.poll() is None, f"{log_path.name} exited with {proc.returncode}:\n{launcher.tail(log_path)}"
        time.sleep(0.2)
    raise TimeoutError(f"no {prefix!r} in {log_path.name} after {timeout_s} s:\n{launcher.tail(log_path)}")


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory):
    """Three `moemesh etcd` members, one per host address; yields [(process, client endpoint)]."""
    root = tmp_path_factory.mktemp("etcd-cluster")
    ports = [(free_port(h), free_port(h)) for h in HOSTS]
    initial = ",".join(f"n{i}=http://{h}:{peer}" for i, (h, (_, peer)) in enumerate(zip(HOSTS, ports)))
    members = []
    try:
        for i, (host, (client, peer)) in enumerate(zip(HOSTS, ports)):
            proc = spawn(["etcd", "--name", f"n{i}", "--listen-host", host, "--client-port", str(client),
                          "--peer-port", str(peer), "--data-dir", str(root / f"n{i}"), "--initial-cluster", initial],
                         root / f"n{i}.out")
            members.append((proc, f"{host}:{client}", root / f"n{i}.out"))
        for proc, endpoint, log_path in members:
            wait_line(proc, log_path, "etcd member", READY_TIMEOUT_S)  # a loaded CI machine starts Python slowly
            deadline = time.monotonic() + 60
            while b'"health":"true"' not in _health(endpoint):
                assert time.monotonic() < deadline, f"etcd {endpoint} not healthy:\n{launcher.tail(log_path)}"
                time.sleep(0.2)
        yield members
    finally:
        for proc, _, _ in members:
            stop(proc)


def _health(endpoint: str) -> bytes:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as response:
            return response.read()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def hosts(etcd_cluster, tiny_model_dir, tmp_path_factory):
    """The two `moemesh up --roles` launches; yields (gateway address, etcd endpoints, the experts' output)."""
    root = tmp_path_factory.mktemp("hosts")
    endpoints = ",".join(endpoint for _, endpoint, _ in etcd_cluster)
    common = ["up", "--model", str(tiny_model_dir), "--ranks", "2", "--etcd", endpoints, "--data-plane-nice", "0"]
    control = spawn([*common, "--roles", "gateway,scheduler,router", "--bind-host", CONTROL_HOST, "--port", "0",
                     "--http-port", "-1", "--work-dir", str(root / "control")], root / "control.out")
    # As the one-pod-per-node Kubernetes variant runs it: with the metrics relay.
    experts = spawn([*common, "--roles", "expert", "--bind-host", EXPERT_HOST, "--work-dir", str(root / "experts"),
                     "--metrics-port", "0"], root / "experts.out")
    try:
        line = wait_line(control, root / "control.out", "moemesh is ready: gateway at ", READY_TIMEOUT_S)
        wait_line(experts, root / "experts.out", "moemesh is ready: ", READY_TIMEOUT_S)
        yield line.split("gateway at ")[1].split()[0], endpoints, root / "experts.out"
    finally:
        stop(experts)
        stop(control)


def generate_when_ready(address: str, prompt: str, timeout_s: float = READY_TIMEOUT_S) -> list[int]:
    """Greedy token ids of prompt, retrying while the group forms (UNAVAILABLE)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        while True:
            try:
                request = gateway_pb2.GenerateRequest(request_id=f"hosts-{time.monotonic()}", prompt=prompt,
                                                      sampling=greedy(NUM_NEW_TOKENS))
                return generate(stub, request)[0]
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def prompt_ids(address: str, prompt: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        return list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=prompt), timeout=10).token_ids)


def test_greedy_outputs_through_the_gateway_equal_transformers(hosts, hf_model):
    address, *_ = hosts
    assert address.startswith(f"{CONTROL_HOST}:")
    for prompt in PROMPTS:
        assert generate_when_ready(address, prompt) == hf_greedy(hf_model, prompt_ids(address, prompt), NUM_NEW_TOKENS)


def test_every_role_registered_its_own_hosts_address(hosts):
    import asyncio

    _, endpoints, _ = hosts

    async def snapshot():
        async with ClusterClient(endpoints) as client:
            return await client.snapshot()

    state = asyncio.run(snapshot())
    hosts_by_role = {}
    for member in state.members:
        hosts_by_role.setdefault(member.role, set()).add(member.host)
    assert hosts_by_role == {"scheduler": {CONTROL_HOST}, "router": {CONTROL_HOST}, "gateway": {CONTROL_HOST},
                             "expert": {EXPERT_HOST}}
    assert {m.member_id for m in state.members if m.role == "expert"} == {"expert-127-0-0-3-0", "expert-127-0-0-3-1"}
    [group] = state.groups
    assert group.rendezvous_address.startswith(f"{EXPERT_HOST}:") and group.world_size == 2
    assert json.dumps(sorted(r.address.split(":")[0] for r in group.ranks)) == json.dumps([EXPERT_HOST] * 2)


def test_the_expert_hosts_relay_serves_both_experts_metrics_and_their_readiness(hosts):
    """`moemesh up --roles expert --metrics-port`: one scrape target for the expert services of a host."""
    address, _, experts_out = hosts
    generate_when_ready(address, PROMPTS[0])  # the group has formed: both ranks are ready
    (line,) = [line for line in experts_out.read_text().splitlines() if line.startswith("metrics of the roles")]
    url = line.split(": ", 1)[1].split("/metrics")[0]
    assert url.startswith(f"http://{EXPERT_HOST}:")
    members = {"expert-127-0-0-3-0", "expert-127-0-0-3-1"}
    got = scrape_until_all_up(url, members)
    assert {dict(labels)["member"]: value for (name, labels), value in got.items()
            if name == "moemesh_relay_scrape_up"} == dict.fromkeys(members, 1.0)
    assert {dict(labels)["member"]: dict(labels)["member_id"] for name, labels in got
            if name == "moemesh_build_info"} == {member: member for member in members}
    status, body = readyz_until_200(url)
    assert status == 200 and json.loads(body)["members"] == 2, body


def test_the_mesh_serves_on_when_an_etcd_member_is_lost(hosts, etcd_cluster, hf_model):
    address, *_ = hosts
    first, _, _ = etcd_cluster[0]  # the endpoint every client picked first
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    time.sleep(3.0)  # past a lease TTL: sessions must have moved to the other members
    prompt = PROMPTS[0]
    assert generate_when_ready(address, prompt, timeout_s=60) == hf_greedy(hf_model, prompt_ids(address, prompt),
                                                                          NUM_NEW_TOKENS)


def test_a_role_with_an_unreachable_etcd_exits_naming_it():
    port = free_port("127.0.0.1")  # nothing listens there once the probe socket is closed
    proc = subprocess.run([sys.executable, "-m", "router_svc.main", "--member-id", "r0", "--etcd",
                           f"127.0.0.1:{port},127.0.0.2:{port}", "--etcd-connect-timeout-s", "1"],
                          capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    assert proc.returncode == 1
    assert f"router: etcd unreachable within 1 s (127.0.0.1:{port}: " in proc.stderr
    assert f"127.0.0.2:{port}: " in proc.stderr and "Traceback" not in proc.stderr
