"""Sliding windows of expert hits: per group and layer, the hits of the last W seconds. Pure.

Each accepted report is kept with its arrival time for `horizon_s` (the
longest window anyone asks for); a window's counts are the sum of the
reports that arrived within it. The policy needs to know whether a window
is full, so `span_s` tells how long the group has been observed.
"""

import collections
import dataclasses
from collections.abc import Iterable, Sequence


@dataclasses.dataclass(slots=True)
class _Report:
    time_s: float
    layers: list[tuple[int, list[int]]]


class SlidingWindows:
    """The recent reports of every group, bounded by horizon_s."""

    def __init__(self, horizon_s: float):
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s}")
        self.horizon_s = horizon_s
        self._reports: dict[str, collections.deque[_Report]] = {}
        self._first_s: dict[str, float] = {}
        self._world_sizes: dict[str, int] = {}

    def add(self, group_id: str, rank: int, layers: Iterable[tuple[int, Sequence[int]]], now_s: float) -> None:
        """One rank's report (already validated by ExpertStats)."""
        reports = self._reports.setdefault(group_id, collections.deque())
        reports.append(_Report(now_s, [(layer, list(counts)) for layer, counts in layers]))
        self._first_s.setdefault(group_id, now_s)
        self._world_sizes[group_id] = max(self._world_sizes.get(group_id, 0), rank + 1)
        while reports and reports[0].time_s < now_s - self.horizon_s:
            reports.popleft()

    def groups(self) -> list[str]:
        return sorted(self._reports)

    def num_reporting_ranks(self, group_id: str) -> int:
        """The highest rank that reported for the group, plus one."""
        return self._world_sizes.get(group_id, 0)

    def span_s(self, group_id: str, now_s: float) -> float:
        """How long the group has been observed (0 before its first report)."""
        first = self._first_s.get(group_id)
        return 0.0 if first is None else now_s - first

    def counts(self, group_id: str, window_s: float, now_s: float) -> dict[int, list[int]]:
        """Per layer, the hits per expert of the reports of the last window_s seconds."""
        totals: dict[int, list[int]] = {}
        for report in reversed(self._reports.get(group_id, ())):
            if report.time_s < now_s - window_s:
                break
            for layer, counts in report.layers:
                acc = totals.setdefault(layer, [0] * len(counts))
                for expert, count in enumerate(counts):
                    acc[expert] += count
        return dict(sorted(totals.items()))

    def reset(self, group_id: str, now_s: float) -> None:
        """Starts the group's observation anew (e.g. after a placement change)."""
        self._reports.pop(group_id, None)
        self._first_s[group_id] = now_s
