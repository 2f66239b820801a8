"""Group formation: a pure function from (members, groups) to the writes.

The rules (docs/internals.md, "Group formation"), applied in this order:

1. A group one of whose ranks is no longer registered (or is registered at
   another address: it restarted) is deleted. Its gateway stops driving it,
   and its surviving experts and gateway become free for a new group once
   enough experts are back. Re-forming a group in place (a new placement
   epoch) is a later issue.
2. A group whose gateway is no longer registered keeps its ranks and loses
   its gateway (the ranks stay loaded; the placement epoch is unchanged).
3. Free gateways, by member id, go to the groups without one, by group id.
4. While at least group_size free experts and a free gateway remain: a new
   group of the first group_size free experts by member id, ranks 0..N-1,
   epoch 1, the rendezvous at rank 0's host and its `rendezvous_port`, and
   the first free gateway. Group ids are "g<k>" with the lowest k not in use
   (a deleted group's id is free again in the next plan: its ready keys are
   deleted with it, and a rank marks itself ready only while its exact
   assignment is current, so a reused id cannot inherit stale readiness).

Experts that do not advertise an integer `rendezvous_port` in their info
cannot be placed; they are listed in `Plan.unplaceable_ids`.
Groups that do not change are not rewritten, so their `term` stays the term
of the leader that last wrote them.
"""

import dataclasses
import itertools
from collections.abc import Sequence

from services.cluster import GroupAssignment, Member, RankInfo


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The writes that bring the groups in line with the members."""

    put: list[GroupAssignment]  # new or changed groups, by group id
    delete: list[str]  # group ids
    unplaceable_ids: list[str]  # experts without a rendezvous_port

    @property
    def is_empty(self) -> bool:
        return not self.put and not self.delete


def plan_groups(
    members: Sequence[Member], groups: Sequence[GroupAssignment], *, group_size: int, term: int
) -> Plan:
    """The groups to write and delete so that `groups` follows the rules above."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    experts = {m.member_id: m for m in members if m.role == "expert"}
    gateways = {m.member_id for m in members if m.role == "gateway"}

    deleted = [g.group_id for g in groups if not _ranks_present(g, experts)]
    kept = {g.group_id: g for g in groups if g.group_id not in deleted}
    changed: dict[str, GroupAssignment] = {}
    for group in kept.values():
        if group.gateway_id is not None and group.gateway_id not in gateways:
            changed[group.group_id] = dataclasses.replace(group, gateway_id=None, term=term)
    current = {**kept, **changed}

    busy_gateways = {g.gateway_id for g in current.values() if g.gateway_id is not None}
    free_gateways = sorted(gateways - busy_gateways)
    for group_id in sorted(current):
        if current[group_id].gateway_id is None and free_gateways:
            changed[group_id] = dataclasses.replace(
                current[group_id], gateway_id=free_gateways.pop(0), term=term
            )

    placed = {r.member_id for g in current.values() for r in g.ranks}
    unplaceable = sorted(i for i, m in experts.items() if _rendezvous_port(m) is None)
    free_experts = sorted(set(experts) - placed - set(unplaceable))
    ids_in_use = {g.group_id for g in groups}
    new_ids = (f"g{k}" for k in itertools.count() if f"g{k}" not in ids_in_use)
    while len(free_experts) >= group_size and free_gateways:
        chosen = [experts[i] for i in free_experts[:group_size]]
        del free_experts[:group_size]
        group = _new_group(next(new_ids), chosen, free_gateways.pop(0), term)
        changed[group.group_id] = group
    return Plan(
        put=[changed[i] for i in sorted(changed)], delete=sorted(deleted), unplaceable_ids=unplaceable
    )


def _ranks_present(group: GroupAssignment, experts: dict[str, Member]) -> bool:
    """True if every rank is registered, at the address it was placed with."""
    return all(
        r.member_id in experts and experts[r.member_id].address == r.address for r in group.ranks
    )


def _rendezvous_port(member: Member) -> int | None:
    port = member.info.get("rendezvous_port")
    return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None


def _new_group(group_id: str, experts: list[Member], gateway_id: str, term: int) -> GroupAssignment:
    rank0 = experts[0]
    return GroupAssignment(
        group_id=group_id,
        epoch=1,
        term=term,
        world_size=len(experts),
        rendezvous_address=f"{rank0.host}:{_rendezvous_port(rank0)}",
        ranks=[RankInfo(rank, m.member_id, m.address) for rank, m in enumerate(experts)],
        gateway_id=gateway_id,
    )
