"""Which exchange design an expert-parallel step takes: a small cost model of the bytes and latencies.

Two designs move a step's MoE rows between the N ranks of a group (both give
the same sums, see moe_dispatch.py):

- gather: every rank gathers every rank's B rows and the fp32 partials come
  back by a reduce-scatter (kernels/moe_ep.py on CUDA; moe_dispatch's
  `everywhere` form in torch). Two ring collectives, no host sync, a few kernels.
- alltoall: the deduplicated all-to-all (moe_dispatch.dispatch/combine): a
  token's row goes once to each rank holding one of its experts. At a fixed
  capacity (decode, CUDA graphs) every peer still gets B rows, padding
  included; with host splits (bigger steps) exactly the rows, at the price of
  one more small all-to-all and a device sync a layer.

Bytes. A token of K experts over N ranks reaches a given rank with
probability p = 1 - (1 - s)^K, s the rank's share of the copies (1/N when
routing is uniform, or measured from hit counts), so it reaches sum_r p_r
ranks: N * (1 - (1 - 1/N)^K) when uniform. The rows delivered to other ranks
(the group's total) are then (N - 1) * B per rank for gather and (N - 1) * p
* T for the all-to-all: gather delivers 1 / p times the bytes (1.5x at N = 8,
K = 8; 2.5x at N = 16). What a link carries is another thing:
NCCL's ring gather and reduce-scatter cross each host boundary once per ring
and spread their rings over the host's R NICs, so a rank's NIC carries
(N - 1) * B / R rows, while the all-to-all sends each (token, remote rank)
pair over the sender's own NIC: (N - R) * p * T rows. But every rank of the
gather receives every row, so its local link (NVLink) carries (N - 1) * B
rows whatever the hosts, against (R - 1) * p * T for the all-to-all. At 2
hosts of 8 GPUs the rings' NVLink bytes are the busiest link (the all-to-all
wins big steps), at 4 hosts of 2 their NIC bytes are fewer than the
all-to-all's (the gather wins), with one rank per host (or CPU processes, one
per machine) the all-to-all's fewer rows win. The model counts both link
classes and the busiest one sets the time.

Time of a design at T tokens per rank (B = T rows) = per collective the
latency of the slowest link class it crosses (local: NVLink or loopback
between ranks of one host; network: between hosts) + the busiest link's
bytes over its bandwidth + the design's fixed per-layer overhead (the
all-to-all's torch ops around the collectives, and with host splits a device
sync). The smaller time wins; ties go to gather (the measured path). The
constants (LinkCosts) are figures measured on H200 pairs and on a CPU machine
(loopback, and a bridge between network namespaces), estimates elsewhere (the
CUDA network, the overheads); `--ep-link-costs` overrides any of them, and
`moemesh measure-links` (moemesh/link_probe.py) measures a deployment's links
and prints the string.

plan.py turns this into a group's design per step size (--ep-dispatch).
Pure Python, no torch: the expert's config checks --ep-link-costs with it.
"""

import dataclasses
import math
from collections.abc import Sequence

DESIGNS = ("gather", "alltoall")
SETTINGS = ("auto", *DESIGNS)


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One link class: a collective's latency over it, and a rank's bandwidth on it (one direction)."""

    latency_s: float
    bytes_per_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class LinkCosts:
    """The cost model's constants, per link class and per design."""

    local: Link  # between ranks of one host (NVLink on CUDA, loopback on the CPU)
    network: Link  # between hosts (a rank's NIC)
    # Per layer: the all-to-all design's torch ops around its collectives, beyond the
    # gather's few kernels (route, pack, unpack, sort, combine: about fifty small ops).
    alltoall_overhead_s: float
    # Per layer, host splits only: the device sync that brings the split sizes to the host.
    host_sync_s: float

    # The keys of --ep-link-costs, and the field each one sets (microseconds, GB/s).
    KEYS = ("local_latency_us", "local_gbps", "network_latency_us", "network_gbps", "overhead_us", "sync_us")

    @classmethod
    def for_device(cls, device_type: str, overrides: str = "") -> "LinkCosts":
        """The defaults of `device_type` ("cuda" or "cpu"), with `overrides` applied
        ("key=value,...", keys of KEYS; ValueError quoting a bad one)."""
        if device_type == "cuda":
            # NVLink: NCCL between two H200s, measured. Network: one 400 Gb/s NIC per GPU
            # (InfiniBand or RoCE) and NCCL's latency across hosts, estimates; the overheads too.
            # Where each figure comes from: docs/performance.md, "The exchange's link costs".
            costs = cls(Link(18e-6, 118e9), Link(25e-6, 45e9), alltoall_overhead_s=50e-6, host_sync_s=30e-6)
        elif device_type == "cpu":
            # gloo measured by `moemesh measure-links`: local over loopback, network across a bridge
            # between network namespaces (how the many-hosts tests run hosts; a physical network is
            # slower, so deployments measure theirs). The overhead is an estimate. Figures and
            # command: docs/performance.md, "The exchange's link costs".
            costs = cls(Link(292e-6, 1.01e9), Link(389e-6, 0.748e9), alltoall_overhead_s=200e-6, host_sync_s=0.0)
        else:
            raise ValueError(f"no link costs for device type {device_type!r}")
        return costs.with_overrides(overrides)

    def with_overrides(self, text: str) -> "LinkCosts":
        """These costs with "key=value,..." applied (KEYS: latencies and overheads in
        microseconds, bandwidths in GB/s)."""
        values = parse_overrides(text)

        def pick(key: str, current: float, unit: float) -> float:
            return values[key] / unit if key in values else current
        us, per_gb = 1e6, 1e-9  # a microsecond is 1 / us seconds, a GB/s 1 / per_gb bytes a second
        return LinkCosts(
            Link(pick("local_latency_us", self.local.latency_s, us),
                 pick("local_gbps", self.local.bytes_per_s, per_gb)),
            Link(pick("network_latency_us", self.network.latency_s, us),
                 pick("network_gbps", self.network.bytes_per_s, per_gb)),
            alltoall_overhead_s=pick("overhead_us", self.alltoall_overhead_s, us),
            host_sync_s=pick("sync_us", self.host_sync_s, us))


def parse_overrides(text: str) -> dict[str, float]:
    """--ep-link-costs as {key: value}: "key=value,..." with keys of LinkCosts.KEYS,
    bandwidths positive, the rest >= 0 (ValueError quoting the bad part)."""
    values = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in LinkCosts.KEYS:
            raise ValueError(f"ep_link_costs: {part!r} is not key=value with a key of {LinkCosts.KEYS}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"ep_link_costs: {part!r} has no number after '='") from None
        if not math.isfinite(value) or value < 0 or (key.endswith("gbps") and value == 0):
            raise ValueError(f"ep_link_costs: {part!r} must be finite, >= 0 (a bandwidth > 0)")
        values[key] = value
    return values


@dataclasses.dataclass(frozen=True, slots=True)
class RowShape:
    """What one exchanged row carries: moe_dispatch's packed row out, an fp32 partial back."""

    hidden: int  # D
    top_k: int  # K
    itemsize: int  # bytes of the model dtype

    @property
    def row_bytes(self) -> int:
        """A packed row: the hidden row, then K int32 ids and K fp32 weights."""
        return self.hidden * self.itemsize + 8 * self.top_k

    @property
    def partial_bytes(self) -> int:
        """A partial sum coming back: fp32."""
        return 4 * self.hidden

    @property
    def round_trip_bytes(self) -> int:
        return self.row_bytes + self.partial_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """Which host each rank of the group runs on, in rank order."""

    hosts: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("a topology needs at least one rank")

    @property
    def num_ranks(self) -> int:
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    def ranks_per_host(self) -> tuple[int, ...]:
        """How many ranks each host holds (hosts in order of first appearance)."""
        return tuple(self.hosts.count(h) for h in dict.fromkeys(self.hosts))

    def describe(self) -> str:
        counts = self.ranks_per_host()
        shape = f"{counts[0]} per host" if len(set(counts)) == 1 else f"{'+'.join(map(str, counts))} per host"
        return f"{self.num_ranks} ranks on {self.num_hosts} host{'s' * (self.num_hosts > 1)} ({shape})"


def hit_probabilities(num_ranks: int, top_k: int, rank_shares: Sequence[float] | None = None) -> list[float]:
    """Per rank, the probability that a token's K experts include one of the rank's: 1 - (1 - s)^K
    with s the rank's share of the routed copies (uniform: 1/N)."""
    shares = rank_shares if rank_shares is not None else [1.0 / num_ranks] * num_ranks
    if len(shares) != num_ranks:
        raise ValueError(f"{len(shares)} rank shares for {num_ranks} ranks")
    return [1.0 - (1.0 - min(max(s, 0.0), 1.0)) ** top_k for s in shares]


def expected_ranks_per_token(num_ranks: int, top_k: int, rank_shares: Sequence[float] | None = None) -> float:
    """The distinct ranks a token's K experts live on, expected: N * (1 - (1 - 1/N)^K) when uniform."""
    return sum(hit_probabilities(num_ranks, top_k, rank_shares))


def rank_shares(hit_counts: Sequence[float], num_ranks: int) -> list[float]:
    """Each rank's share of the routed copies from per-expert hit counts (experts split evenly,
    expert e on rank e // (E / N)); uniform when nothing was counted."""
    if len(hit_counts) % num_ranks:
        raise ValueError(f"{len(hit_counts)} experts do not split evenly over {num_ranks} ranks")
    per_rank = len(hit_counts) // num_ranks
    totals = [float(sum(hit_counts[r * per_rank:(r + 1) * per_rank])) for r in range(num_ranks)]
    whole = sum(totals)
    return [t / whole for t in totals] if whole > 0 else [1.0 / num_ranks] * num_ranks


@dataclasses.dataclass(frozen=True, slots=True)
class StepCost:
    """One design's modelled cost of one MoE layer at a step size."""

    design: str
    is_fixed: bool  # fixed capacity (padded, no host sync) rather than host splits
    local_bytes: float  # what the busiest rank's local link carries, both messages
    network_bytes: float  # what the busiest rank's NIC carries
    num_collectives: int
    seconds: float


def delivered_bytes(design: str, tokens_per_rank: int, shape: RowShape, num_ranks: int,
                    rank_shares: Sequence[float] | None = None) -> float:
    """The bytes the whole group delivers to ranks other than the sender in one MoE layer
    (rows out, partials back), exact sizes: the volume the issue compares, whatever the links."""
    p = sum(hit_probabilities(num_ranks, shape.top_k, rank_shares)) / num_ranks
    per_token = (num_ranks - 1) * (1.0 if design == "gather" else p)
    return num_ranks * tokens_per_rank * per_token * shape.round_trip_bytes


def step_cost(design: str, tokens_per_rank: int, shape: RowShape, topology: Topology, costs: LinkCosts, *,
              is_fixed: bool, rank_shares: Sequence[float] | None = None) -> StepCost:
    """The modelled cost of one MoE layer of `design` at T = tokens_per_rank (rows per rank B = T),
    for the busiest rank (the one on the host with the most ranks)."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    n, t, rt = topology.num_ranks, tokens_per_rank, shape.round_trip_bytes
    r = max(topology.ranks_per_host())
    is_multi_host = topology.num_hosts > 1
    if design == "gather":  # two rings; across hosts their R channels share the host's R NICs
        local = (n - 1) * t * rt if r > 1 else 0.0
        network = (n - 1) * t * rt / r if is_multi_host else 0.0
        collectives, overhead = 2, 0.0
    else:
        p = max(hit_probabilities(n, shape.top_k, rank_shares))
        rows = t if is_fixed else p * t  # per peer: padded to the bucket, or exactly the hits
        local, network = (r - 1) * rows * rt, (n - r) * rows * rt
        collectives = 2 if is_fixed else 3
        overhead = costs.alltoall_overhead_s + (0.0 if is_fixed else costs.host_sync_s)
    latency = costs.network.latency_s if is_multi_host else costs.local.latency_s
    if n == 1:
        latency = 0.0
    wire = max(local / costs.local.bytes_per_s, network / costs.network.bytes_per_s)
    return StepCost(design, is_fixed, local, network, collectives, collectives * latency + wire + overhead)


def choose(tokens_per_rank: int, shape: RowShape, topology: Topology, costs: LinkCosts, *, is_fixed: bool,
           rank_shares: Sequence[float] | None = None) -> StepCost:
    """The cheaper design at this step size (gather on a tie)."""
    gather, alltoall = (step_cost(d, tokens_per_rank, shape, topology, costs, is_fixed=is_fixed,
                                  rank_shares=rank_shares) for d in DESIGNS)
    return alltoall if alltoall.seconds < gather.seconds else gather

