"""GetExpertStats over a window: recent counts only, rank loads under the group's placement."""

import asyncio

import grpc
import pytest

from moe.router.v1 import router_pb2
from router_svc.load import ExpertLoad, group_placement
from router_svc.servicer import RouterServicer
from router_svc.stats import ExpertStats
from router_svc.windows import SlidingWindows
from services.placement import EMPTY, Placement


class Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code, details):
        raise Aborted(code, details)


def test_window_counts_and_rank_loads_follow_the_placement():
    now = [0.0]
    placement = Placement(4, 2, 1, {0: (EMPTY, 0)})  # rank 1's spare holds a replica of expert 0
    servicer = RouterServicer(ExpertLoad(ExpertStats(), windows=SlidingWindows(60), clock=lambda: now[0],
                                         placement_of=lambda group_id: placement if group_id == "g" else None))

    def report(rank, counts):
        request = router_pb2.ReportExpertHitsRequest(group_id="g", rank=rank,
                                                     layers=[router_pb2.LayerHits(layer=0, counts=counts)])
        asyncio.run(servicer.ReportExpertHits(request, FakeContext()))

    def stats(**kwargs):
        return asyncio.run(servicer.GetExpertStats(router_pb2.GetExpertStatsRequest(**kwargs), FakeContext()))

    report(0, [10, 0, 0, 0])
    now[0] = 30.0
    report(1, [6, 2, 0, 0])
    recent = stats(group_id="g", window_s=10).layers[0]
    assert list(recent.counts) == [6, 2, 0, 0] and list(recent.hit_rates) == [0.75, 0.25, 0.0, 0.0]
    assert list(recent.rank_loads) == [5.0, 3.0] and recent.rank_load_imbalance == pytest.approx(1.25)
    everything = stats(group_id="g").layers[0]
    assert list(everything.counts) == [16, 2, 0, 0] and list(everything.rank_loads) == [10.0, 8.0]
    assert not stats().layers[0].rank_loads  # all groups together: no placement
    for bad in (dict(window_s=5), dict(group_id="g", window_s=-1)):
        with pytest.raises(Aborted) as error:
            stats(**bad)
        assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_group_without_a_placement_read_is_modelled_by_its_primaries():
    stats, windows = ExpertStats(), SlidingWindows(60)
    assert group_placement("g", {}, windows, stats) is None  # nothing reported
    for rank in (0, 1):
        stats.add_report("g", [(0, [1, 2, 3, 4])])
        windows.add("g", rank, [(0, [1, 2, 3, 4])], 0.0)
    assert group_placement("g", {}, windows, stats) == Placement(4, 2, 0)
    read = Placement(4, 2, 1, {0: (EMPTY, 0)}, epoch=3)
    assert group_placement("g", {"g": read}, windows, stats) is read
    windows.add("g", 2, [(0, [1, 2, 3, 4])], 1.0)  # three ranks: 4 experts do not split evenly
    assert group_placement("g", {}, windows, stats) is None
