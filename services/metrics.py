"""Prometheus metrics (prometheus-client) of every role; docs/metrics.md lists them.

Names follow Prometheus conventions under `moemesh_`: base units (seconds,
bytes), `_total` on counters (added by the client), `_ratio` for 0..1 values.
Every process serves them on its HTTP server (services/http_probes.py) from
the process-wide default registry, together with the client's process_* and
python_* metrics.

Each role's metrics are a class built on first use (`gateway_metrics()`,
...), so a process shows only its own role's metrics. Values that already
live in the role's state (queue length, KV utilization, prefix-cache
counters, expert hit counts) are not updated on the step path: a collector
reads them when Prometheus scrapes (see the roles' observability modules).
The library never imports a role: the test that checks the documentation
and the rule files against every role's metrics builds them itself
(tests/services/test_telemetry.py).
"""

import functools
import importlib.metadata

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "moemesh_"
# No *_created series: a third of the samples, and nothing here reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                          0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0)
_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_BYTES_BUCKETS = tuple(float(4 ** i) * 1024 for i in range(11))  # 1 KiB .. 1 GiB


def _version() -> str:
    try:
        return importlib.metadata.version("moemesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class CommonMetrics:
    """What every process exports."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.build_info = Gauge(
            PREFIX + "build_info", "Always 1; the labels say which moemesh version and role run.",
            ["version", "role", "member_id"], registry=registry)
        self.etcd_errors = Counter(
            PREFIX + "etcd_errors", "etcd calls, watches and keepalives that failed (then retried).",
            ["operation"], registry=registry)
        self.gc_pause = Histogram(
            PREFIX + "gc_pause_seconds", "Pauses of Python's cyclic garbage collector, by the generation "
            "collected (services/gc_pauses.py).", ["generation"], buckets=_GC_BUCKETS, registry=registry)

    def set_info(self, role: str, member_id: str) -> None:
        self.build_info.labels(_version(), role, member_id).set(1)


class GatewayMetrics:
    """Requests, tokens, latencies and steps of a gateway; its state (queue, KV,
    prefix cache) comes from gateway/observability.GatewayStateCollector."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.requests = Counter(
            PREFIX + "requests", "Generate calls ended, by finish reason (stop, length, abort, none) "
            "and gRPC status code.", ["finish_reason", "code"], registry=registry)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests queued.", registry=registry)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated and streamed to clients.", registry=registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "From the Generate call to its first token.",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Between consecutive tokens of one request.",
            buckets=_TOKEN_LATENCY_BUCKETS, registry=registry)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "From the Generate call to its last message "
            "(requests that finished with a finish reason).", buckets=_E2E_BUCKETS, registry=registry)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "From queued to first scheduled on a rank.",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.step_duration = Histogram(
            PREFIX + "step_duration_seconds", "Execution time of one step of the worker group: the "
            "longest the ranks report (StepResult.execute_seconds).", buckets=_STEP_BUCKETS, registry=registry)
        self.rank_result_lag = Histogram(
            PREFIX + "rank_result_lag_seconds", "Per step and rank: how long after the group's first "
            "result of the step this rank's result arrived at the gateway.", ["rank"],
            buckets=_LAG_BUCKETS, registry=registry)


class ExpertMetrics:
    """Steps and all-to-all traffic of one rank; its hit counts and state come
    from expert_svc/observability.ExpertStateCollector."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.step_duration = Histogram(
            PREFIX + "expert_step_duration_seconds", "Time this rank took to execute one step "
            "(plan to sampled tokens), idle steps included.", buckets=_STEP_BUCKETS, registry=registry)
        self.step_device = Histogram(
            PREFIX + "expert_step_device_seconds", "Device time of one step on CUDA, from the start of its "
            "first kernel to its tokens' copy to the host (CUDA events); kind prefill: some sequence "
            "brought more than one new token. Against expert_step_duration_seconds: the host's share.", ["kind"],
            buckets=_STEP_BUCKETS, registry=registry)
        self.step_launch = Histogram(
            PREFIX + "expert_step_launch_seconds", "Host time of one step's launch: the plan applied, its "
            "inputs built, its forward and sampling queued (on the CPU the forward itself runs in it); "
            "kind as for expert_step_device_seconds. On CUDA, a launch as long as the step's device "
            "time means the kernels waited for the host.", ["kind"], buckets=_STEP_BUCKETS, registry=registry)
        self.step_launch_cpu = Histogram(
            PREFIX + "expert_step_launch_cpu_seconds", "CPU time the launching thread itself spent in one "
            "step's launch (time.thread_time); kind as for expert_step_device_seconds. Well below "
            "expert_step_launch_seconds: the thread waited during the launch (for the GIL, which the "
            "process's other threads hold, or for a core), rather than working.", ["kind"],
            buckets=_STEP_BUCKETS, registry=registry)
        self.step_device_gap = Histogram(
            PREFIX + "expert_step_device_gap_seconds", "On CUDA, the device time between the end of the "
            "step before (its tokens' copy to the host) and the start of this one: the device waiting for "
            "the next plan or for the host to queue it. Gaps of a second or more (an idle rank) are not "
            "counted. Kind: this step's.", ["kind"], buckets=_LAG_BUCKETS, registry=registry)
        self.all_to_all_bytes = Histogram(
            PREFIX + "expert_all_to_all_bytes", "Bytes this rank sent through the MoE all-to-alls "
            "(dispatch and combine, every layer) in one step, its own share included.",
            buckets=_BYTES_BUCKETS, registry=registry)
        self.all_to_all_duration = Histogram(
            PREFIX + "expert_all_to_all_duration_seconds", "Host time in the MoE all-to-alls of one "
            "step (always on the CPU; on CUDA only with --debug-collective-timing).",
            buckets=_STEP_BUCKETS, registry=registry)
        self.exchange = Gauge(
            PREFIX + "expert_exchange", "1 for how this rank's group exchanges the MoE rows of its "
            "decode steps (collectives: NCCL or gloo; symmetric_memory), 0 for the other; none "
            "for a group of one rank.", ["exchange"], registry=registry)


class SchedulerMetrics:
    """Leadership as one scheduler replica sees it."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.is_leader = Gauge(PREFIX + "scheduler_is_leader", "1 while this replica is the leader.",
                               registry=registry)
        self.leader_present = Gauge(PREFIX + "scheduler_leader_present",
                                    "1 while this replica sees a leader in etcd.", registry=registry)
        self.leader_term = Gauge(PREFIX + "scheduler_leader_term",
                                 "The term (etcd mod revision of /leader) of the current leader.",
                                 registry=registry)
        self.leader_changes = Counter(PREFIX + "scheduler_leader_changes",
                                      "New leader terms this replica has seen since it started.",
                                      registry=registry)
        self.last_failover_duration = Gauge(
            PREFIX + "scheduler_last_failover_duration_seconds",
            "How long the mesh was without a leader the last time one left, as this replica saw it.",
            registry=registry)


@functools.cache
def _in_default_registry(cls):
    """The one instance of a role's metrics class, registered in the default registry."""
    return cls()


def common_metrics() -> CommonMetrics:
    return _in_default_registry(CommonMetrics)


def gateway_metrics() -> GatewayMetrics:
    return _in_default_registry(GatewayMetrics)


def expert_metrics() -> ExpertMetrics:
    return _in_default_registry(ExpertMetrics)


def scheduler_metrics() -> SchedulerMetrics:
    return _in_default_registry(SchedulerMetrics)


def count_etcd_error(operation: str) -> None:
    """Counts one failed etcd operation (services/cluster/ calls this)."""
    common_metrics().etcd_errors.labels(operation).inc()


def counter_family(name: str, documentation: str, labels=()) -> CounterMetricFamily:
    """A counter family for a scrape-time collector (name without _total)."""
    return CounterMetricFamily(PREFIX + name, documentation, labels=list(labels))


def gauge_family(name: str, documentation: str, labels=()) -> GaugeMetricFamily:
    """A gauge family for a scrape-time collector."""
    return GaugeMetricFamily(PREFIX + name, documentation, labels=list(labels))
