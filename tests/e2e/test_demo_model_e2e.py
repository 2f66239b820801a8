"""The bundled demo model through the whole mesh: it writes English, stops at
its end-of-turn token, and the router's statistics show the expert hits
recorded when it was trained (tools/demo_model/expert_hits.json); the ticket
example (an LLM program) returns schema-valid fields on it."""

import importlib.util
import json
import pathlib
import time

import grpc
import pytest

import moemesh
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moe.router.v1 import router_pb2, router_pb2_grpc
from moemesh import launcher
from moemesh.cli import default_model_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
HITS = json.loads((ROOT / "tools" / "demo_model" / "expert_hits.json").read_text())


@pytest.fixture(scope="module")
def demo_mesh():
    model_dir = default_model_dir()
    assert pathlib.Path(model_dir) == ROOT / "services" / "model" / "demo", "the demo model is not the default"
    spec = launcher.MeshSpec(
        model_dir=model_dir, num_ranks=1,
        # Every prompt token counted exactly once: no prefix reuse, no overlapped
        # (speculative) step, and a hit-count report after every step.
        extra_args={"gateway": ["--no-enable-prefix-cache", "--no-overlap-steps"],
                    "expert_svc": ["--stats-every-steps", "1"]})
    with launcher.Mesh(spec) as mesh:
        yield mesh


def collect(stub, request):
    responses = list(stub.Generate(request, timeout=120))
    return "".join(r.text for r in responses), responses[-1]


# Runs first: the router must have counted nothing but the recorded prompt set.
def test_router_statistics_equal_the_recorded_expert_hits(demo_mesh):
    with grpc.insecure_channel(demo_mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        for i, prompt in enumerate(HITS["prompts"]):
            collect(stub, gateway_pb2.GenerateRequest(
                request_id=f"hits-{i}", input_ids=gateway_pb2.TokenIds(ids=prompt["token_ids"]),
                sampling=gateway_pb2.SamplingParams(max_new_tokens=1)))
    router = next(r for r in demo_mesh.roles if r.name == "router")
    expected = {layer["layer"]: layer["hits"] for layer in HITS["layers"]}
    with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        stats_stub = router_pb2_grpc.RouterServiceStub(channel)
        deadline = time.monotonic() + 30
        while True:
            stats = stats_stub.GetExpertStats(router_pb2.GetExpertStatsRequest(), timeout=5)
            counts = {layer.layer: list(layer.counts) for layer in stats.layers}
            if sum(map(sum, counts.values())) >= sum(map(sum, expected.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert counts.keys() == expected.keys()
    for layer, hits in expected.items():
        assert counts[layer] == hits, f"layer {layer}"


def test_plain_and_chat_prompts_give_english_and_stop_at_end_of_turn(demo_mesh):
    with grpc.insecure_channel(demo_mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        sampling = gateway_pb2.SamplingParams(max_new_tokens=120)
        chat = gateway_pb2.GenerateRequest(request_id="chat", sampling=sampling)
        chat.messages.messages.add(role="user", content='What does "river" mean?')
        text, last = collect(stub, chat)
        assert last.finish_reason == gateway_pb2.FINISH_REASON_STOP, text
        assert '"river" means' in text
        text, last = collect(stub, gateway_pb2.GenerateRequest(
            request_id="plain", prompt="An index makes queries faster because", sampling=sampling))
        words = text.split()
        assert len(words) >= 10 and sum(w.strip(".,;:").isalpha() for w in words) / len(words) > 0.8, text


def test_the_ticket_example_returns_schema_valid_fields_on_the_demo_model(demo_mesh):
    """examples/ticket_pipeline.py as `moemesh up` users run it, on the model it serves."""
    spec = importlib.util.spec_from_file_location("ticket_pipeline", ROOT / "examples" / "ticket_pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)
    runtime = moemesh.Runtime(demo_mesh.gateway_address, timeout=120)
    states = pipeline.ticket.run_batch([{"text": t, "api_delay": 0.01} for t in pipeline.TICKETS],
                                       runtime=runtime, max_concurrency=len(pipeline.TICKETS))
    schema = pipeline.FIELDS_SCHEMA
    for state in states:
        fields = state["summary"]
        # Exactly the schema's properties, each of its type and within its bounds, and a category of the choices.
        assert set(fields) == {"category", *schema["required"]}, fields
        assert fields["category"] in pipeline.CATEGORIES and isinstance(fields["urgent"], bool)
        order_id = schema["properties"]["order_id"]
        assert isinstance(fields["order_id"], int) and order_id["minimum"] <= fields["order_id"] <= order_id["maximum"]
        assert isinstance(fields["customer"], str)
        assert len(fields["customer"]) <= schema["properties"]["customer"]["maxLength"]
        assert state["payment_status"]["order_id"] == fields["order_id"]
        assert isinstance(state["answer"], str) and state["answer"].strip()
