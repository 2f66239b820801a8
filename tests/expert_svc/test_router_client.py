"""The hit reports' way to the router: their protobuf (expert_svc/router_client.py), a router that
is not there (no report, no lost counts), and the reporter's retry of what a failed send held."""

import asyncio

import torch

from expert_svc.router_client import RouterClient, hits_request
from expert_svc.stats_reporter import HitReport, StatsReporter


def test_a_report_becomes_one_layer_message_per_moe_layer():
    report = HitReport(4, 6, torch.tensor([[1, 0, 2], [0, 3, 0]], dtype=torch.int64))
    request = hits_request(report, group_id="g2", rank=1, moe_layers=[1, 3])
    assert (request.group_id, request.rank, request.first_step_id, request.last_step_id) == ("g2", 1, 4, 6)
    assert [(layer.layer, list(layer.counts)) for layer in request.layers] == [(1, [1, 0, 2]), (3, [0, 3, 0])]


def test_without_a_router_nothing_is_sent():
    async def no_router():
        return None

    async def scenario():
        client = RouterClient(no_router, group_id="g", rank=0, moe_layers=[0], deadline_s=1.0)
        sent = await client.report_hits(HitReport(1, 1, torch.ones(1, 2, dtype=torch.int64)))
        await client.close()
        return sent

    assert asyncio.run(scenario()) is False


class FlakyRouter:
    """Refuses the first `num_failures` reports, then keeps the rest."""

    def __init__(self, num_failures: int):
        self.num_failures, self.reports = num_failures, []

    async def report_hits(self, report: HitReport) -> bool:
        if self.num_failures:
            self.num_failures -= 1
            return False
        self.reports.append((report.first_step_id, report.last_step_id, report.counts_LE.clone()))
        return True

    async def close(self) -> None:
        pass


def test_counts_of_a_failed_send_go_with_the_next_one():
    async def scenario():
        router = FlakyRouter(num_failures=1)
        counts_LE = torch.zeros(1, 2, dtype=torch.int64)
        reporter = StatsReporter(counts_LE, [0], every_steps=1, router=router, loop=asyncio.get_running_loop())
        for step, expert in ((1, 0), (2, 1)):
            counts_LE[0, expert] += step
            reporter.after_step(step)
            for _ in range(100):  # the report reaches the loop, then the (fake) router
                await asyncio.sleep(0)
        await reporter.close()
        return router.reports, reporter.num_sent

    reports, num_sent = asyncio.run(scenario())
    assert num_sent == 1
    assert [(first, last, counts.tolist()) for first, last, counts in reports] == [(1, 2, [[1, 2]])]
