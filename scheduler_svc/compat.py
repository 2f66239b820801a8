"""Which expert services may share a group: the same model and group settings, and a size that divides the experts.

Each expert service registers, in its member info, `group_settings` (a hash
of its model's config and the flags that must be the same on every rank of
a group: expert_svc/config.py, `ExpertConfig.group_settings`) and
`num_experts`. Ranks whose settings differ would fail in the first
collective, or worse, compute different things without failing; a group size
that does not divide the experts cannot split them evenly. The planner asks
this module which experts it may put together and gets, with the answer,
the refusals to log: each names the members and the values that differ.

Experts that register no settings (older versions) are compatible with each
other only. Pure functions, no I/O.
"""

import json
from collections.abc import Sequence

from services.cluster import Member


def settings_of(member: Member) -> dict:
    """The member's group settings ({} if it registered none)."""
    settings = member.info.get("group_settings")
    return settings if isinstance(settings, dict) else {}


def settings_key(member: Member) -> str:
    """Equal for members that may share a group."""
    return json.dumps(settings_of(member), sort_keys=True)


def difference(a: Member, b: Member) -> str:
    """The settings of a and b that differ, naming both values."""
    sa, sb = settings_of(a), settings_of(b)
    parts = [f"{name} {sa.get(name, '(none)')!r} ({a.member_id}) != {sb.get(name, '(none)')!r} ({b.member_id})"
             for name in sorted(sa.keys() | sb.keys()) if sa.get(name) != sb.get(name)]
    return "; ".join(parts)


def divides(member: Member, group_size: int) -> bool:
    """False if the member's model has a known number of experts that group_size does not divide."""
    num_experts = member.info.get("num_experts")
    return not (isinstance(num_experts, int) and num_experts > 0 and num_experts % group_size)


def compatible(experts: Sequence[Member], group_size: int) -> tuple[list[list[Member]], list[str]]:
    """The experts (in the order given) split into sets that may share a group,
    the set of the first expert first; and the refusals: an expert whose
    model's experts group_size does not divide, and each set whose settings
    differ from the first set's (naming the values)."""
    refusals = []
    sets: dict[str, list[Member]] = {}
    for member in experts:
        if not divides(member, group_size):
            refusals.append(f"expert {member.member_id} cannot join a group: the group size {group_size} does not "
                            f"divide its model's {member.info['num_experts']} experts (--group-size of the "
                            f"schedulers, --ranks of `moemesh up`)")
            continue
        sets.setdefault(settings_key(member), []).append(member)
    ordered = list(sets.values())
    for other in ordered[1:]:
        first = ordered[0][0]
        refusals.append(f"experts {', '.join(m.member_id for m in other)} cannot share a group with "
                        f"{first.member_id}: their model or settings differ: {difference(first, other[0])}")
    return ordered, refusals
