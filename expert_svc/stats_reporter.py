"""Expert hit counts, from the model's device counters to the router.

Every `every_steps` steps the model thread copies `hit_counts_LE` to the host
(one transfer for all layers) and takes the delta since the last report. On
CUDA the copy is queued behind the step's kernels into pinned memory and read
at a later step once it has landed, so the rank never waits for the device
here (a launched-ahead next step keeps the GPU busy). The event loop sends it
(expert_svc/router_client.py, with a deadline) in a background task. A slow or absent
router never stalls the steps: while a send is in flight, or after one
failed, new deltas merge into the one pending report, which goes with the
next send (counts are never dropped, only delayed; merging bounds memory).
"""

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

log = logging.getLogger("expert_svc.stats")


@dataclasses.dataclass(slots=True)
class HitReport:
    """Tokens this rank routed to each expert over a range of steps."""

    first_step_id: int
    last_step_id: int
    counts_LE: torch.Tensor  # int64 on the host, [num_moe_layers, num_experts]

    def merge(self, later: "HitReport") -> None:
        """Adds a later report's counts into this one."""
        self.last_step_id = later.last_step_id
        self.counts_LE += later.counts_LE


class HitSink(Protocol):
    """Where reports go: the router (expert_svc/router_client.py's RouterClient)."""

    async def report_hits(self, report: HitReport) -> bool:
        """Sends one report; False if it did not arrive (the reporter keeps its counts)."""

    async def close(self) -> None:
        """Stops sending."""


class StatsReporter:
    """Turns the model's hit counters into reports to the router."""

    def __init__(self, hit_counts_LE: torch.Tensor, moe_layers: Sequence[int], *, every_steps: int,
                 router: HitSink, loop: asyncio.AbstractEventLoop):
        assert hit_counts_LE.shape[0] == len(moe_layers)
        self._device_counts_LE = hit_counts_LE
        self._moe_layers = list(moe_layers)
        self._every_steps = every_steps
        self._router = router
        self._loop = loop
        self._last_counts_LE = hit_counts_LE.to("cpu", copy=True)
        self._first_step_id: int | None = None
        self._steps_since_report = 0
        self._pending: HitReport | None = None
        # CUDA: a copy of the counters on its way to the host (event, host tensor, first and last step).
        self._in_flight: tuple[torch.cuda.Event, torch.Tensor, int, int] | None = None
        self._sender: asyncio.Task | None = None
        self.num_sent = 0  # reports that reached the router

    @property
    def counts_LE(self) -> torch.Tensor:
        """Host copy of the hit counts as of the last delta (cumulative; for /metrics)."""
        return self._last_counts_LE

    @property
    def moe_layers(self) -> list[int]:
        """The model's MoE layer indices, one per row of counts_LE."""
        return list(self._moe_layers)

    # --- model thread ---

    def after_step(self, step_id: int) -> None:
        """Counts a step; every `every_steps` steps hands a delta to the event loop."""
        if self._every_steps <= 0:
            return
        if self._in_flight is not None and self._in_flight[0].query():
            self._deliver(self._land())
        if self._first_step_id is None:
            self._first_step_id = step_id
        self._steps_since_report += 1
        if self._steps_since_report >= self._every_steps:
            if not self._device_counts_LE.is_cuda:
                self._deliver(self.take_delta(step_id))
                return
            if self._in_flight is not None:  # the last copy still travels (never seen): wait for it
                self._in_flight[0].synchronize()
                self._deliver(self._land())
            first = step_id if self._first_step_id is None else self._first_step_id
            host_LE = torch.empty(self._device_counts_LE.shape, dtype=self._device_counts_LE.dtype, pin_memory=True)
            host_LE.copy_(self._device_counts_LE, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._in_flight = (event, host_LE, first, step_id)
            self._first_step_id, self._steps_since_report = None, 0

    def take_delta(self, last_step_id: int) -> HitReport:
        """The counts routed since the last delta (one blocking device-to-host copy)."""
        counts_LE = self._device_counts_LE.to("cpu", copy=True)
        first = last_step_id if self._first_step_id is None else self._first_step_id
        self._first_step_id, self._steps_since_report = None, 0
        return self._delta(counts_LE, first, last_step_id)

    def _land(self) -> HitReport:
        """The report of the copy in flight, which has reached the host."""
        _, host_LE, first, last = self._in_flight
        self._in_flight = None
        return self._delta(host_LE, first, last)

    def _delta(self, counts_LE: torch.Tensor, first: int, last: int) -> HitReport:
        delta_LE = counts_LE - self._last_counts_LE
        self._last_counts_LE = counts_LE
        return HitReport(first, last, delta_LE)

    def _deliver(self, report: HitReport) -> None:
        self._loop.call_soon_threadsafe(self._enqueue, report)

    # --- event loop ---

    def _enqueue(self, report: HitReport) -> None:
        if self._pending is None:
            self._pending = report
        else:
            self._pending.merge(report)
            log.debug("router busy or away: merged hit counts up to step %d", report.last_step_id)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_pending())

    async def _send_pending(self) -> None:
        while self._pending is not None:
            report, self._pending = self._pending, None
            if not await self._router.report_hits(report):
                # Keep the counts; the next delta retries them.
                if self._pending is not None:
                    report.merge(self._pending)
                self._pending = report
                return
            self.num_sent += 1

    async def close(self) -> None:
        """Stops sending; counts not yet sent are dropped."""
        if self._sender is not None:
            self._sender.cancel()
            try:
                await self._sender
            except asyncio.CancelledError:
                pass
        await self._router.close()
