"""The whole mesh over gRPC against transformers' reference: concurrency,
sampling, stopping, bad input, health and reflection."""

import concurrent.futures
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import hf_greedy

GREEDY_TOKENS = 32
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "In 1905, Albert Einstein published four papers that changed physics: " * 3,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Mixture-of-experts models route each token to a few experts. " * 8,
]
CHATS = [
    [("user", "Write a haiku about the sea.")],
    [("system", "You are terse."), ("user", "Name three prime numbers."), ("assistant", "2, 3, 5."),
     ("user", "Three more?")],
]


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def generate(stub, request, timeout=120):
    """Collects a whole stream: (token_ids, text, last message)."""
    token_ids, text, last = [], "", None
    for response in stub.Generate(request, timeout=timeout):
        assert response.request_id == request.request_id
        token_ids += response.token_ids
        text += response.text
        last = response
    return token_ids, text, last


def chat_request(messages, **kwargs):
    req = gateway_pb2.GenerateRequest(**kwargs)
    for role, content in messages:
        req.messages.messages.add(role=role, content=content)
    return req


def greedy(n=GREEDY_TOKENS, **kw):
    return gateway_pb2.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_concurrent_greedy_requests_match_transformers(stub, hf_model):
    requests = [gateway_pb2.GenerateRequest(request_id=f"text-{i}", prompt=p, sampling=greedy())
                for i, p in enumerate(PROMPTS)]
    requests.append(gateway_pb2.GenerateRequest(
        request_id="ids", input_ids=gateway_pb2.TokenIds(ids=[9707, 11, 1879, 0, 220, 1234, 5678]),
        sampling=greedy()))
    requests += [chat_request(c, request_id=f"chat-{i}", sampling=greedy()) for i, c in enumerate(CHATS)]
    assert len(requests) >= 8

    prompt_ids = {}
    for req in requests:
        which = req.WhichOneof("input")
        if which == "input_ids":
            prompt_ids[req.request_id] = list(req.input_ids.ids)
        else:
            tok = gateway_pb2.TokenizeRequest(**({"text": req.prompt} if which == "prompt" else {"messages": req.messages}))
            prompt_ids[req.request_id] = list(stub.Tokenize(tok, timeout=10).token_ids)
    assert len({len(ids) for ids in prompt_ids.values()}) >= 6, "prompts should have different lengths"

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = dict(zip([r.request_id for r in requests], pool.map(lambda r: generate(stub, r), requests)))

    for req in requests:
        token_ids, _, last = results[req.request_id]
        expected = hf_greedy(hf_model, prompt_ids[req.request_id], GREEDY_TOKENS)
        assert token_ids == expected, req.request_id
        assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(prompt_ids[req.request_id])
        assert last.usage.completion_tokens == GREEDY_TOKENS


def test_chat_prompt_uses_chatml(stub):
    req = gateway_pb2.TokenizeRequest()
    req.messages.messages.add(role="user", content="Hi")
    ids = list(stub.Tokenize(req, timeout=10).token_ids)
    # <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    assert ids[0] == 151644 and 151645 in ids and ids[-3] == 151644
    assert stub.Tokenize(gateway_pb2.TokenizeRequest(text="Hello, world!"), timeout=10).token_ids == [9707, 11, 1879, 0]


def test_seeded_sampling_is_reproducible(stub):
    def sample(seed):
        params = gateway_pb2.SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=100,
                                            seed=seed, ignore_eos=True)
        return generate(stub, gateway_pb2.GenerateRequest(request_id=f"s{seed}", prompt="Once upon a time",
                                                          sampling=params))[0]

    first = sample(7)
    assert len(first) == 24
    assert sample(7) == first
    assert sample(8) != first


def test_max_new_tokens_ends_generation(stub):
    token_ids, _, last = generate(stub, gateway_pb2.GenerateRequest(request_id="len", prompt="Count:",
                                                                    sampling=greedy(n=5)))
    assert len(token_ids) == 5
    assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 5


def test_stop_string_ends_generation_and_is_cut(stub):
    _, full_text, _ = generate(stub, gateway_pb2.GenerateRequest(request_id="full", prompt="Stop here",
                                                                  sampling=greedy(n=24)))
    visible = full_text.strip()
    assert len(visible) >= 6, f"generated text too short to pick a stop string: {full_text!r}"
    start = full_text.index(visible[len(visible) // 2:len(visible) // 2 + 2])
    stop = full_text[start:start + 2]
    expected_text = full_text[:full_text.index(stop)]
    token_ids, text, last = generate(stub, gateway_pb2.GenerateRequest(
        request_id="stop", prompt="Stop here", sampling=greedy(n=24, stop=[stop])))
    assert last.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert last.matched_stop == stop
    assert text == expected_text
    assert len(token_ids) < 24


LONG = "word " * 5000
BAD_REQUESTS = [
    ("empty input", gateway_pb2.GenerateRequest(request_id="b1"), ["input"]),
    ("empty prompt", gateway_pb2.GenerateRequest(request_id="b2", prompt=""), ["prompt"]),
    ("id out of vocab", gateway_pb2.GenerateRequest(request_id="b3", input_ids=gateway_pb2.TokenIds(ids=[1, 10**7])),
     ["input_ids", "151936"]),
    ("negative id", gateway_pb2.GenerateRequest(request_id="b4", input_ids=gateway_pb2.TokenIds(ids=[-1])),
     ["input_ids"]),
    ("too long for context", gateway_pb2.GenerateRequest(request_id="b5", prompt=LONG,
                                                         sampling=gateway_pb2.SamplingParams(max_new_tokens=100)),
     ["4096"]),
    ("temperature", gateway_pb2.GenerateRequest(request_id="b6", prompt="x",
                                                sampling=gateway_pb2.SamplingParams(temperature=7.5)),
     ["temperature", "7.5"]),
    ("top_p", gateway_pb2.GenerateRequest(request_id="b7", prompt="x", sampling=gateway_pb2.SamplingParams(top_p=1.5)),
     ["top_p"]),
    ("top_k", gateway_pb2.GenerateRequest(request_id="b8", prompt="x", sampling=gateway_pb2.SamplingParams(top_k=-3)),
     ["top_k"]),
    ("max_new_tokens", gateway_pb2.GenerateRequest(request_id="b9", prompt="x",
                                                   sampling=gateway_pb2.SamplingParams(max_new_tokens=10**6)),
     ["max_new_tokens"]),
    ("chat role", chat_request([("wizard", "hi")], request_id="b10"), ["role", "wizard"]),
    ("empty chat", gateway_pb2.GenerateRequest(request_id="b11", messages=gateway_pb2.ChatMessages()), ["messages"]),
    ("too many stops", gateway_pb2.GenerateRequest(request_id="b12", prompt="x",
                                                   sampling=gateway_pb2.SamplingParams(stop=["a"] * 100)),
     ["stop"]),
    ("oversized prompt", gateway_pb2.GenerateRequest(request_id="b13", prompt="x" * 2_000_000), ["prompt"]),
    ("request id", gateway_pb2.GenerateRequest(request_id="r" * 1000, prompt="x"), ["request_id"]),
]


@pytest.mark.parametrize("name,request_,needles", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_refused_and_mesh_keeps_serving(stub, name, request_, needles):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for needle in needles:
        assert needle in err.value.details(), (name, err.value.details())
    token_ids, _, last = generate(stub, gateway_pb2.GenerateRequest(request_id="good", prompt="ok",
                                                                    sampling=greedy(n=3)))
    assert len(token_ids) == 3 and last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH


def test_gateway_health_and_reflection(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "moe.gateway.v1.GenerationService" in services
    assert "grpc.health.v1.Health" in services


def test_gateway_without_group_is_unavailable(mesh, tiny_model_dir, tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.main", "--member-id", "gateway-spare", "--model", str(tiny_model_dir),
         "--etcd", mesh.etcd_endpoint, "--port", "0", "--port-file", str(port_file)],
        stdout=open(tmp_path / "log", "wb"), stderr=subprocess.STDOUT)
    try:
        import time
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with grpc.insecure_channel(f"127.0.0.1:{int(port_file.read_text())}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                generate(gateway_pb2_grpc.GenerationServiceStub(channel),
                         gateway_pb2.GenerateRequest(request_id="u", prompt="hi"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_status_shows_leader_group_and_ready_rank(mesh):
    out = subprocess.run([sys.executable, "-m", "moemesh.cli", "status", "--target", mesh.scheduler_addresses[0]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "leader: scheduler-" in out.stdout and "term" in out.stdout
    assert "rank 0: expert-0" in out.stdout and "ready" in out.stdout
    assert "gateway gateway-0" in out.stdout
