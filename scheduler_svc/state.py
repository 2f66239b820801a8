"""The leader's loop: membership and failure reports in, group assignments out.

While this replica holds a term it watches `/members` (the experts and
gateways: PLANNED_ROLES) and `/failures`, and on
every change (and every `_TICK_S` while a broken group waits for a member)
reads one consistent snapshot, runs the planner and writes the result in one
transaction fenced on its term. A rejected write means a newer leader exists:
the loop raises LeadershipLost and the election steps down.

When each broken group was first seen broken is kept here, in memory: a new
leader starts those clocks again, so a failover can at most delay the deletion
of a group that waits for a member (reform_wait_s) by one wait.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time

from scheduler_svc.election import Leadership, LeadershipLost
from scheduler_svc.planner import REFORM_SETTLE_S, REFORM_WAIT_S, RepairPolicy, plan_groups
from services import telemetry
from services.cluster import ClusterClient, Member

log = logging.getLogger(__name__)

# How often the plan is made again while a broken group waits (its deadlines are time-based).
_TICK_S = 0.25
# The roles whose members the plan is made of (plan_groups reads no others).
PLANNED_ROLES = ("expert", "gateway")
_UNSEEN = object()


@dataclasses.dataclass(slots=True)
class RepairState:
    """The leader's repair settings and its clock of the broken groups."""

    reform_wait_s: float = REFORM_WAIT_S
    reform_settle_s: float = REFORM_SETTLE_S
    # Group id -> when this leader first saw it broken (time.monotonic()).
    waiting_since: dict[str, float] = dataclasses.field(default_factory=dict)
    # The plan's refusals last logged: each is logged once, not on every reconcile.
    refusals: tuple[str, ...] = ()


@telemetry.traced("scheduler.reconcile")
async def reconcile_once(client: ClusterClient, term: int, group_size: int,
                         repair: RepairState | None = None) -> bool:
    """Plans from the current state and writes the plan; False if nothing to do.

    Raises LeadershipLost if the write was fenced off.
    """
    repair = repair if repair is not None else RepairState()
    snapshot, failed = await client.snapshot_with_failures()
    policy = RepairPolicy(now=time.monotonic(), reform_wait_s=repair.reform_wait_s,
                          reform_settle_s=repair.reform_settle_s, waiting_since=repair.waiting_since)
    plan = plan_groups(snapshot.members, snapshot.groups, group_size=group_size, term=term,
                       failed=failed, key_epochs=set(snapshot.ready) | failed, repair=policy)
    for group_id in plan.waiting_since.keys() - repair.waiting_since.keys():
        log.warning("term %d: group %s is broken (a rank left or reported a failure); re-forming it", term,
                    group_id)
    repair.waiting_since = plan.waiting_since
    if plan.unplaceable_ids:
        log.warning("experts without a rendezvous_port cannot be placed: %s", plan.unplaceable_ids)
    for refusal in set(plan.refusals) - set(repair.refusals):
        log.error("term %d: %s", term, refusal)
    repair.refusals = tuple(plan.refusals)
    if plan.is_empty:
        return False
    if not await client.write_groups(term, plan.put, plan.delete, plan.stale_epochs):
        raise LeadershipLost(f"write of term {term} rejected: a newer leader exists")
    for group in plan.put:
        ranks = ", ".join(f"{r.rank}={r.member_id}" for r in group.ranks)
        log.info("term %d wrote group %s epoch %d [%s] gateway %s rendezvous %s", term,
                 group.group_id, group.epoch, ranks, group.gateway_id, group.rendezvous_address)
    for group_id in plan.delete:
        log.info("term %d deleted group %s (a rank left and nothing replaced it in time)", term, group_id)
    return True


def planned_members(members: list[Member]) -> list[Member]:
    """The members a plan depends on: a scheduler or a router that comes or
    goes (the old leader leaving after a graceful handover, among them)
    costs the leader no read and no plan."""
    return [m for m in members if m.role in PLANNED_ROLES]


async def lead_groups(client: ClusterClient, leadership: Leadership, group_size: int,
                      repair: RepairState | None = None) -> None:
    """Reconciles the groups on every change of the planned members or the
    failure reports, until cancelled."""
    repair = repair if repair is not None else RepairState()
    changed = asyncio.Event()

    async def follow(watch, relevant=lambda state: state) -> None:
        last = _UNSEEN
        async with contextlib.aclosing(watch) as changes:
            async for state in changes:
                if relevant(state) != last:
                    last = relevant(state)
                    changed.set()

    watches = [asyncio.create_task(follow(client.watch_members(), planned_members), name="watch-members"),
               asyncio.create_task(follow(client.watch_failures()), name="watch-failures")]
    try:
        while True:
            waiter = asyncio.create_task(changed.wait())
            done, _ = await asyncio.wait([waiter, *watches], timeout=_TICK_S if repair.waiting_since else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for task in watches:
                if task in done:
                    task.result()  # raises what the watch raised
                    return  # a watch ends only with the client
            changed.clear()
            await reconcile_once(client, leadership.term, group_size, repair)
    finally:
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
