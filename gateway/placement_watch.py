"""When the ranks of a group switch expert placements: the gateway's half.

A new placement epoch (services/placement_store.py) is staged by every rank
in the background; once every rank has marked itself ready for it, the
engine stamps it on every plan from the next step on
(`Engine.expert_placement_epoch` -> StepPlan.expert_placement_epoch), and
each rank installs it before running that step. All ranks get the same
step's plans, so they switch at the same step boundary; requests keep
flowing. A newer epoch that is ready supersedes an older one.
"""

import asyncio
import contextlib
import logging

from services.cluster import ClusterClient, ClusterUnavailableError, GroupAssignment, cancel_and_wait
from services.placement_store import PlacementStore

log = logging.getLogger("gateway.placement")


def ready_epoch(current: int, latest: int, ready: dict[int, set[int]], world_size: int) -> int:
    """The epoch to stamp: `latest` (the committed one) once every rank is ready for it, else current."""
    if latest > current and ready.get(latest, set()) >= set(range(world_size)):
        return latest
    return current


async def _update(store: PlacementStore, group: GroupAssignment, engine, ready: dict[int, set[int]]) -> None:
    try:
        placement = await store.get(group.group_id)
    except ClusterUnavailableError as error:  # the next change of the ready marks tries again
        log.warning("cannot read the expert placement of group %s: %r", group.group_id, error)
        return
    if placement is None:
        return
    epoch = ready_epoch(engine.expert_placement_epoch, placement.epoch, ready, group.world_size)
    if epoch != engine.expert_placement_epoch:
        log.info("every rank of group %s staged expert placement epoch %d: switching at the next step",
                 group.group_id, epoch)
        engine.expert_placement_epoch = epoch


async def _follow(store: PlacementStore, group: GroupAssignment, engine) -> None:
    async for ready in store.watch_ready(group.group_id):
        await _update(store, group, engine, ready)


@contextlib.asynccontextmanager
async def following(cluster: ClusterClient, group: GroupAssignment, engine):
    """For the life of the block, stamps the engine's plans with the group's ready placement epoch.
    A cluster view that is not a ClusterClient (the unit tests' fakes) has no placements."""
    if not isinstance(cluster, ClusterClient):
        yield
        return
    store, task = PlacementStore(cluster), None
    try:
        # Before the first plan: ranks that kept their weights across a re-formed group or a
        # new gateway stream already run the ready epoch; stamping 0 first would undo it.
        with contextlib.suppress(ClusterUnavailableError):  # the watch reads it again
            await _update(store, group, engine, await store.ready(group.group_id))
        task = asyncio.create_task(_follow(store, group, engine), name=f"placement-{group.group_id}")
        yield
    finally:
        await cancel_and_wait([task], what="the placement watch")
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.warning("placement watch of group %s ended: %r", group.group_id, task.exception())
