"""The leader's side of expert placements: commit a proposed placement as the group's next epoch.

The router proposes (router_svc/autoscaler.py); only the replica holding
`/leader` commits, in a transaction fenced on its term and on the group's
current placement epoch (services/placement_store.py), so a proposal that
reaches a deposed leader, carries an old term, or was computed against an
older placement writes nothing. No gRPC here: the servicer maps the errors.
"""

import logging

from services.cluster import ClusterClient
from services.placement import Placement
from services.placement_store import LeaderTermError, PlacementStore, StaleProposalError

log = logging.getLogger(__name__)

__all__ = ["LeaderTermError", "NotLeaderError", "StaleProposalError", "commit_proposal"]


class NotLeaderError(Exception):
    """This replica does not hold the leader key."""


async def commit_proposal(client: ClusterClient, replica_id: str, group_id: str, expected_epoch: int,
                          term: int, placement: Placement) -> tuple[Placement, int]:
    """Commits `placement` for the group as epoch expected_epoch + 1; returns
    (the committed placement, the term that wrote it).

    term 0 takes the current leader's. Raises NotLeaderError (this replica
    is not the leader), LeaderTermError (term is not the leader's current
    one), StaleProposalError (the group is no longer at expected_epoch) and
    ValueError (no such group, or the placement does not fit it).
    """
    leader = await client.get_leader()
    if leader is None or leader.member_id != replica_id:
        holder = "nobody" if leader is None else leader.member_id
        raise NotLeaderError(f"{replica_id} is not the leader ({holder} is)")
    if term and term != leader.term:
        raise LeaderTermError(f"the proposal is for term {term}, the leader's term is {leader.term}")
    group = await client.get_group(group_id)
    if group is None:
        raise ValueError(f"no group {group_id!r}")
    if placement.num_ranks != group.world_size:
        raise ValueError(f"the placement is for {placement.num_ranks} ranks, group {group_id!r} has "
                         f"{group.world_size}")
    committed = await PlacementStore(client).commit(leader.term, group_id, expected_epoch, placement)
    log.info("term %d committed placement epoch %d of group %s: %s", leader.term, committed.epoch, group_id,
             {layer: spares for layer, spares in sorted(committed.layers.items())})
    return committed, leader.term
