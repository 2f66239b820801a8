"""The router's scaling loop: windows in, placement proposals to the scheduler leader out.

Every `policy_interval_s` it looks at each group in etcd whose expert
services registered spare slots (member info `num_spare_expert_slots`),
reads the group's committed placement, runs the policy on the hit windows
(router_svc/policy.py) and, if the placement should change, proposes it to
the scheduler leader with the epoch it was computed against and the
leader's term, through a `PlacementProposer` (router_svc/scheduler_client.py
speaks gRPC for it). After a change the group's windows must
fill again before the next scale decision, so one burst of traffic adds one
replica, not three. Errors (no leader yet, a stale epoch, etcd away) are
logged and retried at the next tick.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

from router_svc import policy
from router_svc.config import RouterConfig
from router_svc.windows import SlidingWindows
from services.cluster import ClusterClient, ClusterSnapshot, ClusterUnavailableError, GroupAssignment
from services.placement import Placement
from services.placement_store import PlacementStore

log = logging.getLogger("router_svc.autoscaler")


@dataclasses.dataclass(frozen=True, slots=True)
class Proposal:
    """A placement for a group, computed against its epoch expected_epoch, for the leader of term."""

    group_id: str
    expected_epoch: int
    term: int
    placement: Placement


@dataclasses.dataclass(frozen=True, slots=True)
class Committed:
    """What the leader committed: the group's new placement epoch, and the term that wrote it."""

    epoch: int
    term: int


class ProposalError(Exception):
    """The leader did not commit a proposal (unreachable, not the leader, a stale epoch, ...)."""


class PlacementProposer(Protocol):
    """Sends a proposal to the scheduler leader at an address."""

    async def propose(self, address: str, proposal: Proposal) -> Committed: ...


def spare_slots_of(snapshot: ClusterSnapshot, group: GroupAssignment) -> int:
    """The spare slots per layer every rank of the group registered (0 if any did not)."""
    info = {m.member_id: m.info for m in snapshot.members if m.role == "expert"}
    return min((int(info.get(r.member_id, {}).get("num_spare_expert_slots", 0)) for r in group.ranks), default=0)


class Autoscaler:
    """Runs the scaling policy over every group and proposes placement changes."""

    def __init__(self, config: RouterConfig, windows: SlidingWindows, cluster: ClusterClient,
                 proposer: PlacementProposer, clock: Callable[[], float] = time.monotonic,
                 store: PlacementStore | None = None):
        self._config, self._policy = config, config.policy
        self._windows, self._cluster, self._proposer, self._clock = windows, cluster, proposer, clock
        # Where the groups' committed placements are read (etcd through the cluster client).
        self._store = store or PlacementStore(cluster)
        self._last_change_s: dict[str, float] = {}
        self._last_rebalance_s: dict[str, float] = {}
        # The latest placement read per group (GetExpertStats models rank loads with it).
        self.placements: dict[str, Placement] = {}
        self.num_proposed = 0
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Ticks until stop() (the tick under way finishes) or cancelled."""
        while not self._stopping.is_set():
            try:
                await self.tick()
            except (ClusterUnavailableError, ProposalError) as error:
                log.warning("scaling tick failed: %r; retrying at the next one", error)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.policy_interval_s):
                    await self._stopping.wait()

    def stop(self) -> None:
        """Ends run() after the tick under way (drain: no proposal is cut off)."""
        self._stopping.set()

    async def tick(self) -> None:
        """One look at every group."""
        snapshot = await self._cluster.snapshot()
        for group in snapshot.groups:
            num_spares = spare_slots_of(snapshot, group)
            counts = self._windows.counts(group.group_id, self._config.window_horizon_s, self._clock())
            if not counts:
                continue
            num_experts = len(next(iter(counts.values())))
            current = await self._store.get(group.group_id)
            if current is None:
                current = Placement(num_experts, group.world_size, num_spares)
            self.placements[group.group_id] = current
            if num_spares == 0 or current.num_spare_slots != num_spares or current.num_ranks != group.world_size:
                continue
            proposal = self.decide(group.group_id, current)
            if not proposal.same_slots(current):
                await self._propose(group.group_id, current, proposal)

    def decide(self, group_id: str, current: Placement) -> Placement:
        """The placement the policy wants for a group now (current if none)."""
        cfg, now = self._config, self._clock()
        observed_s = min(self._windows.span_s(group_id, now), now - self._last_change_s.get(group_id, -1e18))

        def window(window_s: float):
            return self._windows.counts(group_id, window_s, now) if observed_s >= window_s else None

        up = window(cfg.scale_up_window_s)
        last_rebalance = self._last_rebalance_s.setdefault(group_id, now)
        if up and cfg.rebalance_interval_s and now - last_rebalance >= cfg.rebalance_interval_s:
            self._last_rebalance_s[group_id] = now
            planned = policy.rebalance(current, up, cfg.max_replicas)
            before, after = policy.max_imbalance(current, up), policy.max_imbalance(planned, up)
            if after < before * (1 - cfg.rebalance_min_gain):
                log.info("group %s: rebalance lowers the max/mean rank load from %.3f to %.3f", group_id,
                         before, after)
                return planned
        return policy.scale(current, up, window(cfg.scale_down_window_s), self._policy)

    async def _propose(self, group_id: str, current: Placement, proposal: Placement) -> None:
        leader = await self._cluster.get_leader()
        if leader is None:
            log.info("group %s: no scheduler leader to propose a placement to", group_id)
            return
        committed = await self._proposer.propose(leader.address, Proposal(group_id, current.epoch, leader.term,
                                                                           proposal))
        self.num_proposed += 1
        self._last_change_s[group_id] = self._clock()
        log.info("group %s: placement epoch %d committed by term %d", group_id, committed.epoch, committed.term)
