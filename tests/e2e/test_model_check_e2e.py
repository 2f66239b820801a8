"""A gateway started with another model than its group's ranks refuses the group (gateway/model_check.py).

On the session's shared mesh (its etcd and schedulers, group size 1): one more
expert service on the tiny model, then a gateway whose model directory says
another model (the tiny one's config with one more layer; a gateway reads only
config.json and the tokenizer). The schedulers put the two in a group of their
own; the gateway must never serve it: its log names both models, its health
stays NOT_SERVING, a request gets UNAVAILABLE naming both, and the shared
mesh's own group keeps serving.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services import process
from tests.e2e.test_mesh_e2e import generate, greedy

TIMEOUT_S = 120


def other_model_dir(tiny_model_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The tiny model's config and tokenizer, the config with one more layer."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def mismatched(mesh, tiny_model_dir, tmp_path_factory):
    """(the extra expert's mesh, the gateway process, its address, its log) on the shared etcd."""
    root = tmp_path_factory.mktemp("model-check")
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=1, device="cpu", roles=("expert",),
                             etcd=mesh.etcd_endpoint, member_tag="mc", work_dir=str(root / "experts"))
    with launcher.Mesh(spec) as experts:
        port_file, log_path = root / "gateway.port", root / "gateway.log"
        with open(log_path, "wb") as out:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "gateway.main", "--member-id", "gateway-mc-0", "--etcd", mesh.etcd_endpoint,
                 "--model", str(other_model_dir(tiny_model_dir, root / "other-model")), "--port", "0",
                 "--port-file", str(port_file), "--http-port", "-1", "--metrics-port", "0"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while process.read_port_file(port_file) is None or "not serving group" not in log_path.read_text():
                assert gateway.poll() is None, launcher.tail(log_path)
                assert time.monotonic() < deadline, f"no refusal in the gateway's log:\n{launcher.tail(log_path)}"
                time.sleep(0.2)
            yield experts, gateway, f"127.0.0.1:{process.read_port_file(port_file)}", log_path
        finally:
            if gateway.poll() is None:
                os.killpg(gateway.pid, signal.SIGTERM)
                try:
                    gateway.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(gateway.pid, signal.SIGKILL)
                    gateway.wait()


def test_a_gateway_with_another_model_refuses_its_group_and_says_why(mesh, mismatched, tiny_model_dir):
    _, _, address, log_path = mismatched
    line = next(line for line in log_path.read_text().splitlines() if "not serving group" in line)
    ours = line.split("the gateway's model (", 1)[1].split(") differs from", 1)[0]
    theirs = line.split("rank 0 (expert-mc-0): ", 1)[1]
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert f"{layers + 1} layers" in ours and f"{layers} layers" in theirs
    assert ours.split(";")[0].replace(f"{layers + 1} layers", f"{layers} layers") == theirs.split(";")[0]
    request = gateway_pb2.GenerateRequest(request_id="mc", input_ids=gateway_pb2.TokenIds(ids=[9707, 11]),
                                          sampling=greedy(2))
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            generate(gateway_pb2_grpc.GenerationServiceStub(channel), request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "differs from the model of group" in refused.value.details() and "expert-mc-0" in refused.value.details()
    with grpc.insecure_channel(mesh.gateway_address) as channel:   # the shared mesh's own group still serves
        token_ids, _, _ = generate(gateway_pb2_grpc.GenerationServiceStub(channel), request)
    assert len(token_ids) == 2
