"""The leader's loop: membership in, group assignments out.

While this replica holds a term it watches `/members`, and on every change
reads one consistent snapshot, runs the planner and writes the result in
one transaction fenced on its term. A rejected write means a newer leader
exists: the loop raises LeadershipLost and the election steps down.
"""

import contextlib
import logging

from scheduler_svc.election import Leadership, LeadershipLost
from scheduler_svc.planner import plan_groups
from services import telemetry
from services.cluster import ClusterClient

log = logging.getLogger(__name__)


@telemetry.traced("scheduler.reconcile")
async def reconcile_once(client: ClusterClient, term: int, group_size: int) -> bool:
    """Plans from the current state and writes the plan; False if nothing to do.

    Raises LeadershipLost if the write was fenced off.
    """
    snapshot = await client.snapshot()
    plan = plan_groups(snapshot.members, snapshot.groups, group_size=group_size, term=term)
    if plan.unplaceable_ids:
        log.warning("experts without a rendezvous_port cannot be placed: %s", plan.unplaceable_ids)
    if plan.is_empty:
        return False
    if not await client.write_groups(term, plan.put, plan.delete):
        raise LeadershipLost(f"write of term {term} rejected: a newer leader exists")
    for group in plan.put:
        ranks = ", ".join(f"{r.rank}={r.member_id}" for r in group.ranks)
        log.info("term %d wrote group %s epoch %d [%s] gateway %s rendezvous %s", term,
                 group.group_id, group.epoch, ranks, group.gateway_id, group.rendezvous_address)
    for group_id in plan.delete:
        log.info("term %d deleted group %s (a rank left)", term, group_id)
    return True


async def lead_groups(client: ClusterClient, leadership: Leadership, group_size: int) -> None:
    """Reconciles the groups on every membership change until cancelled."""
    async with contextlib.aclosing(client.watch_members()) as changes:
        async for _members in changes:
            await reconcile_once(client, leadership.term, group_size)
