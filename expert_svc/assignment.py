"""What a rank does when its group assignment changes: join, rejoin the new epoch, wait, or give up.

The lifecycle (expert_svc/server.py) watches this member's assignment in
etcd and asks `next_action` at every change. A rank that has not loaded its
weights joins the first assignment that places it (at its own address: an
earlier process of the same member id may still be listed) and that it has
not tried already. A loaded rank ignores a new leader term or gateway,
rejoins a new epoch of the same group at the same rank and size (keeping
its weights) where it can, and otherwise gives up (AssignmentLostError): the
supervisor restarts it clean.
"""

import enum

from services.cluster import GroupAssignment


class AssignmentLostError(RuntimeError):
    """The group this rank joined was deleted or changed under it (not just re-formed)."""


class Action(enum.Enum):
    """What the rank does with a changed assignment."""

    WAIT = "wait"      # nothing: not placed yet, or the change does not concern the joined rank
    JOIN = "join"      # load the weights and join the group
    REJOIN = "rejoin"  # join the group's new epoch, weights kept


def joined_placement(group: GroupAssignment, member_id: str) -> tuple:
    """What a joined rank depends on; term and gateway changes do not matter."""
    return (group.group_id, group.epoch, group.world_size, group.rendezvous_address,
            group.rank_of(member_id))


def check_group_size(group: GroupAssignment, num_experts: int) -> None:
    """ValueError unless the group's size divides the model's experts (each rank holds an equal share)."""
    if num_experts % group.world_size:
        raise ValueError(f"group {group.group_id!r} has {group.world_size} ranks, which does not divide "
                         f"the model's {num_experts} experts; use a group size that divides it")


def next_action(group: GroupAssignment | None, *, member_id: str, address: str, num_experts: int,
                joined: tuple | None, loaded: tuple | None, can_rejoin: bool) -> Action:
    """The action for the assignment `group` (None: deleted). joined: the joined_placement of the last
    join or rejoin (None before any); loaded: (group_id, rank, world_size) whose weights are loaded (None
    before a join succeeded); can_rejoin: False where a rank cannot leave a process group (CUDA)."""
    rank = None if group is None else group.rank_of(member_id)
    if rank is not None:
        check_group_size(group, num_experts)
    if rank is not None and group.ranks[rank].address != address:
        rank = None  # placed as an earlier process of this member id: not yet re-formed with us
    if loaded is None:
        if rank is not None and joined_placement(group, member_id) != joined:
            return Action.JOIN
        return Action.WAIT
    if group is not None and joined_placement(group, member_id) == joined:
        return Action.WAIT  # a new term or gateway: nothing to do
    if rank is None or (group.group_id, rank, group.world_size) != loaded or not can_rejoin:
        raise AssignmentLostError(f"the assignment {joined} was deleted or changed to {group}")
    return Action.REJOIN
