"""The gateway's traces, request metrics, scrape-time state metrics and readiness.

Three hooks, all cheap when tracing is off:

- `observe_generate` decorates GenerationServicer.Generate: per request it
  records TTFT, inter-token and end-to-end latency, generated tokens and the
  outcome (`moemesh_requests_total{finish_reason,code}`), sets the request
  and trace ids for log lines, and annotates the call's SERVER span (the
  request's root span: the tracing interceptor makes it a child of the
  client's context) with the request id, token counts and finish reason.
  The HTTP endpoint (gateway/http/app.py) makes the same RequestObservation
  per request and feeds it its RequestOutputs (`on_output`); its root span is
  FastAPI's SERVER span, a child of the caller's traceparent header.
- `EngineObserver` (one per Engine) sees each step planned and completed:
  queue time, the group's step time, each rank's result lag; while a request
  is traced it also opens the child spans `queue_wait`, `prefill_chunk`
  (one per chunk, plan to results) and `decode` (first decode step to the
  end; decode steps are span events every DECODE_EVENT_EVERY steps, never
  spans), and writes the root span's traceparent into the `NewSequence` of
  the step plan, so the rank's span of the sequence joins the trace.
  Untraced requests cost one dict lookup per new sequence; traced ones one
  per scheduled sequence and step.
- `GatewayStateCollector` reads the queue, the running sequences, the KV pools
  and the prefix-cache counters when Prometheus scrapes: nothing on the step
  path. `GatewayReadiness` is the gateway's /readyz.

KV utilization of a rank: blocks held by sequences over all blocks (blocks of
the prefix cache no sequence uses count as free: they are evicted on demand).
Fragmentation ratio of the group: the free blocks that cannot serve the next
request over all free blocks, the next request being the head of the waiting
queue (the oldest waiting sequence, preempted ones first: what fcfs admits
next). A rank's free blocks "cannot serve" it when they are fewer than the
blocks its prompt plus one token needs there beyond its cached prefix: that
memory is stranded on the wrong rank (each rank has its own pool). 0 while
nothing waits or nothing is free.
"""

import asyncio
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import grpc
from opentelemetry import trace

from gateway.kv_accounting import RankKV
from gateway.requests import RequestOutput
from moe.gateway.v1 import gateway_pb2
from services import metrics, telemetry
from services.logging_json import REQUEST_CONTEXT, RequestLogContext

log = logging.getLogger("gateway.observability")

# A decode span gets an event on its first decode step and every this many after.
DECODE_EVENT_EVERY = 16
# /readyz: the gateway is not ready while any rank's KV utilization is at or above this.
KV_READY_LIMIT = 0.85

_CURRENT: contextvars.ContextVar["RequestObservation | None"] = contextvars.ContextVar(
    "moemesh_request_observation", default=None)
_FINISH_REASONS = {value: name.removeprefix("FINISH_REASON_").lower()
                   for name, value in gateway_pb2.FinishReason.items()}


class RequestTrace:
    """The open child spans of one traced request."""

    __slots__ = ("context", "traceparent", "queue_span", "decode_span", "num_decode_steps", "chunk_spans")

    def __init__(self, root: trace.Span) -> None:
        self.context = trace.set_span_in_context(root)
        self.traceparent = telemetry.traceparent_of(root)
        self.queue_span: trace.Span | None = telemetry.tracer().start_span("queue_wait", context=self.context)
        self.decode_span: trace.Span | None = None
        self.num_decode_steps = 0
        self.chunk_spans: list[trace.Span] = []

    def on_scheduled(self, step_id: int, rank: int, num_tokens: int, batch_size: int,
                     chunk_spans: list) -> None:
        """The request is in step step_id on rank with num_tokens prompt tokens (0: a decode)."""
        if self.queue_span is not None:
            self.queue_span.set_attribute("moemesh.rank", rank)
            self.queue_span.end()
            self.queue_span = None
        attributes = {"moemesh.step_id": step_id, "moemesh.rank": rank, "moemesh.batch_size": batch_size}
        if num_tokens:
            span = telemetry.tracer().start_span(
                "prefill_chunk", context=self.context, attributes={**attributes, "moemesh.num_tokens": num_tokens})
            self.chunk_spans.append(span)
            chunk_spans.append(span)
            return
        if self.decode_span is None:
            self.decode_span = telemetry.tracer().start_span("decode", context=self.context,
                                                             attributes={"moemesh.rank": rank})
        if self.num_decode_steps % DECODE_EVENT_EVERY == 0:
            self.decode_span.add_event("decode_step", {**attributes, "moemesh.decode_step": self.num_decode_steps})
        self.num_decode_steps += 1

    def end(self) -> None:
        """Ends every span still open (the request is over)."""
        for span in (self.queue_span, *self.chunk_spans):
            if span is not None and span.is_recording():
                span.end()
        if self.decode_span is not None:
            self.decode_span.set_attribute("moemesh.num_decode_steps", self.num_decode_steps)
            self.decode_span.end()
        self.queue_span = self.decode_span = None
        self.chunk_spans = []


class RequestObservation:
    """One Generate call, from its arrival to its last message."""

    __slots__ = ("start", "last_token_at", "num_tokens", "request_id", "finish_reason", "root", "trace",
                 "seq_id", "observer", "queued_at", "log_context", "_tokens")

    def __init__(self, request: gateway_pb2.GenerateRequest, context, root: trace.Span | None = None) -> None:
        """context: the call's (invocation_metadata(), code()); root: its SERVER span (default: the current one)."""
        self.start = time.monotonic()
        self.last_token_at = 0.0
        self.num_tokens = 0
        self.request_id = request.request_id
        self.finish_reason = "none"
        span = trace.get_current_span() if root is None else root
        self.root = span if span.is_recording() else None
        self.trace: RequestTrace | None = None
        self.seq_id: int | None = None
        self.observer: EngineObserver | None = None
        self.queued_at = 0.0
        trace_id = format(span.get_span_context().trace_id, "032x") if span.get_span_context().is_valid else \
            telemetry.trace_id_from_traceparent(telemetry.metadata_value(context.invocation_metadata(), "traceparent"))
        self.log_context = RequestLogContext(self.request_id, trace_id)
        self._tokens = (_CURRENT.set(self), REQUEST_CONTEXT.set(self.log_context))

    def on_response(self, response: gateway_pb2.GenerateResponse) -> None:
        finish = _FINISH_REASONS.get(response.finish_reason, "none") if response.finish_reason else None
        self.on_message(response.request_id, len(response.token_ids), finish, response.index)

    def on_output(self, output: RequestOutput) -> None:
        """A RequestOutput sent by another transport (HTTP)."""
        finish = None if output.finish_reason is None else output.finish_reason.name.lower()
        self.on_message(output.request_id, len(output.token_ids), finish, output.index)

    def on_message(self, request_id: str, num_tokens: int, finish_reason: str | None, index: int = 0) -> None:
        """One message to the client: num_tokens new tokens of sample `index`, the finish reason on its last."""
        if request_id and request_id != self.request_id:
            self.request_id = self.log_context.request_id = request_id
        if num_tokens:
            now = time.monotonic()
            m = metrics.gateway_metrics()
            if not self.num_tokens:
                m.time_to_first_token.observe(now - self.start)
            # The pace of the first sample: the messages of n samples interleave.
            if not index:
                if self.last_token_at:
                    gap = (now - self.last_token_at) / num_tokens
                    for _ in range(num_tokens):
                        m.inter_token_latency.observe(gap)
                self.last_token_at = now
            m.generation_tokens.inc(num_tokens)
            self.num_tokens += num_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason

    def finish(self, context, error: BaseException | None) -> None:
        """Records the outcome and ends the request's spans."""
        if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            code = grpc.StatusCode.CANCELLED
        else:
            code = context.code()
            if not isinstance(code, grpc.StatusCode):
                code = grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
        m = metrics.gateway_metrics()
        m.requests.labels(self.finish_reason, code.name).inc()
        if self.finish_reason != "none":
            m.e2e_request_latency.observe(time.monotonic() - self.start)
        if self.root is not None:
            self.root.set_attributes({
                "moemesh.request_id": self.request_id,
                "moemesh.finish_reason": self.finish_reason,
                "gen_ai.usage.output_tokens": self.num_tokens,
            })
        if self.trace is not None:
            self.trace.end()
        if self.observer is not None:
            self.observer.forget(self)
        for var, token in zip((_CURRENT, REQUEST_CONTEXT), self._tokens):
            try:
                var.reset(token)
            except ValueError:
                pass  # closed from another context (a garbage-collected stream): nothing to restore


def observe_generate(method):
    """Decorates the Generate handler (an async generator) with the request's
    metrics, log context and root-span attributes."""

    @functools.wraps(method)
    async def generate(self, request, context):
        observation = RequestObservation(request, context)
        error = None
        try:
            async for response in method(self, request, context):
                observation.on_response(response)
                yield response
        except BaseException as caught:
            error = caught
            raise
        finally:
            observation.finish(context, error)

    return generate


class EngineObserver:
    """The engine's hooks (see the module docstring); one per Engine."""

    def __init__(self, num_ranks: int) -> None:
        m = metrics.gateway_metrics()
        self._metrics = m
        self._lag = [m.rank_result_lag.labels(str(rank)) for rank in range(num_ranks)]
        self._arrivals = [0.0] * num_ranks
        self._requests: dict[int, RequestObservation] = {}
        self._traced: dict[int, RequestTrace] = {}
        self._chunk_spans: dict[int, list[trace.Span]] = {}

    def on_submit(self, seq) -> None:
        """A request was queued (called in its Generate call's context); a call for n
        samples is observed through its first (the others share its prompt)."""
        if seq.leader is not None:
            return
        self._metrics.prompt_tokens.inc(len(seq.prompt_ids))
        observation = _CURRENT.get()
        if observation is None:
            return
        observation.seq_id, observation.observer, observation.queued_at = seq.seq_id, self, time.monotonic()
        if observation.request_id != seq.request_id:
            observation.request_id = observation.log_context.request_id = seq.request_id
        self._requests[seq.seq_id] = observation
        if observation.root is not None:
            observation.root.set_attributes({"moemesh.request_id": seq.request_id, "moemesh.seq_id": seq.seq_id,
                                             "gen_ai.usage.input_tokens": len(seq.prompt_ids)})
            observation.trace = self._traced[seq.seq_id] = RequestTrace(observation.root)

    def forget(self, observation: RequestObservation) -> None:
        self._requests.pop(observation.seq_id, None)
        self._traced.pop(observation.seq_id, None)

    def on_step_planned(self, batch) -> None:
        """The step is scheduled (its plans not yet frozen): queue times, spans, traceparents."""
        for plan in batch.plans:
            for i, new in enumerate(plan.new_sequences):
                observation = self._requests.get(new.seq_id)
                if observation is None:
                    continue
                if observation.queued_at:
                    self._metrics.request_queue_time.observe(time.monotonic() - observation.queued_at)
                    observation.queued_at = 0.0
                if observation.trace is not None:
                    plan.new_sequences[i] = dataclasses.replace(new, traceparent=observation.trace.traceparent)
            if self._traced:
                self._trace_plan(batch.step_id, plan)

    def _trace_plan(self, step_id: int, plan) -> None:
        chunk_spans = self._chunk_spans.setdefault(step_id, [])
        for scheduled in plan.scheduled:
            request_trace = self._traced.get(scheduled.seq_id)
            if request_trace is not None:
                request_trace.on_scheduled(step_id, plan.rank, len(scheduled.token_ids), len(plan.scheduled),
                                           chunk_spans)

    async def read(self, stream, rank: int):
        """Reads a rank's step result (a rank_client.StepStream), noting when it arrived."""
        result = await stream.receive()
        self._arrivals[rank] = time.perf_counter()
        return result

    def on_step_done(self, batch, results) -> None:
        """Every rank answered the step (StepResults by rank, checked by the engine)."""
        self._metrics.step_duration.observe(max(r.execute_seconds for r in results))
        first = min(self._arrivals)
        for lag, arrived in zip(self._lag, self._arrivals):
            lag.observe(arrived - first)
        for span in self._chunk_spans.pop(batch.step_id, ()):
            if span.is_recording():
                span.end()


def kv_utilization(kv: RankKV) -> float:
    """Blocks held by sequences over the pool's blocks (see the module docstring)."""
    return 1.0 - kv.num_available / kv.num_blocks


def fragmentation_ratio(ranks: list[RankKV], head) -> float:
    """Free blocks on ranks that cannot start `head` (a waiting Sequence, or None)
    over all free blocks (see the module docstring)."""
    if head is None:
        return 0.0
    num_free = num_stranded = 0
    for kv in ranks:
        available = kv.num_available
        num_free += available
        match = kv.match(head.token_ids, head.block_hashes, is_estimate=True)
        num_needed = kv.blocks_needed(len(head.token_ids) + 1) - len(match.nodes)
        if num_needed > available - match.num_unreferenced:
            num_stranded += available
    return num_stranded / num_free if num_free else 0.0


class GatewayStateCollector:
    """Scrape-time metrics of the gateway's current engine and its GatewayStats."""

    def __init__(self, get_engine: Callable[[], object], stats) -> None:
        self._get_engine = get_engine
        self._stats = stats

    def collect(self):
        engine = self._get_engine()
        batcher = None if engine is None else engine.batcher
        serving = metrics.gauge_family("group_serving", "1 while the gateway drives a ready worker group.")
        serving.add_metric([], 0 if engine is None else 1)
        waiting = metrics.gauge_family("num_requests_waiting", "Requests queued for a rank (preempted ones included).")
        running = metrics.gauge_family("num_requests_running", "Sequences running on the ranks.")
        utilization = metrics.gauge_family(
            "kv_cache_utilization_ratio", "Share of the rank's KV blocks held by sequences.", ["rank"])
        blocks = metrics.gauge_family("kv_cache_blocks", "KV blocks of the rank's pool.", ["rank"])
        fragmentation = metrics.gauge_family(
            "kv_cache_fragmentation_ratio", "Free KV blocks that cannot serve the head of the waiting "
            "queue (on ranks too full for it) over all free blocks.")
        if batcher is not None:
            waiting.add_metric([], batcher.num_waiting)
            running.add_metric([], sum(len(seqs) for seqs in batcher.running))
            for rank, kv in enumerate(batcher.ranks):
                utilization.add_metric([str(rank)], kv_utilization(kv))
                blocks.add_metric([str(rank)], kv.num_blocks)
            queue = batcher.waiting
            fragmentation.add_metric([], fragmentation_ratio(batcher.ranks, queue[0] if queue else None))
        yield from (serving, waiting, running, utilization, blocks, fragmentation)
        yield from self._stats_families()

    def _stats_families(self):
        stats = self._stats
        queried = metrics.counter_family("prefix_cache_query_tokens", "Prompt tokens looked up in the "
                                         "prefix cache (first admission of each request).")
        hits = metrics.counter_family("prefix_cache_hit_tokens", "Of those, tokens served from the prefix cache.")
        ratio = metrics.gauge_family("prefix_cache_hit_ratio", "prefix_cache_hit_tokens over "
                                     "prefix_cache_query_tokens since the gateway started.")
        copied = metrics.counter_family("prefix_cache_copied_blocks", "KV blocks copied for cached prefixes that "
                                        "end inside a block (their tokens are counted as hits).")
        preemptions = metrics.counter_family("preemptions", "Sequences preempted for KV blocks (re-prefilled later).")
        jumped = metrics.counter_family("jump_forward_tokens", "Output tokens a constraint forced, appended by "
                                        "jump-forward without a model step each.")
        rejected = metrics.counter_family("requests_rejected", "Requests refused before queueing.", ["reason"])
        if stats is not None:
            queried.add_metric([], stats.num_prompt_tokens)
            hits.add_metric([], stats.num_cached_prompt_tokens)
            ratio.add_metric([], stats.prefix_hit_rate)
            copied.add_metric([], stats.num_block_copies)
            preemptions.add_metric([], stats.num_preemptions)
            jumped.add_metric([], stats.num_jump_forward_tokens)
            rejected.add_metric(["queue_full"], stats.num_rejected_queue_full)
            rejected.add_metric(["overload"], stats.num_rejected_overload)
        yield from (queried, hits, ratio, copied, preemptions, jumped, rejected)


class GatewayReadiness:
    """/readyz of the gateway: group formed, every expert of every rank loaded,
    KV utilization of every rank below KV_READY_LIMIT, and the engine serving."""

    def __init__(self, manager, num_experts: int, cluster) -> None:
        self._manager = manager
        self._num_experts = num_experts
        self._cluster = cluster

    async def __call__(self) -> dict:
        group = self._manager.group
        engine = self._manager.engine
        num_loaded = 0
        if engine is not None:
            num_loaded = self._num_experts  # the engine starts once every rank is ready
        elif group is not None:
            num_loaded = await self._experts_loaded(group)
        utilization = 0.0
        if engine is not None:
            utilization = max(kv_utilization(kv) for kv in engine.batcher.ranks)
        report = {
            "group_formed": group is not None,
            "group_id": None if group is None else group.group_id,
            "experts_ready": f"{num_loaded}/{self._num_experts}",
            "kv_utilization": round(utilization, 4),
            "kv_utilization_limit": KV_READY_LIMIT,
            "serving": engine is not None,
        }
        if self._manager.model_mismatch:
            # The group serves another model (gateway/model_check.py): never ready on it.
            report["model_mismatch"] = self._manager.model_mismatch
            report["serving"] = False
        report["ready"] = (report["group_formed"] and report["serving"] and num_loaded == self._num_experts
                           and utilization < KV_READY_LIMIT)
        return report

    async def _experts_loaded(self, group) -> int:
        """Experts on the group's ranks that marked themselves ready in etcd."""
        try:
            async with asyncio.timeout(1.0):
                ready = await self._cluster.ready_ranks(group.group_id, group.epoch)
        except (TimeoutError, ConnectionError) as error:
            log.debug("readiness: cannot read the ready ranks: %r", error)
            return 0
        per_rank = self._num_experts // max(1, group.world_size)
        return per_rank * len(ready & set(range(group.world_size)))
