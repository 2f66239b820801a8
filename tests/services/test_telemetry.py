"""Observability without a mesh: tracing setup and propagation, the gRPC interceptors,
the HTTP probe server, readiness and the KV metrics, the roles' collectors,
JSON logs, and that the alert rules, dashboard and docs name only real metrics."""

import asyncio
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import time
import types

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY, CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from expert_svc import observability as expert_observability
from expert_svc.state import RankState
from gateway.auth import ApiKeyCollector
from gateway.kv_accounting import RankKV
from gateway.observability import GatewayReadiness, GatewayStateCollector, fragmentation_ratio, kv_utilization
from gateway.slow_readers import SlowReaderCollector
from moe.expert.v1 import expert_pb2
from moe.router.v1 import router_pb2, router_pb2_grpc
from moemesh import metrics_relay
from router_svc.load import ExpertLoad
from router_svc.observability import RouterStatsCollector, imbalance, rank_loads
from router_svc.servicer import RouterServicer
from router_svc.stats import ExpertStats
from scheduler_svc.observability import LeaderWatch
from services import grpc_util, http_probes, logging_json, metrics, process, settings, telemetry
from services.cluster import GroupAssignment, LeaderInfo, RankInfo

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- tracing setup and propagation ---

@pytest.mark.parametrize("env,endpoint", [
    ({}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "http://c:4317"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"},
     "http://t:4317"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, None),
])
def test_tracing_is_on_only_with_an_endpoint(env, endpoint):
    assert telemetry.otlp_endpoint(env) == endpoint


def test_tracing_off_installs_nothing():
    assert telemetry.configure_tracing("gateway", env={}) is False
    assert not telemetry.is_enabled()
    assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []
    with telemetry.tracer().start_as_current_span("x") as span:
        assert not span.is_recording()


def test_tracing_on_names_the_service_and_stops_in_bounded_time():
    # In a process of its own: the global tracer provider can be set only once.
    script = (
        "import time\n"
        "from opentelemetry import trace\n"
        "from services import telemetry\n"
        "assert telemetry.configure_tracing('router')\n"
        "print(trace.get_tracer_provider().resource.attributes['service.name'])\n"
        "print(len(telemetry.server_interceptors()), len(telemetry.client_interceptors()))\n"
        "with telemetry.tracer().start_as_current_span('x') as span:\n"
        "    assert span.is_recording()\n"
        "start = time.monotonic()\n"
        "telemetry.shutdown_tracing(1.0)\n"
        "print(round(time.monotonic() - start, 1))\n")
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    env.pop("OTEL_SERVICE_NAME", None)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    name, interceptors, shutdown_s = out.stdout.split("\n")[:3]
    assert (name, interceptors) == ("moemesh-router", "1 1")
    assert float(shutdown_s) <= 1.5 and time.monotonic() - start < 20


def test_traceparent_round_trip():
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    span = trace.NonRecordingSpan(trace.SpanContext(trace_id, span_id, is_remote=False,
                                                    trace_flags=trace.TraceFlags(1)))
    header = telemetry.traceparent_of(span)
    assert header == f"00-{trace_id:032x}-{span_id:016x}-01"
    context = telemetry.context_from_traceparent(header)
    assert trace.get_current_span(context).get_span_context().span_id == span_id
    assert telemetry.trace_id_from_traceparent(header) == f"{trace_id:032x}"
    assert telemetry.context_from_traceparent("") is None
    assert telemetry.context_from_traceparent("00-zz-yy-01") is None
    assert telemetry.traceparent_of(trace.INVALID_SPAN) == ""


@pytest.fixture
def tracing(monkeypatch):
    """Tracing on, in this process, into an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    monkeypatch.setattr(telemetry._state, "provider", provider)
    yield exporter
    provider.shutdown()


def spans_named(exporter, name):
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_interceptors_carry_the_context_and_spare_health(tracing):
    async def body():
        servicer = RouterServicer(ExpertLoad(ExpertStats()))
        server = await grpc_util.start_server(
            [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s)], [ROUTER_SERVICE])
        await server.set_serving(True)
        try:
            async with grpc_util.channel(f"127.0.0.1:{server.port}") as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                with telemetry.tracer().start_as_current_span("caller") as caller:
                    await stub.ReportExpertHits(router_pb2.ReportExpertHitsRequest(
                        group_id="g", layers=[router_pb2.LayerHits(layer=0, counts=[1, 2])]), timeout=5)
                    with pytest.raises(grpc.aio.AioRpcError):
                        await stub.ReportExpertHits(router_pb2.ReportExpertHitsRequest(group_id=""), timeout=5)
                health = health_pb2_grpc.HealthStub(channel)
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                    health_pb2.HealthCheckResponse.SERVING
                # Watch writes with context.write(): a wrapping interceptor would break it.
                watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
        finally:
            await server.stop(0)
        return caller

    caller = asyncio.run(body())
    method = f"{ROUTER_SERVICE}/ReportExpertHits"
    ok_client, bad_client = [s for s in tracing.get_finished_spans()
                             if s.name == method and s.kind == trace.SpanKind.CLIENT]
    servers = [s for s in tracing.get_finished_spans() if s.name == method and s.kind == trace.SpanKind.SERVER]
    assert len(servers) == 2
    for client, server in zip((ok_client, bad_client), servers):
        assert client.parent.span_id == caller.get_span_context().span_id
        assert server.parent.span_id == client.context.span_id
        assert server.context.trace_id == caller.get_span_context().trace_id
    assert servers[0].attributes["rpc.grpc.status_code"] == 0
    assert servers[1].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad_client.status.status_code == trace.StatusCode.ERROR
    assert not any("Health" in s.name for s in tracing.get_finished_spans())


def test_traced_decorator_records_a_span_only_while_on(tracing):
    @telemetry.traced("etcd.example", kind="unit")
    async def call(fail: bool):
        if fail:
            raise ValueError("boom")
        return 7

    assert asyncio.run(call(False)) == 7
    with pytest.raises(ValueError):
        asyncio.run(call(True))
    ok, failed = spans_named(tracing, "etcd.example")
    assert ok.attributes["kind"] == "unit" and failed.events[0].name == "exception"
    telemetry._state.provider = None
    assert asyncio.run(call(False)) == 7
    assert len(spans_named(tracing, "etcd.example")) == 2


def test_expert_records_one_span_per_traced_sequence(tracing):
    state = RankState(member_id="e0", model_name="m", group_id="g0", rank=1, world_size=2, placement_epoch=3)
    tracer = expert_observability.SequenceTracer.create(state)
    with telemetry.tracer().start_as_current_span("root") as root:
        header = telemetry.traceparent_of(root)

    def plan(step_id, new=(), scheduled=(), finished=()):
        return expert_pb2.StepPlan(step_id=step_id, new_sequences=list(new), scheduled=list(scheduled),
                                   finished_seq_ids=list(finished))

    tracer.on_plan(plan(1, new=[expert_pb2.NewSequence(seq_id=5, traceparent=header),
                                expert_pb2.NewSequence(seq_id=6)],
                        scheduled=[expert_pb2.ScheduledSequence(seq_id=5, token_ids=[1, 2, 3], is_sampled=True),
                                   expert_pb2.ScheduledSequence(seq_id=6, token_ids=[4], is_sampled=True)]))
    tracer.on_plan(plan(2, scheduled=[expert_pb2.ScheduledSequence(seq_id=5)]))
    tracer.on_plan(plan(3, finished=[5, 6]))
    [span] = spans_named(tracing, "expert.sequence")
    assert span.parent.span_id == root.get_span_context().span_id
    assert span.attributes["moemesh.num_prefill_tokens"] == 3
    assert span.attributes["moemesh.num_decode_steps"] == 1
    assert span.attributes["moemesh.rank"] == 1 and span.attributes["moemesh.end_reason"] == "finished"
    tracer.end_all()
    assert len(spans_named(tracing, "expert.sequence")) == 1


# --- the HTTP probe server ---

async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def test_probe_server_serves_metrics_health_and_readiness(tmp_path):
    registry = CollectorRegistry()
    Counter("moemesh_test_things", "Things.", registry=registry).inc(3)

    async def body():
        server = http_probes.ProbeServer(registry)
        port = await server.start("127.0.0.1", 0)
        try:
            status, text = await http_get(port, "/metrics")
            assert status == 200 and "moemesh_test_things_total 3.0" in text
            assert await http_get(port, "/healthz") == (200, "ok\n")
            status, text = await http_get(port, "/readyz")
            assert status == 503 and json.loads(text) == {"ready": False, "reason": "starting"}
            state = {"ready": False, "detail": 1}

            async def readiness():
                return state

            server.set_readiness(readiness)
            assert await http_get(port, "/readyz") == (503, '{"detail": 1, "ready": false}\n')
            state["ready"] = True
            assert (await http_get(port, "/readyz"))[0] == 200
            server.set_readiness(lambda: 1 / 0)
            status, text = await http_get(port, "/readyz")
            assert status == 503 and "ZeroDivisionError" in json.loads(text)["reason"]
            assert (await http_get(port, "/nowhere"))[0] == 404
            assert (await http_get(port, "/metrics", "POST"))[0] == 405
            assert await http_get(port, "/healthz", "HEAD") == (200, "")
        finally:
            await server.close()

    asyncio.run(body())


def test_start_probes_writes_the_metrics_port_file(tmp_path):
    config = settings.MemberConfig(member_id="m0", port_file=str(tmp_path / "m0.port"), metrics_port=0)

    async def body():
        server = await http_probes.start_probes("router", config)
        try:
            assert process.read_port_file(process.metrics_port_file(config.port_file)) == server.port
            status, text = await http_get(server.port, "/metrics")
            assert 'moemesh_build_info{member_id="m0",role="router"' in text
        finally:
            await server.close()

    asyncio.run(body())


def test_member_config_checks_the_new_fields():
    config = settings.parse_config(settings.MemberConfig, ["--member-id", "m", "--metrics-port", "0",
                                                          "--log-format", "json", "--metrics-host", "0.0.0.0"], env={})
    assert (config.metrics_port, config.log_format, config.metrics_host) == (0, "json", "0.0.0.0")
    assert settings.MemberConfig(member_id="m").metrics_port == 9090
    with pytest.raises(ValueError, match="log_format must be text or json, got 'xml'"):
        settings.MemberConfig(member_id="m", log_format="xml")
    with pytest.raises(ValueError, match="metrics_port must be in 0..65535, got 70000"):
        settings.MemberConfig(member_id="m", metrics_port=70000)


# --- the gateway: KV utilization, fragmentation, readiness ---

def occupy(kv: RankKV, seq_id: int, num_blocks: int) -> None:
    kv.open(seq_id, kv.match([0], []))
    kv.grow(seq_id, num_blocks * kv.block_size)


def waiting_head(num_tokens: int):
    return types.SimpleNamespace(token_ids=list(range(1, num_tokens + 1)), block_hashes=[])


def test_fragmentation_counts_free_blocks_on_ranks_too_full_for_the_next_request():
    full, roomy = RankKV(10, 4), RankKV(10, 4)
    occupy(full, 1, 8)
    assert kv_utilization(full) == pytest.approx(0.8) and kv_utilization(roomy) == 0.0
    assert fragmentation_ratio([full, roomy], None) == 0.0
    # 19 prompt tokens + 1 need 5 blocks: only the roomy rank has them.
    assert fragmentation_ratio([full, roomy], waiting_head(19)) == pytest.approx(2 / 12)
    assert fragmentation_ratio([full, roomy], waiting_head(7)) == 0.0
    occupy(roomy, 2, 10)
    assert fragmentation_ratio([full, roomy], waiting_head(19)) == 1.0


def test_fragmentation_credits_a_cached_prefix():
    kv = RankKV(6, 4)
    prompt = list(range(1, 17))
    hashes: list[int] = []
    occupy(kv, 1, 0)
    kv.grow(1, 16)
    kv.publish(1, prompt, hashes, 16)
    kv.release(1)  # 4 cached blocks, unreferenced; 2 free
    occupy(kv, 2, 2)  # takes the 2 free blocks; 4 available (evictable) remain
    head = types.SimpleNamespace(token_ids=prompt + [99], block_hashes=[])
    # 18 tokens need 5 blocks; 4 are cached, so 1 new block is needed, and the
    # free pool without the head's own cached blocks is empty.
    assert fragmentation_ratio([kv], head) == 1.0
    kv.release(2)
    assert fragmentation_ratio([kv], head) == 0.0


class FakeManager:
    def __init__(self):
        self.group = None
        self.engine = None
        self.model_mismatch = None


class FakeCluster:
    def __init__(self):
        self.ready: set[int] = set()

    async def ready_ranks(self, group_id, epoch):
        return set(self.ready)


def test_gateway_readiness_while_the_group_forms_and_as_kv_fills():
    manager, cluster = FakeManager(), FakeCluster()
    readiness = GatewayReadiness(manager, num_experts=8, cluster=cluster)
    check = lambda: asyncio.run(readiness())  # noqa: E731

    report = check()
    assert report["ready"] is False and report["group_formed"] is False and report["experts_ready"] == "0/8"
    manager.group = GroupAssignment("g0", 1, 7, 2, "h:1", [RankInfo(0, "e0", "a"), RankInfo(1, "e1", "b")], "gw")
    cluster.ready = {1}
    report = check()
    assert (report["ready"], report["group_formed"], report["experts_ready"], report["serving"]) == \
        (False, True, "4/8", False)
    cluster.ready = {0, 1}
    assert check()["experts_ready"] == "8/8" and check()["ready"] is False  # no engine yet
    ranks = [RankKV(100, 16), RankKV(100, 16)]
    manager.engine = types.SimpleNamespace(batcher=types.SimpleNamespace(ranks=ranks))
    report = check()
    assert report["ready"] is True and report["kv_utilization"] == 0.0
    occupy(ranks[1], 1, 85)
    report = check()
    assert report["ready"] is False and report["kv_utilization"] == 0.85
    ranks[1].release(1)
    occupy(ranks[1], 2, 84)
    assert check()["ready"] is True


# --- expert, router, scheduler ---

def test_metered_comm_counts_bytes_and_the_step_hook_observes_them():
    comm = expert_observability.MeteredExpertComm(None, is_timed=True)
    inp, out = torch.ones(6, 4), torch.empty(6, 4)
    comm.all_to_all(out, inp)
    comm.all_to_all(out[:2], inp[:2])
    assert torch.equal(out, inp)
    comm.all_gather(out[:1], inp[:1])  # triton_ep's collectives count too (one rank: copies)
    comm.reduce_scatter(out[:1], inp[:1])
    steps = []
    hook = expert_observability.step_hook(steps.append, comm)
    count_before = sample("moemesh_expert_all_to_all_bytes_count")
    sum_before = sample("moemesh_expert_all_to_all_bytes_sum")
    hook(11)
    assert steps == [11]
    assert sample("moemesh_expert_all_to_all_bytes_count") == count_before + 1
    assert sample("moemesh_expert_all_to_all_bytes_sum") == sum_before + 10 * 4 * 4
    assert comm.take_step_totals() == (0, 0.0)


def test_expert_readiness_and_hit_counts():
    state = RankState(member_id="e0", model_name="m")
    report = expert_observability.readiness(state)
    assert report() == {"ready": False, "group_id": None, "rank": None, "world_size": 0,
                        "experts_ready": "0/0", "step_failed": False, "fenced": False}
    state.group_id, state.world_size, state.expert_ids = "g0", 2, (4, 5, 6, 7)
    state.rank = 1
    assert report()["experts_ready"] == "0/4"
    state.executor = types.SimpleNamespace(failure=None, is_held=False, runner=types.SimpleNamespace(
        seq_ids=[1, 2], device=torch.device("cpu")))
    assert report()["ready"] and report()["experts_ready"] == "4/4"
    reporter = types.SimpleNamespace(moe_layers=[1, 3], counts_LE=torch.tensor([[5, 0], [1, 2]]))
    registry = CollectorRegistry()
    registry.register(expert_observability.ExpertStateCollector(state, lambda: reporter))
    assert registry.get_sample_value("moemesh_expert_routed_tokens_total", {"layer": "3", "expert": "1"}) == 2
    assert registry.get_sample_value("moemesh_expert_sequences") == 2
    state.executor.failure = "collective timed out"
    assert report()["ready"] is False and report()["step_failed"] is True
    assert registry.get_sample_value("moemesh_expert_ready") == 0


def test_a_cuda_rank_exports_its_allocator_counters(monkeypatch):
    """On CUDA the collector reads torch.cuda.memory_stats of the rank's own device; a CPU rank has none."""
    asked = []

    def memory_stats(device):
        asked.append(device)
        return {"num_alloc_retries": 3, "num_device_alloc": 41, "reserved_bytes.all.current": 2**30}

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    state = RankState(member_id="e0", model_name="m")
    runner = types.SimpleNamespace(seq_ids=[], device=torch.device("cpu"))
    state.executor = types.SimpleNamespace(failure=None, is_held=False, runner=runner)
    registry = CollectorRegistry()
    registry.register(expert_observability.ExpertStateCollector(state))
    assert registry.get_sample_value("moemesh_expert_cuda_mallocs_total") is None and asked == []
    runner.device = torch.device("cuda", 1)
    assert registry.get_sample_value("moemesh_expert_cuda_alloc_retries_total") == 3
    assert registry.get_sample_value("moemesh_expert_cuda_mallocs_total") == 41
    assert registry.get_sample_value("moemesh_expert_cuda_reserved_bytes") == 2**30
    assert set(asked) == {torch.device("cuda", 1)}


def test_router_rank_loads_and_collector():
    assert rank_loads([4, 2, 0, 2], 2) == [6, 2] and rank_loads([1, 2, 3], 2) is None
    assert imbalance([6, 2]) == 1.5 and imbalance([0, 0]) == 1.0
    stats = ExpertStats()
    collector = RouterStatsCollector(stats)
    registry = CollectorRegistry()
    registry.register(collector)
    stats.add_report("g0", [(0, [3, 1, 0, 0])])
    collector.on_report("g0", 0)
    stats.add_report("g0", [(0, [1, 1, 0, 2])])
    collector.on_report("g0", 1)
    get = registry.get_sample_value
    assert get("moemesh_router_expert_hits_total", {"group": "g0", "layer": "0", "expert": "0"}) == 4
    assert get("moemesh_router_expert_hit_ratio", {"group": "g0", "layer": "0", "expert": "3"}) == 0.25
    assert get("moemesh_router_rank_hits_total", {"group": "g0", "layer": "0", "rank": "0"}) == 6
    assert get("moemesh_router_rank_load_imbalance_ratio", {"group": "g0", "layer": "0"}) == 1.5
    assert get("moemesh_router_reports_total", {"group": "g0"}) == 2


def test_leader_watch_counts_changes_and_failover_time():
    now = [100.0]
    watch = LeaderWatch(client=None, member_id="s1", clock=lambda: now[0])
    changes = sample("moemesh_scheduler_leader_changes_total")
    watch.observe(None)  # at start: no leader yet, not a failover
    watch.observe(LeaderInfo("s0", "a", term=5, elected_at=0.0))
    assert sample("moemesh_scheduler_leader_changes_total") == changes
    assert sample("moemesh_scheduler_is_leader") == 0 and sample("moemesh_scheduler_leader_present") == 1
    now[0] = 110.0
    watch.observe(None)
    assert sample("moemesh_scheduler_leader_present") == 0
    now[0] = 110.25
    watch.observe(LeaderInfo("s1", "b", term=9, elected_at=0.0))
    assert sample("moemesh_scheduler_leader_changes_total") == changes + 1
    assert sample("moemesh_scheduler_last_failover_duration_seconds") == pytest.approx(0.25)
    assert sample("moemesh_scheduler_is_leader") == 1 and sample("moemesh_scheduler_leader_term") == 9
    watch.observe(LeaderInfo("s1", "b", term=9, elected_at=0.0))  # the same term again: no change
    watch.observe(LeaderInfo("s2", "c", term=12, elected_at=0.0))  # replaced without a gap
    assert sample("moemesh_scheduler_leader_changes_total") == changes + 2
    assert sample("moemesh_scheduler_last_failover_duration_seconds") == pytest.approx(0.25)


# --- logs ---

def log_line(log_format: str, request: logging_json.RequestLogContext | None) -> str:
    record = logging.LogRecord("gateway.servicer", logging.INFO, __file__, 1, "request %s done", ("r-1",), None)
    token = logging_json.REQUEST_CONTEXT.set(request)
    try:
        logging_json.RequestContextFilter().filter(record)
    finally:
        logging_json.REQUEST_CONTEXT.reset(token)
    formatter = logging_json.JsonFormatter if log_format == "json" else logging_json.TextFormatter
    return formatter("gateway", "gw0").format(record)


def test_log_lines_carry_the_request_and_trace_ids():
    line = json.loads(log_line("json", logging_json.RequestLogContext("r-1", "ab" * 16)))
    assert line == {**line, "level": "INFO", "role": "gateway", "member": "gw0", "logger": "gateway.servicer",
                    "msg": "request r-1 done", "request_id": "r-1", "trace_id": "ab" * 16}
    assert line["ts"].endswith("Z")
    assert "request_id" not in json.loads(log_line("json", None))
    text = log_line("text", logging_json.RequestLogContext("r-1", "ab" * 16))
    assert "gateway[gw0] gateway.servicer: request r-1 done [request=r-1 trace=" + "ab" * 16 + "]" in text
    assert "[request=" not in log_line("text", None)


# --- alert rules, dashboard and docs name real metrics ---

METRIC = re.compile(r"\bmoemesh_[a-z0-9_]+")
RECORDED = re.compile(r"\bmoemesh:[a-z0-9_:]+")


def all_metric_families() -> dict[str, str]:
    """Every moemesh metric family any role exports: name -> type, built in a private registry."""
    registry = CollectorRegistry()
    for cls in (metrics.CommonMetrics, metrics.GatewayMetrics, metrics.ExpertMetrics, metrics.SchedulerMetrics):
        cls(registry)
    for collector in (GatewayStateCollector(lambda: None, None), expert_observability.ExpertStateCollector(None),
                      RouterStatsCollector(None), ApiKeyCollector(None), SlowReaderCollector(None),
                      metrics_relay.ScrapeStatus()):
        registry.register(collector)
    return {family.name: family.type for family in registry.collect()}


def sample_names(families: dict[str, str]) -> set[str]:
    """The series names Prometheus stores for metric families (name -> type)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name + suffix for name, kind in families.items() for suffix in suffixes.get(kind, ("",))}


@pytest.fixture(scope="module")
def known_series():
    return sample_names(all_metric_families())


def client_metric_families() -> dict[str, str]:
    """The moemesh package's metrics: in the registry of the process that runs programs, not a role's."""
    from moemesh.program.run import NODE_SECONDS

    return {family.name: family.type for family in NODE_SECONDS.collect()}


def documented_families(text: str) -> set[str]:
    return set(re.findall(r"^\| `(moemesh_[a-z0-9_]+)`", text, re.M))


def test_docs_list_every_metric_family_and_nothing_else(known_series):
    families, client = all_metric_families(), client_metric_families()
    doc = (ROOT / "docs" / "metrics.md").read_text()
    # The client process's section, apart: its metrics are in no role's /metrics.
    before, heading, rest = doc.partition("\n## Client process")
    client_section, next_heading, after = rest.partition("\n## ")
    assert heading and next_heading
    exported = {name + ("_total" if kind == "counter" else "") for name, kind in families.items()}
    assert documented_families(before + after) == exported
    assert documented_families(client_section) == {
        name + ("_total" if kind == "counter" else "") for name, kind in client.items()}
    for name in set(METRIC.findall(doc)):
        assert name in known_series | set(families) | sample_names(client) | set(client), (
            f"docs/metrics.md mentions {name}, which neither a role nor the client exports")
    for guide in ("rbg_expert_hit_rate_total", "sglang_dag_execution_time_seconds", "rbg_kv_cache_fragmentation_ratio"):
        assert f"`{guide}`" in doc


def test_alert_rules_reference_existing_metrics_and_runbook_sections(known_series):
    rules = yaml.safe_load((ROOT / "deploy" / "observability" / "alerts.yaml").read_text())
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    sections = {re.sub(r"[^a-z0-9-]", "", h.lower().replace(" ", "-")) for h in re.findall(r"^## (.+)$", runbook, re.M)}
    recorded, alerts = set(), []
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}, rule
            assert ("alert" in rule) != ("record" in rule) and isinstance(rule["expr"], str)
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]
            for name in METRIC.findall(rule["expr"]):
                assert name in known_series, f"{rule.get('alert') or rule['record']}: unknown metric {name}"
            for name in RECORDED.findall(rule["expr"]):
                assert name in recorded, f"{name} is used before it is recorded"
            if "record" in rule:
                recorded.add(rule["record"])
                continue
            alerts.append(rule["alert"])
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            anchor = rule["annotations"]["runbook_url"].split("#")[1]
            assert anchor == rule["alert"].lower() and anchor in sections, rule["alert"]
    for needed in ("MoemeshNoSchedulerLeader", "MoemeshLeaderChurn", "MoemeshKVCacheFull", "MoemeshTTFTHigh",
                   "MoemeshRankFallingBehind", "MoemeshExpertImbalance"):
        assert needed in alerts


def test_dashboard_queries_only_existing_metrics(known_series):
    dashboard = json.loads((ROOT / "deploy" / "observability" / "grafana-dashboard.json").read_text())
    rules = yaml.safe_load((ROOT / "deploy" / "observability" / "alerts.yaml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 20
    used = set()
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        for name in METRIC.findall(expr):
            assert name in known_series, f"dashboard: unknown metric {name}"
            used.add(name)
        assert set(RECORDED.findall(expr)) <= recorded, expr
    # Every panel has a data source and a unique position.
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    positions = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels]
    assert len(set(positions)) == len(positions)
    for name in ("moemesh_time_to_first_token_seconds_bucket", "moemesh_kv_cache_utilization_ratio",
                 "moemesh_kv_cache_fragmentation_ratio", "moemesh_router_expert_hit_ratio",
                 "moemesh_scheduler_is_leader", "moemesh_expert_all_to_all_bytes_sum"):
        assert name in used


def test_metrics_parse_as_prometheus_text_without_created_series():
    metrics.gateway_metrics().requests.labels("stop", "OK").inc(0)
    text = generate_latest(REGISTRY).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "moemesh_requests_total" in names and "python_gc_objects_collected_total" in names
    assert not [name for name in names if name.endswith("_created")]
