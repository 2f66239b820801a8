"""The gateway's client authentication and slow-reader cut-off on a running mesh (one mesh, with a
key file, for every test here; docs/security.md).

API keys over gRPC and HTTP: missing, wrong, revoked (removed from the file while the mesh runs),
a class the key may not use, over its rate, over its streams: each gets its status, other keys'
traffic is unaffected, and no key ever appears in the gateway's log. A client that stops reading
its stream is cut off after --slow-reader-timeout-s and its KV blocks return to the pool, long
before its generation would have ended (checked through the gateway's /metrics).
"""

import concurrent.futures
import json
import os
import pathlib
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import hash_key, new_key
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from moemesh.client import Client
from moemesh.client_errors import MoemeshError

SLOW_READER_TIMEOUT_S = 2.0
NAMES = ("good", "other", "revoked", "rated", "one-stream", "batch-only", "slow-reader")


def key_entries(keys: dict[str, str], names) -> list[dict]:
    limits = {"rated": {"requests_per_s": 0.2, "burst": 2}, "one-stream": {"max_streams": 1},
              "batch-only": {"priorities": ["batch"]}}
    return [{"name": name, "sha256": hash_key(keys[name]), **limits.get(name, {})} for name in names]


def write_key_file(path: pathlib.Path, entries: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": entries}))
    os.replace(tmp, path)  # as a Secret's update: the new file appears at once


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    return {name: new_key() for name in NAMES}


@pytest.fixture(scope="module")
def secure_mesh(tiny_model_dir, keys, tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("secure-mesh")
    key_file = work_dir / "api-keys.json"
    write_key_file(key_file, key_entries(keys, NAMES))
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=1, device="cpu", work_dir=str(work_dir),
                             api_keys=str(key_file),
                             extra_args={"gateway": ["--slow-reader-timeout-s", str(SLOW_READER_TIMEOUT_S),
                                                     "--log-level", "DEBUG"]})
    with launcher.Mesh(spec) as running:
        yield running, key_file


@pytest.fixture(scope="module")
def stub(secure_mesh):
    mesh, _ = secure_mesh
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def request(request_id: str = "sec", n: int = 4, **fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id, prompt="Security check",
                                       sampling=gateway_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True),
                                       **fields)


def generate(stub, metadata, **fields):
    """(status code or None, details, trailing metadata dict, responses)."""
    call = stub.Generate(request(**fields), metadata=metadata, timeout=60)
    try:
        responses = list(call)
    except grpc.RpcError as error:
        return error.code(), error.details(), dict(error.trailing_metadata() or ()), []
    return None, "", {}, responses


def assert_serves(stub, key: str) -> None:
    code, details, _, responses = generate(stub, auth(key))
    assert code is None, (code, details)
    assert responses[-1].usage.completion_tokens == 4


def http(mesh, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(mesh.http_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_no_key_or_a_wrong_key_is_unauthenticated_on_every_rpc_and_over_http(secure_mesh, stub, keys):
    mesh, _ = secure_mesh
    for metadata in ((), auth(keys["good"] + "x"), (("authorization", keys["good"]),)):
        assert generate(stub, metadata)[0] == grpc.StatusCode.UNAUTHENTICATED
        for call, message in ((stub.Tokenize, gateway_pb2.TokenizeRequest(text="a")),
                              (stub.GetModelInfo, gateway_pb2.GetModelInfoRequest()),
                              (stub.Abort, gateway_pb2.AbortRequest(request_id="x"))):
            with pytest.raises(grpc.RpcError) as caught:
                call(message, metadata=metadata, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    body = {"prompt": "hi", "max_tokens": 2}
    for key in (None, keys["good"] + "x"):
        status, headers, error = http(mesh, "/completions", key, body)
        assert status == 401 and error["error"]["type"] == "authentication_error"
        assert headers.get("www-authenticate", headers.get("WWW-Authenticate")) == "Bearer"
        assert http(mesh, "/models", key)[0] == 401
    status, _, completion = http(mesh, "/completions", keys["good"], body)
    assert status == 200 and completion["usage"]["completion_tokens"] == 2
    assert_serves(stub, keys["good"])


def test_the_client_and_the_cli_environment_carry_the_key(secure_mesh, keys, monkeypatch):
    mesh, _ = secure_mesh
    with Client(mesh.gateway_address, api_key=keys["good"]) as client:
        assert client.model_info().num_ranks == 1
    monkeypatch.setenv("MOEMESH_API_KEY", keys["other"])
    with Client(mesh.gateway_address) as client:
        assert client.generate("hi", max_new_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    monkeypatch.delenv("MOEMESH_API_KEY")
    with Client(mesh.gateway_address) as client, pytest.raises(MoemeshError) as caught:
        client.model_info()
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_key_limited_to_batch_is_permission_denied_for_interactive(secure_mesh, stub, keys):
    mesh, _ = secure_mesh
    code, details, _, _ = generate(stub, auth(keys["batch-only"]))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "batch-only" in details
    assert generate(stub, auth(keys["batch-only"]), priority=gateway_pb2.PRIORITY_BATCH)[0] is None
    body = {"prompt": "hi", "max_tokens": 2, "priority": "interactive"}
    assert http(mesh, "/completions", keys["batch-only"], body)[0] == 403
    assert http(mesh, "/completions", keys["batch-only"], {**body, "priority": "batch"})[0] == 200


def test_over_the_rate_is_resource_exhausted_with_a_retry_hint_and_others_are_unaffected(secure_mesh, stub, keys):
    mesh, _ = secure_mesh
    codes = [generate(stub, auth(keys["rated"])) for _ in range(3)]
    assert [c[0] for c in codes[:2]] == [None, None]
    code, details, trailing, _ = codes[2]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rated" in details
    assert 1000 <= int(trailing["retry-after-ms"]) <= 5000
    status, headers, error = http(mesh, "/completions", keys["rated"], {"prompt": "hi", "max_tokens": 2})
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers.get("retry-after", headers.get("Retry-After"))) <= 5
    assert_serves(stub, keys["good"])


def test_over_the_stream_limit_is_resource_exhausted_while_the_first_stream_runs(secure_mesh, stub, keys):
    long = stub.Generate(request("long", n=2000), metadata=auth(keys["one-stream"]), timeout=120)
    try:
        next(long)  # the stream is open and counted
        code, details, trailing, _ = generate(stub, auth(keys["one-stream"]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams" in details
        assert "retry-after-ms" in trailing
        assert_serves(stub, keys["other"])  # another key's traffic goes on meanwhile
    finally:
        long.cancel()
    deadline = time.monotonic() + 10
    while generate(stub, auth(keys["one-stream"]))[0] is not None:  # the stream is returned when it ends
        assert time.monotonic() < deadline, "the cancelled stream was never returned to its key"
        time.sleep(0.2)


def test_abort_ends_only_the_callers_own_requests(secure_mesh, stub, keys):
    """Another key's Abort of a live request id is NOT_FOUND and the stream runs on; the owner's ends it."""
    long = stub.Generate(request("owned", n=2000), metadata=auth(keys["good"]), timeout=120)
    try:
        next(long)  # live
        with pytest.raises(grpc.RpcError) as foreign:
            stub.Abort(gateway_pb2.AbortRequest(request_id="owned"), metadata=auth(keys["other"]), timeout=30)
        assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
        next(long)  # still streaming
        answer = stub.Abort(gateway_pb2.AbortRequest(request_id="owned"), metadata=auth(keys["good"]), timeout=30)
        assert answer.num_aborted == 1
        last = list(long)[-1]
        assert last.finish_reason == gateway_pb2.FINISH_REASON_ABORT
    finally:
        long.cancel()


def test_a_key_removed_from_the_file_is_refused_while_other_keys_keep_working(secure_mesh, stub, keys):
    mesh, key_file = secure_mesh
    assert_serves(stub, keys["revoked"])
    write_key_file(key_file, key_entries(keys, [n for n in NAMES if n != "revoked"]))
    deadline = time.monotonic() + 10
    while generate(stub, auth(keys["revoked"]))[0] is None:
        assert time.monotonic() < deadline, "the revoked key was still accepted"
        time.sleep(0.2)
    assert generate(stub, auth(keys["revoked"]))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert http(mesh, "/completions", keys["revoked"], {"prompt": "hi", "max_tokens": 2})[0] == 401
    assert_serves(stub, keys["good"])


def metrics_text(mesh) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.gateway.metrics_port}/metrics", timeout=5) as response:
        return response.read().decode()


def samples(mesh, name: str) -> dict[tuple, float]:
    """The gateway's samples of one series: {sorted labels: value}."""
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(metrics_text(mesh))
            for s in family.samples if s.name == name}


def kv_utilization(mesh) -> float:
    return max(samples(mesh, "moemesh_kv_cache_utilization_ratio").values())


def test_a_client_that_stops_reading_is_cut_off_and_its_kv_blocks_are_freed(secure_mesh, stub, keys):
    mesh, _ = secure_mesh
    # Large messages (20 alternatives per token, and per prompt token on the first message) fill
    # the HTTP/2 windows soon: the client's stay at their initial 64 KiB (no BDP probing, which
    # would grow them to megabytes before the tiny model's generation ends). The generation
    # would run for far longer than the timeout.
    slow = gateway_pb2.GenerateRequest(
        request_id="slow-reader", prompt="word " * 1500, sampling=gateway_pb2.SamplingParams(
            max_new_tokens=2500, ignore_eos=True, top_logprobs=20, prompt_logprobs=True))
    channel = grpc.insecure_channel(mesh.gateway_address, options=[("grpc.http2.bdp_probe", 0)])
    call = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(
        slow, metadata=auth(keys["slow-reader"]), timeout=300)  # never read
    try:
        deadline = time.monotonic() + 60
        while kv_utilization(mesh) == 0:
            assert time.monotonic() < deadline, "the slow reader's request never started"
            time.sleep(0.1)
        started = time.monotonic()
        while kv_utilization(mesh) > 0:
            assert time.monotonic() - started < 60, "the slow reader kept its KV blocks"
            time.sleep(0.2)
        assert_serves(stub, keys["good"])
        # What the client finds once it reads again: part of its tokens, then the end of a call
        # the gateway cut off (its generation had not finished).
        num_received, code = 0, None
        try:
            for response in call:
                num_received += len(response.token_ids)
        except grpc.RpcError as error:
            code = error.code()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and num_received < 2500, (code, num_received)
    finally:
        call.cancel()
        channel.close()
    log = pathlib.Path(mesh.gateway.log_path).read_text()
    assert "request slow-reader: the client has not read its stream" in log
    assert samples(mesh, "moemesh_slow_reader_cutoffs_total")[()] >= 1


def test_no_key_ever_appears_in_the_gateways_log(secure_mesh, stub, keys):
    mesh, _ = secure_mesh
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # some more traffic of every kind first
        list(pool.map(lambda name: generate(stub, auth(keys[name])), NAMES))
    log = pathlib.Path(mesh.gateway.log_path).read_text()
    assert "api key file" in log  # the file's reloads are logged, by key name
    refusals = samples(mesh, "moemesh_api_key_refusals_total")  # labelled by key name, never the key
    assert refusals[(("key", "rated"), ("reason", "resource_exhausted"))] >= 1
    assert refusals[(("key", "-"), ("reason", "unauthenticated"))] >= 1
    assert refusals[(("key", "batch-only"), ("reason", "permission_denied"))] >= 1
    text = metrics_text(mesh)
    for key in keys.values():
        assert key not in log and hash_key(key) not in log and key not in text
