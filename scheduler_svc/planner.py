"""Group formation and repair: a pure function from (members, groups, failures) to the writes.

The rules (docs/internals.md, "Group formation" and "Rank failures"),
applied in this order:

1. A group is broken when one of its ranks is no longer registered (or is
   registered at another address: it restarted), or when a rank reported a
   failure of the group's current epoch (`/failures/<group>/<epoch>/<rank>`).
   A broken group is re-formed in place, not deleted: same group id, the
   survivors keep their rank numbers, the gateway stays, `epoch` + 1, and the
   rendezvous at the (possibly new) rank 0's host and its `rendezvous_port`.
   A missing rank is filled by its own member id if that registered again
   (a restarted process, at a new address), else by a standby (a placeable
   expert in no group, the first by member id). If no member can fill it,
   the group waits, unchanged, for up to `reform_wait_s` from when it was
   first seen broken; then it is deleted, and its survivors and gateway are
   free again. A group whose ranks are all registered but that reported a
   failure is re-formed with the same members once it has been broken for
   `reform_settle_s`: long enough for the lease of a rank that died without
   a word to expire first (then rule 1 replaces it directly instead of
   re-forming around a corpse).
2. A group whose gateway is no longer registered keeps its ranks and loses
   its gateway (the ranks stay loaded; the placement epoch is unchanged).
3. Free gateways, by member id, go to the groups without one, by group id.
4. While at least group_size free experts and a free gateway remain: a new
   group of the first group_size free experts by member id that may share a
   group (the same model and group settings, and a group size that divides
   their experts: scheduler_svc/compat.py; the others are refused, with a
   message in `Plan.refusals`, and a standby replaces a rank only if it may
   join the group's survivors), ranks 0..N-1,
   epoch 1, the rendezvous at rank 0's host and its `rendezvous_port`, and
   the first free gateway. Group ids are "g<k>" with the lowest k not in use
   (a deleted group's id is free again in the next plan: its ready and
   failure keys are deleted with it, and a rank marks itself ready only while
   its exact assignment is current, so a reused id cannot inherit stale
   readiness or failures).
5. The ready and failure keys of an epoch older than its group's current one,
   or of a group that no longer exists, are stale and deleted with the plan.

"When first seen broken" is the caller's clock: `waiting_since` in, the
updated map out (`Plan.waiting_since`), so the planner stays a pure function.
Experts that do not advertise an integer `rendezvous_port` in their info
cannot be placed; they are listed in `Plan.unplaceable_ids`.
Groups that do not change are not rewritten, so their `term` stays the term
of the leader that last wrote them.
"""

import dataclasses
import itertools
from collections.abc import Collection, Mapping, Sequence

from scheduler_svc import compat
from services.cluster import GroupAssignment, Member, RankInfo

# Defaults of the scheduler config's reform_wait_s and reform_settle_s.
REFORM_WAIT_S = 30.0
REFORM_SETTLE_S = 3.0


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The writes that bring the groups in line with the members."""

    put: list[GroupAssignment]  # new, changed or re-formed groups, by group id
    delete: list[str]  # group ids
    unplaceable_ids: list[str]  # experts without a rendezvous_port
    # (group_id, epoch) whose ready and failure keys are stale: deleted with the writes.
    stale_epochs: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    # Broken groups not re-formed yet: group id -> when first seen broken (caller's clock).
    waiting_since: dict[str, float] = dataclasses.field(default_factory=dict)
    # Why free experts were not grouped (mismatched settings, a size that does not divide the experts).
    refusals: list[str] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.put and not self.delete and not self.stale_epochs


@dataclasses.dataclass(frozen=True, slots=True)
class RepairPolicy:
    """How long a broken group waits (see the module docstring), and the clock."""

    now: float = 0.0
    reform_wait_s: float = REFORM_WAIT_S
    reform_settle_s: float = REFORM_SETTLE_S
    waiting_since: Mapping[str, float] = dataclasses.field(default_factory=dict)


def plan_groups(
    members: Sequence[Member], groups: Sequence[GroupAssignment], *, group_size: int, term: int,
    failed: Collection[tuple[str, int]] = (), key_epochs: Collection[tuple[str, int]] = (),
    repair: RepairPolicy = RepairPolicy(),
) -> Plan:
    """The groups to write and delete so that `groups` follows the rules above.

    failed: (group_id, epoch) with a failure report; key_epochs: (group_id,
    epoch) that have any ready or failure key (rule 5)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    experts = {m.member_id: m for m in members if m.role == "expert"}
    gateways = {m.member_id for m in members if m.role == "gateway"}
    unplaceable = sorted(i for i, m in experts.items() if _rendezvous_port(m) is None)
    placed = {r.member_id for g in groups for r in g.ranks}
    standbys = sorted(set(experts) - placed - set(unplaceable))

    deleted: list[str] = []
    changed: dict[str, GroupAssignment] = {}
    waiting: dict[str, float] = {}
    for group in sorted(groups, key=lambda g: g.group_id):
        outcome = _repair(group, experts, standbys, (group.group_id, group.epoch) in failed, term, repair)
        if outcome is None:
            continue
        if isinstance(outcome, GroupAssignment):
            changed[group.group_id] = outcome
        elif outcome == "delete":
            deleted.append(group.group_id)
        else:
            waiting[group.group_id] = outcome
    kept = {g.group_id: changed.get(g.group_id, g) for g in groups if g.group_id not in deleted}
    for group in kept.values():
        if group.gateway_id is not None and group.gateway_id not in gateways:
            changed[group.group_id] = dataclasses.replace(group, gateway_id=None, term=term)
    current = {**kept, **changed}

    busy_gateways = {g.gateway_id for g in current.values() if g.gateway_id is not None}
    free_gateways = sorted(gateways - busy_gateways)
    for group_id in sorted(current):
        if current[group_id].gateway_id is None and free_gateways:
            changed[group_id] = current[group_id] = dataclasses.replace(
                current[group_id], gateway_id=free_gateways.pop(0), term=term)

    in_groups = {r.member_id for g in current.values() for r in g.ranks}
    free_experts = sorted(set(experts) - in_groups - set(unplaceable))
    ids_in_use = {g.group_id for g in groups}
    new_ids = (f"g{k}" for k in itertools.count() if f"g{k}" not in ids_in_use)
    sets, refusals = compat.compatible([experts[i] for i in free_experts], group_size)
    for candidates in sets:
        while len(candidates) >= group_size and free_gateways:
            chosen = candidates[:group_size]
            del candidates[:group_size]
            group = _new_group(next(new_ids), chosen, free_gateways.pop(0), term)
            changed[group.group_id] = current[group.group_id] = group
    stale = sorted((gid, epoch) for gid, epoch in key_epochs
                   if gid not in current or epoch < current[gid].epoch)
    return Plan(put=[changed[i] for i in sorted(changed)], delete=sorted(deleted),
                unplaceable_ids=unplaceable, stale_epochs=stale, waiting_since=waiting, refusals=refusals)


def _repair(group: GroupAssignment, experts: dict[str, Member], standbys: list[str], is_failed: bool,
            term: int, repair: RepairPolicy) -> "GroupAssignment | str | float | None":
    """What becomes of one group: None (healthy), its re-formed record, "delete",
    or (still waiting) when it was first seen broken. Takes the standbys it uses."""
    missing = [r for r in group.ranks if not _is_present(r, experts)]
    if not missing and not is_failed:
        return None
    since = repair.waiting_since.get(group.group_id, repair.now)
    if not missing:
        if repair.now - since >= repair.reform_settle_s:
            return _reformed(group, {}, experts, term)
        return since
    replacements: dict[int, Member] = {}
    survivors = [experts[r.member_id] for r in group.ranks if _is_present(r, experts)]
    key = compat.settings_key(survivors[0]) if survivors else None
    available = [s for s in standbys if key is None or compat.settings_key(experts[s]) == key]
    for rank in missing:
        if rank.member_id in experts and _rendezvous_port(experts[rank.member_id]) is not None:
            replacements[rank.rank] = experts[rank.member_id]  # restarted: back at a new address
        elif available:
            replacements[rank.rank] = experts[available.pop(0)]
    if len(replacements) == len(missing):
        used = {m.member_id for m in replacements.values()}
        standbys[:] = [s for s in standbys if s not in used]
        return _reformed(group, replacements, experts, term)
    return "delete" if repair.now - since >= repair.reform_wait_s else since


def _reformed(group: GroupAssignment, replacements: dict[int, Member], experts: dict[str, Member],
              term: int) -> GroupAssignment:
    """The group's next epoch: the survivors keep their ranks, replacements fill the rest."""
    ranks = [RankInfo(r.rank, replacements[r.rank].member_id, replacements[r.rank].address)
             if r.rank in replacements else r for r in group.ranks]
    rank0 = experts[ranks[0].member_id]
    return dataclasses.replace(group, epoch=group.epoch + 1, term=term, ranks=ranks,
                               rendezvous_address=f"{rank0.host}:{_rendezvous_port(rank0)}")


def _is_present(rank: RankInfo, experts: dict[str, Member]) -> bool:
    """True if the rank's member is registered at the address it was placed with."""
    member = experts.get(rank.member_id)
    return member is not None and member.address == rank.address


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
