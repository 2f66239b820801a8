"""StatsReporter's deltas: exactly the steps each report names, on the CPU (a blocking
copy at the report step) and on CUDA (a copy queued behind the step, read once landed)."""

import asyncio

import pytest
import torch

from expert_svc.router_client import RouterClient
from expert_svc.stats_reporter import StatsReporter

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_each_delta_holds_exactly_its_steps(device):
    counts_LE = torch.zeros(2, 4, dtype=torch.int64, device=device)
    delivered = []

    async def resolve():
        return None

    router = RouterClient(resolve, group_id="g", rank=0, moe_layers=[0, 1], deadline_s=1.0)
    reporter = StatsReporter(counts_LE, [0, 1], every_steps=3, router=router, loop=asyncio.new_event_loop())
    reporter._deliver = delivered.append  # the event loop's side is tested in test_servicer.py
    for step in range(1, 11):
        if device == "cuda":  # a long kernel ahead of the increment: the copy cannot land at once
            torch.cuda._sleep(1_000_000)
        counts_LE[step % 2, step % 4] += step  # step k adds k
        reporter.after_step(step)
    if device == "cuda":
        torch.cuda.synchronize()
        reporter.after_step(11)  # lands the last copy in flight
    ranges = [(r.first_step_id, r.last_step_id) for r in delivered]
    assert ranges[:3] == [(1, 3), (4, 6), (7, 9)]
    for report in delivered[:3]:
        assert report.counts_LE.device.type == "cpu"
        assert int(report.counts_LE.sum()) == sum(range(report.first_step_id, report.last_step_id + 1))
