"""Measured link costs: the exchange's collectives timed between rank pairs, fitted to cost_model's Links.

moemesh/link_probe.py (`moemesh measure-links`) times the collectives the two
exchange designs run (COLLECTIVES_OF: all_to_all_single alone on gloo, where
the gather design goes through it too; on NCCL also all_gather and
reduce_scatter, kernels/moe_ep.py's) between pairs of ranks at a sweep of
message sizes, and this module, pure Python, turns the timings into figures:

- link_pairs: the rank pairs that measure each link class, from each rank's
  node name: ranks of one node pair up for "local", ranks of two nodes for
  "network"; a class's pairs are disjoint, so they all run at once (what a
  rank gets while every rank exchanges, as in a MoE layer);
- slowest: per collective and size, the slowest pair's median time;
- fit_link: a cost_model.Link per class and collective: its latency is the
  small-message time (the median time of the smallest sizes, which one late
  call does not move), its bandwidth one over the least-squares slope of
  time against bytes over the largest sizes;
- combined: one Link per class over its collectives (the cost model has one);
- overrides_line: the `--ep-link-costs` string of the measured keys, which
  LinkCosts.with_overrides reads; table: the timings and figures as markdown.

A size is the bytes a rank sends its peer in one call (one direction, as the
cost model's bandwidth): all_to_all_single of 2 * size bytes a rank, all_gather
of size bytes, reduce_scatter of 2 * size bytes; float32 elements, so a size
is a multiple of 4.
"""

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from services.model.exchange.cost_model import Link

LINK_CLASSES = ("local", "network")
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter")
# The collectives of the two designs per backend (moe_dispatch.py: on gloo both designs are all_to_alls).
COLLECTIVES_OF = {"gloo": ("all_to_all",), "nccl": COLLECTIVES}
DEFAULT_SIZES = tuple(64 * 4 ** i for i in range(10))  # 64 B to 16 MiB to the peer
NUM_LARGE = 3  # the largest sizes, whose slope is the bandwidth
NUM_SMALL = 3  # the smallest sizes, whose median time is the latency
# Timed calls per repeat: about this many bytes to the peer, within [MIN_ITERS, MAX_ITERS].
ITER_BYTES, MIN_ITERS, MAX_ITERS = 64 << 20, 3, 50

# Per collective, per size in bytes to the peer: seconds a call (one value or the repeats).
Times = Mapping[str, Mapping[int, float]]


def parse_sizes(text: str, num_large: int = NUM_LARGE) -> tuple[int, ...]:
    """--sizes, "64,1024,...": distinct positive multiples of 4, more than num_large of them,
    in increasing order (ValueError quoting the bad value)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"sizes must be comma-separated byte counts, got {text!r}") from None
    if any(size <= 0 or size % 4 for size in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes (float32 elements), got {text!r}")
    if len(sizes) <= num_large:
        raise ValueError(f"sizes need more than {num_large} distinct values (the largest {num_large} "
                         f"fit the bandwidth, the smallest the latency), got {text!r}")
    return tuple(sizes)


def iterations(size: int) -> int:
    """Timed calls per repeat at `size` bytes to the peer: the same on every rank (the
    collectives must match), enough to time small messages, few of the big ones."""
    return max(MIN_ITERS, min(MAX_ITERS, ITER_BYTES // size))


def link_pairs(nodes: Sequence[str]) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per link class, disjoint rank pairs: each node's ranks in twos ("local"); the i-th ranks of
    nodes 0 and 1, 2 and 3, ... ("network"). A class without a pair is left out; ValueError if
    neither has one (one rank)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    ranks_H = list(by_node.values())
    local = tuple((ranks[i], ranks[i + 1]) for ranks in ranks_H for i in range(0, len(ranks) - 1, 2))
    network = tuple(pair for first, second in zip(ranks_H[0::2], ranks_H[1::2]) for pair in zip(first, second))
    pairs = {name: p for name, p in zip(LINK_CLASSES, (local, network)) if p}
    if not pairs:
        raise ValueError(f"no two ranks to measure between: ranks on nodes {list(nodes)}")
    return pairs


def slowest(reports: Sequence[Mapping[str, Mapping[int, Sequence[float]]]]) -> dict[str, dict[int, float]]:
    """Per collective and size, the largest over the ranks' reports of the median of its repeats
    (a pair's call ends when both ranks' do; the class is as fast as its slowest pair)."""
    times: dict[str, dict[int, float]] = {}
    for report in reports:
        for collective, repeats_by_size in report.items():
            row = times.setdefault(collective, {})
            for size, repeats in repeats_by_size.items():
                row[size] = max(row.get(size, 0.0), statistics.median(repeats))
    return times


def fit_link(times: Mapping[int, float], num_large: int = NUM_LARGE) -> Link:
    """A Link from seconds per call by bytes to the peer: latency = the median time of the
    NUM_SMALL smallest sizes (those below the largest num_large where fewer), bandwidth = 1 / the
    least-squares slope over the num_large largest sizes. ValueError with too few sizes (at
    least num_large + 1, num_large >= 2) or a slope that is not positive."""
    sizes = sorted(times)
    if num_large < 2 or len(sizes) <= num_large:
        raise ValueError(f"a fit needs more than {max(num_large, 2)} sizes (the largest {num_large} for the "
                         f"slope), got {len(sizes)}: {sizes}")
    large = sizes[-num_large:]
    slope = statistics.linear_regression(large, [times[size] for size in large]).slope  # least squares
    if slope <= 0:
        raise ValueError(f"the time does not grow with the size over {large} bytes "
                         f"({[times[s] for s in large]} s): measure larger sizes")
    small = sizes[:min(NUM_SMALL, len(sizes) - num_large)]
    return Link(latency_s=statistics.median(times[size] for size in small), bytes_per_s=1.0 / slope)


def combined(links: Sequence[Link]) -> Link:
    """One Link for a class over its collectives: the mean latency, and the bandwidth of the
    mean time per byte (equal bytes through each collective)."""
    if not links:
        raise ValueError("no links to combine")
    return Link(latency_s=sum(link.latency_s for link in links) / len(links),
                bytes_per_s=len(links) / sum(1.0 / link.bytes_per_s for link in links))


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """A run's timings per link class and collective, and the figures fitted to them."""

    times: dict[str, dict[str, dict[int, float]]]  # class -> collective -> bytes to the peer -> s
    fits: dict[str, dict[str, Link]]  # class -> collective -> Link
    links: dict[str, Link]  # class -> the collectives combined

    @classmethod
    def fitted(cls, times: Mapping[str, Times], num_large: int = NUM_LARGE) -> "Measurement":
        """The fits of timings per class (ValueError where a fit fails, naming the class and collective)."""
        fits: dict[str, dict[str, Link]] = {}
        for link_class, by_collective in times.items():
            for collective, by_size in by_collective.items():
                try:
                    fits.setdefault(link_class, {})[collective] = fit_link(by_size, num_large)
                except ValueError as error:
                    raise ValueError(f"{link_class} {collective}: {error}") from None
        return cls({c: {k: dict(v) for k, v in t.items()} for c, t in times.items()}, fits,
                   {c: combined(list(f.values())) for c, f in fits.items()})

    def overrides_line(self) -> str:
        """The measured keys of --ep-link-costs, "local_latency_us=...,local_gbps=...,...":
        latencies in microseconds, bandwidths in GB/s, four significant digits."""
        parts = []
        for link_class in LINK_CLASSES:
            if link_class in self.links:
                link = self.links[link_class]
                parts += [f"{link_class}_latency_us={link.latency_s * 1e6:.4g}",
                          f"{link_class}_gbps={link.bytes_per_s / 1e9:.4g}"]
        return ",".join(parts)

    def table(self) -> str:
        """Markdown: the time a call per size (us) for each class and collective, then the figures."""
        columns = [(c, k) for c in LINK_CLASSES if c in self.times for k in self.times[c]]
        sizes = sorted({size for c, k in columns for size in self.times[c][k]})
        lines = ["| bytes to the peer | " + " | ".join(f"{c} {k} (us)" for c, k in columns) + " |",
                 "|---:|" + "---:|" * len(columns)]
        for size in sizes:
            cells = [f"{self.times[c][k][size] * 1e6:.1f}" if size in self.times[c][k] else "" for c, k in columns]
            lines.append(f"| {size:,} | " + " | ".join(cells) + " |")
        lines += ["", "| link | collective | latency (us) | bandwidth (GB/s) |", "|---|---|---:|---:|"]
        for link_class in LINK_CLASSES:
            if link_class not in self.links:
                continue
            rows = [*self.fits[link_class].items(), ("combined", self.links[link_class])]
            lines += [f"| {link_class} | {name} | {link.latency_s * 1e6:.1f} | {link.bytes_per_s / 1e9:.3f} |"
                      for name, link in rows]
        return "\n".join(lines)

    def as_json(self) -> dict:
        """The measurement as plain data (sizes as strings: JSON keys)."""
        def link(value: Link) -> dict:
            return {"latency_us": value.latency_s * 1e6, "gbps": value.bytes_per_s / 1e9}
        return {"times_us": {c: {k: {str(s): t * 1e6 for s, t in v.items()} for k, v in by.items()}
                             for c, by in self.times.items()},
                "fits": {c: {k: link(v) for k, v in f.items()} for c, f in self.fits.items()},
                "links": {c: link(v) for c, v in self.links.items()},
                "ep_link_costs": self.overrides_line()}
