"""Observability through a whole mesh (2 ranks, CPU): one trace per request from the
client's span through the gateway to the expert service, exported over OTLP to a
collector run by the test; the gateway's metrics after known traffic; /readyz
while the group forms and once it serves; JSON log lines carrying the ids; a
program's trace (client spans in memory) continued by the gateway's spans."""

import concurrent.futures
import json
import random
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

import moemesh
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.process import metrics_port_file, read_port_file

NUM_RANKS = 2
NUM_NEW_TOKENS = 6


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span: (service name, span)."""

    def __init__(self):
        self.spans = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                service = attributes.get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: bytes):
        with self._lock:
            return [(service, span) for service, span in self.spans if span.trace_id == trace_id]

    def names(self) -> set[str]:
        with self._lock:
            return {span.name for _, span in self.spans}


@pytest.fixture(scope="module")
def collector():
    servicer = Collector()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"http://127.0.0.1:{port}"
    yield servicer
    server.stop(0)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def traced_mesh(tiny_model_dir, collector, tmp_path_factory):
    """The mesh, started while a thread polls the gateway's /readyz: (mesh, readiness seen)."""
    work_dir = tmp_path_factory.mktemp("observed-mesh")
    spec = launcher.MeshSpec(
        model_dir=str(tiny_model_dir), num_ranks=NUM_RANKS, work_dir=str(work_dir),
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
             "OTEL_TRACES_SAMPLER": "parentbased_always_on", "MOEMESH_LOG_FORMAT": "json"},
        extra_args={"gateway": ["--log-level", "DEBUG"]})
    mesh = launcher.Mesh(spec)
    seen: list[tuple[int, dict]] = []
    started = threading.Event()

    def poll_readiness():
        metrics_file = metrics_port_file(work_dir / "gateway.port")
        while not started.is_set():
            port = read_port_file(metrics_file)
            if port is not None:
                try:
                    status, body = get(port, "/readyz")
                    seen.append((status, json.loads(body)))
                except (OSError, ValueError):
                    pass  # not listening yet, or going away
            time.sleep(0.02)

    poller = threading.Thread(target=poll_readiness, daemon=True)
    poller.start()
    try:
        mesh.start()
    finally:
        started.set()
        poller.join()
    try:
        yield mesh, seen
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def stub(traced_mesh):
    mesh, _ = traced_mesh
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def role(mesh, name: str) -> launcher.Role:
    return next(r for r in mesh.roles if r.name == name)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    status, text = get(port, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def request(request_id: str, prompt: str, n: int = NUM_NEW_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt, sampling=gateway_pb2.SamplingParams(
        max_new_tokens=n, temperature=0.0, ignore_eos=True))


def test_readiness_flips_while_the_group_forms(traced_mesh):
    mesh, seen = traced_mesh
    assert seen, "the gateway's /readyz was never reached while the mesh started"
    first_status, first = seen[0]
    assert first_status == 503 and not first["ready"], first
    forming = [report for _, report in seen if "group_formed" in report]
    assert forming and not forming[0]["serving"], seen[:3]
    assert not forming[0]["group_formed"] or forming[0]["experts_ready"] != "8/8", forming[0]
    status, body = get(role(mesh, "gateway").metrics_port, "/readyz")
    report = json.loads(body)
    assert status == 200, report
    assert report == {**report, "ready": True, "group_formed": True, "serving": True, "experts_ready": "8/8",
                      "kv_utilization": 0.0}
    for name in ("expert-0", "expert-1", "router", "scheduler-0"):
        port = role(mesh, name).metrics_port
        assert get(port, "/healthz") == (200, "ok\n")
        status, body = get(port, "/readyz")
        assert status == 200 and json.loads(body)["ready"], (name, body)
    assert json.loads(get(role(mesh, "expert-1").metrics_port, "/readyz")[1])["experts_ready"] == "4/4"


def test_one_trace_from_the_client_through_gateway_and_expert(traced_mesh, stub, collector):
    mesh, _ = traced_mesh
    trace_id, client_span_id = random.getrandbits(128), random.getrandbits(64)
    traceparent = f"00-{trace_id:032x}-{client_span_id:016x}-01"
    responses = list(stub.Generate(request("traced-1", "Trace me through the mesh, please."), timeout=60,
                                   metadata=[("traceparent", traceparent)]))
    assert responses[-1].usage.completion_tokens == NUM_NEW_TOKENS

    want = trace_id.to_bytes(16, "big")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spans = collector.of_trace(want)
        if {"expert.sequence", "decode"} <= {s.name for _, s in spans}:
            break
        time.sleep(0.1)
    by_name = {}
    for service, span in spans:
        by_name.setdefault(span.name, []).append((service, span))
    [(service, root)] = by_name["moe.gateway.v1.GenerationService/Generate"]
    assert service == "moemesh-gateway"
    assert root.parent_span_id == client_span_id.to_bytes(8, "big")
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["moemesh.request_id"].string_value == "traced-1"
    assert attributes["moemesh.finish_reason"].string_value == "length"
    assert attributes["gen_ai.usage.output_tokens"].int_value == NUM_NEW_TOKENS
    assert attributes["gen_ai.usage.input_tokens"].int_value == responses[-1].usage.prompt_tokens
    for name in ("queue_wait", "prefill_chunk", "decode"):
        assert by_name[name] and all(s.parent_span_id == root.span_id and svc == "moemesh-gateway"
                                     for svc, s in by_name[name]), name
    [(_, decode)] = by_name["decode"]
    assert decode.events and decode.events[0].name == "decode_step"
    [(service, sequence)] = by_name["expert.sequence"]
    assert service == "moemesh-expert" and sequence.parent_span_id == root.span_id
    counts = {a.key: a.value.int_value for a in sequence.attributes}
    assert counts["moemesh.num_prefill_tokens"] == responses[-1].usage.prompt_tokens
    # The first token comes with the prefill, the rank's decode steps sample the rest.
    assert counts["moemesh.num_decode_steps"] == NUM_NEW_TOKENS - 1
    # Control calls are traced too, each in its own trace.
    assert {"etcd.register", "etcd.campaign", "scheduler.reconcile", "etcd.write_groups", "expert.join",
            "etcd.mark_rank_ready", "gateway.connect_group"} <= collector.names()

    # The gateway's log line about the request carries both ids.
    lines = [json.loads(line) for line in role(mesh, "gateway").log_path.read_text().splitlines()
             if line.startswith("{")]
    about = [line for line in lines if line.get("request_id") == "traced-1"]
    assert about and all(line["trace_id"] == f"{trace_id:032x}" for line in about), about


def test_counters_and_histograms_count_known_traffic(traced_mesh, stub):
    mesh, _ = traced_mesh
    port = role(mesh, "gateway").metrics_port
    before = scrape(port)
    prompts = ["One", "Two words", "Three short words"]
    prompt_tokens = sum(len(stub.Tokenize(gateway_pb2.TokenizeRequest(text=p), timeout=10).token_ids) for p in prompts)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda i: list(stub.Generate(request(f"m-{i}", prompts[i]), timeout=60)),
                             range(len(prompts))))
    assert all(out[-1].usage.completion_tokens == NUM_NEW_TOKENS for out in outs)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request("bad", ""), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # context.abort sends the status before the handler's finally block counts
    # the request, so the client can see the error a moment before /metrics does.
    deadline = time.monotonic() + 5
    after = scrape(port)
    while delta("moemesh_requests_total", finish_reason="none", code="INVALID_ARGUMENT") < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.02)
        after = scrape(port)

    n = len(prompts)
    assert delta("moemesh_requests_total", finish_reason="length", code="OK") == n
    assert delta("moemesh_requests_total", finish_reason="none", code="INVALID_ARGUMENT") == 1
    assert delta("moemesh_prompt_tokens_total") == prompt_tokens
    assert delta("moemesh_generation_tokens_total") == n * NUM_NEW_TOKENS
    assert delta("moemesh_time_to_first_token_seconds_count") == n
    assert delta("moemesh_inter_token_latency_seconds_count") == n * (NUM_NEW_TOKENS - 1)
    assert delta("moemesh_e2e_request_latency_seconds_count") == n
    assert delta("moemesh_request_queue_time_seconds_count") == n
    assert delta("moemesh_time_to_first_token_seconds_bucket", le="+Inf") == n
    assert delta("moemesh_step_duration_seconds_count") >= NUM_NEW_TOKENS
    for rank in range(NUM_RANKS):
        assert delta("moemesh_rank_result_lag_seconds_count", rank=str(rank)) >= NUM_NEW_TOKENS
        assert after[("moemesh_kv_cache_utilization_ratio", (("rank", str(rank)),))] == 0.0
    assert after[("moemesh_num_requests_running", ())] == 0 and after[("moemesh_num_requests_waiting", ())] == 0
    assert after[("moemesh_group_serving", ())] == 1
    assert ("moemesh_prefix_cache_hit_ratio", ()) in after

    expert = scrape(role(mesh, "expert-0").metrics_port)
    assert expert[("moemesh_expert_step_duration_seconds_count", ())] >= NUM_NEW_TOKENS
    assert expert[("moemesh_expert_all_to_all_bytes_sum", ())] > 0
    assert expert[("moemesh_expert_ready", ())] == 1
    assert expert[("moemesh_expert_exchange", (("exchange", "collectives"),))] == 1  # gloo on the CPU
    assert expert[("moemesh_expert_exchange", (("exchange", "symmetric_memory"),))] == 0
    leaders = [scrape(role(mesh, f"scheduler-{i}").metrics_port)[("moemesh_scheduler_is_leader", ())]
               for i in range(launcher.NUM_SCHEDULERS)]
    assert sorted(leaders) == [0, 0, 1]


@moemesh.function
def traced_program(s):
    s += "Trace this program:"
    s += moemesh.gen("first", max_tokens=2, ignore_eos=True)
    s += moemesh.gen("second", max_tokens=2, ignore_eos=True)


# After the counting test: this program's requests would be counted there.
def test_a_programs_trace_continues_in_the_gateway(traced_mesh, collector, monkeypatch):
    """The client process's program span -> its gen node spans -> the gateway's Generate spans, through the
    traceparent the client sends: one trace across the processes."""
    mesh, _ = traced_mesh
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    state = traced_program.run(runtime=moemesh.Runtime(mesh.gateway_address, timeout=60))
    spans = {span.name: span for span in exporter.get_finished_spans()}
    program = spans["program traced_program"]
    nodes = [spans["gen first"], spans["gen second"]]
    assert all(node.parent.span_id == program.context.span_id for node in nodes)
    want = program.context.trace_id.to_bytes(16, "big")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        generates = [span for service, span in collector.of_trace(want)
                     if service == "moemesh-gateway" and span.name == "moe.gateway.v1.GenerationService/Generate"]
        if len(generates) == 2:
            break
        time.sleep(0.1)
    by_request = {next(a.value.string_value for a in span.attributes if a.key == "moemesh.request_id"): span
                  for span in generates}
    for name, node in zip(("first", "second"), nodes):
        [request_id] = state.node(name).request_ids
        assert by_request[request_id].parent_span_id == node.context.span_id.to_bytes(8, "big"), name
