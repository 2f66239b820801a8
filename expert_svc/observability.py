"""One rank's traces, step and all-to-all metrics, scrape-time state and readiness.

Traces: one span per sequence and rank (`expert.sequence`), from the plan
that introduces it to the plan that forgets it (or the end of the stream),
child of the gateway's root span of the request, whose context arrives in
`NewSequence.traceparent`. It counts the steps, prefill tokens and decode
steps the rank ran for the sequence. We chose a span per sequence over a
span per step with links: a step serves many requests, and a span per step
would be one span per token of the busiest request, which the trace of a
request must not have; the sequence span shows where the request's rank
work starts and ends, and the gateway's `prefill_chunk` and `decode` spans
already time each step. Sequences without a traceparent (untraced, or
sampled out at the gateway) get no span; with tracing off `SequenceTracer`
is not created at all.

All-to-all: `MeteredExpertComm` counts the bytes of every all_to_all the
MoE layers send (on CUDA with several ranks: of every all_gather and
reduce_scatter of services/model/kernels/moe_ep.py, which replace them) (the size of the send buffer, the rank's own share
included: a host-side product of the tensor's shape, no device access) and,
when timed, the host time around each call. The CPU's gloo collectives are
synchronous, so they are always timed; on CUDA the calls only enqueue work,
and timing them needs a synchronize before and after, so it is done only
with `--debug-collective-timing` (it costs throughput; never in production).
If a step is captured in a CUDA graph, Python runs only at capture: the
counts then cover captures, not replays. `step_hook` moves the step's totals
into the histograms on the model thread, after the step.
"""

import time

import torch
from opentelemetry import trace

from expert_svc.state import RankState
from services import metrics, telemetry
from services.model.exchange.comm import ExpertComm


class MeteredExpertComm(ExpertComm):
    """ExpertComm that adds up the bytes (and, if timed, seconds) of its MoE collectives: the
    all-to-alls, and on CUDA with several ranks moe_ep's all_gather and reduce_scatter."""

    def __init__(self, group, *, is_timed: bool, is_cuda: bool = False):
        super().__init__(group)
        self._is_timed = is_timed
        self._is_cuda = is_cuda
        self.step_bytes = 0
        self.step_seconds = 0.0

    def all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        self._metered(inp, lambda: super(MeteredExpertComm, self).all_to_all(out, inp, out_splits, in_splits))

    def all_gather(self, out, inp) -> None:
        self._metered(inp, lambda: super(MeteredExpertComm, self).all_gather(out, inp))

    def reduce_scatter(self, out, inp) -> None:
        self._metered(inp, lambda: super(MeteredExpertComm, self).reduce_scatter(out, inp))

    def _metered(self, inp, call) -> None:
        """call(), counting inp's bytes and, if timed, the host time around it."""
        self.step_bytes += inp.numel() * inp.element_size()
        if not self._is_timed:
            call()
            return
        if self._is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if self._is_cuda:
            torch.cuda.synchronize()
        self.step_seconds += time.perf_counter() - start

    def take_step_totals(self) -> tuple[int, float]:
        """(bytes, seconds) since the last call."""
        totals = (self.step_bytes, self.step_seconds)
        self.step_bytes, self.step_seconds = 0, 0.0
        return totals


def step_hook(after_step, comm):
    """The StepExecutor's after_step: `after_step(step_id)`, then the step's all-to-all totals."""
    m = metrics.expert_metrics()
    is_timed = isinstance(comm, MeteredExpertComm) and comm._is_timed

    def hook(step_id: int) -> None:
        if after_step is not None:
            after_step(step_id)
        if isinstance(comm, MeteredExpertComm):
            num_bytes, seconds = comm.take_step_totals()
            m.all_to_all_bytes.observe(num_bytes)
            if is_timed:
                m.all_to_all_duration.observe(seconds)

    return hook


def observe_step(execute_seconds: float) -> None:
    """Records one step's execution time (the servicer calls it per result)."""
    metrics.expert_metrics().step_duration.observe(execute_seconds)


class _SequenceSpan:
    __slots__ = ("span", "num_steps", "num_prefill_tokens", "num_decode_steps")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.num_steps = self.num_prefill_tokens = self.num_decode_steps = 0

    def end(self, reason: str) -> None:
        self.span.set_attributes({"moemesh.num_steps": self.num_steps,
                                  "moemesh.num_prefill_tokens": self.num_prefill_tokens,
                                  "moemesh.num_decode_steps": self.num_decode_steps,
                                  "moemesh.end_reason": reason})
        self.span.end()


class SequenceTracer:
    """The spans of the sequences of one ExecuteSteps stream (see the module docstring)."""

    def __init__(self, state: RankState) -> None:
        self._state = state
        self._spans: dict[int, _SequenceSpan] = {}

    @classmethod
    def create(cls, state: RankState) -> "SequenceTracer | None":
        """A tracer while tracing is on, else None (the servicer skips it)."""
        return cls(state) if telemetry.is_enabled() else None

    def on_plan(self, plan) -> None:
        """A StepPlan (services/step.py) about to run: ends, starts and counts spans."""
        for seq_id in plan.finished_seq_ids:
            span = self._spans.pop(seq_id, None)
            if span is not None:
                span.end("finished")
        s = self._state
        for new in plan.new_sequences:
            parent = telemetry.context_from_traceparent(new.traceparent)
            if parent is None:
                continue
            old = self._spans.pop(new.seq_id, None)
            if old is not None:
                old.end("replaced")
            self._spans[new.seq_id] = _SequenceSpan(telemetry.tracer().start_span(
                "expert.sequence", context=parent, attributes={
                    "moemesh.seq_id": new.seq_id, "moemesh.rank": s.rank, "moemesh.group_id": s.group_id,
                    "moemesh.placement_epoch": s.placement_epoch, "moemesh.member_id": s.member_id,
                    "moemesh.num_cached_tokens": new.num_cached_tokens, "moemesh.first_step_id": plan.step_id}))
        if not self._spans:
            return
        for scheduled in plan.scheduled:
            span = self._spans.get(scheduled.seq_id)
            if span is not None:
                span.num_steps += 1
                if scheduled.token_ids:
                    span.num_prefill_tokens += len(scheduled.token_ids)
                else:
                    span.num_decode_steps += 1

    def end_all(self, reason: str = "stream closed") -> None:
        """The stream ended: every sequence is dropped."""
        for span in self._spans.values():
            span.end(reason)
        self._spans.clear()


def readiness(state: RankState):
    """/readyz of a rank: assigned, every expert slot loaded, in the process group, no failed step,
    not fenced (expert_svc/fencing.py)."""

    def report() -> dict:
        executor = state.executor
        is_loaded = executor is not None
        failed = is_loaded and executor.failure is not None
        fenced = is_loaded and executor.is_held
        num_experts = len(state.expert_ids)
        return {
            "ready": is_loaded and not failed and not fenced,
            "fenced": fenced,
            "group_id": state.group_id or None,
            "rank": state.rank if state.group_id else None,
            "world_size": state.world_size,
            "experts_ready": f"{num_experts if is_loaded else 0}/{num_experts}",
            "step_failed": failed,
        }

    return report


class ExpertStateCollector:
    """Scrape-time metrics of a rank: its state and the hit counts of its last report.

    get_reporter returns the rank's StatsReporter (None before it joins); its
    `counts_LE` is refreshed every stats_every_steps steps.
    """

    def __init__(self, state: RankState | None, get_reporter=lambda: None) -> None:
        self._state = state
        self._get_reporter = get_reporter

    def collect(self):
        ready = metrics.gauge_family("expert_ready", "1 while the rank is loaded, in its group and healthy.")
        kv_blocks = metrics.gauge_family("expert_kv_blocks", "KV blocks of the rank's pool.")
        sequences = metrics.gauge_family("expert_sequences", "Sequences the rank holds state for.")
        routed = metrics.counter_family(
            "expert_routed_tokens", "Tokens this rank's gate routed to each expert (each token counts "
            "top-k times), as of the rank's last hit-count report.", ["layer", "expert"])
        state = self._state
        if state is not None:
            executor = state.executor
            ready.add_metric([], int(executor is not None and executor.failure is None))
            kv_blocks.add_metric([], state.num_kv_blocks)
            sequences.add_metric([], 0 if executor is None else len(executor.runner.seq_ids))
        reporter = self._get_reporter()
        if reporter is not None:
            for layer, row in zip(reporter.moe_layers, reporter.counts_LE.tolist()):
                for expert, count in enumerate(row):
                    routed.add_metric([str(layer), str(expert)], count)
        yield from (ready, kv_blocks, sequences, routed)
        device = None if state is None or state.executor is None else state.executor.runner.device
        yield from _allocator_families(device if device is not None and device.type == "cuda" else None)


def _allocator_families(device: torch.device | None):
    """The CUDA caching allocator's counters on the rank's CUDA device (torch.cuda.memory_stats, no
    sync), without samples when there is none: a retry frees the cached blocks and synchronizes the
    device, and every cudaMalloc takes host time inside a step, so a serving step slower than the
    same step alone shows here."""
    retries = metrics.counter_family(
        "expert_cuda_alloc_retries", "Allocations the CUDA caching allocator could only serve after "
        "freeing its cached blocks (each synchronizes the device).")
    mallocs = metrics.counter_family(
        "expert_cuda_mallocs", "cudaMalloc calls of the CUDA caching allocator (new segments).")
    reserved = metrics.gauge_family("expert_cuda_reserved_bytes", "Device memory the caching allocator holds.")
    if device is not None:
        stats = torch.cuda.memory_stats(device)
        retries.add_metric([], stats.get("num_alloc_retries", 0))
        mallocs.add_metric([], stats.get("num_device_alloc", 0))
        reserved.add_metric([], stats.get("reserved_bytes.all.current", 0))
    yield from (retries, mallocs, reserved)
