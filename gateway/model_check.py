"""Does the assigned group serve the gateway's model? Refuse it if not.

The gateway tokenizes prompts, detokenizes outputs and bounds requests with
its own checkpoint (--model); the ranks run theirs. If the two differ (another
model directory, another vocabulary, hidden size, layer or expert count,
another tokenizer), every step would run and every output would be garbage.
So before it sends a step, the gateway compares its model identity
(services/model_identity.py: hashes of the config and of the tokenizer file,
and the shape for the message) with the one each rank of the group
registered in etcd, in its group settings (the same record the scheduler
compares across ranks, scheduler_svc/compat.py). A rank that registered no
identity (an older version) is not checked.

Pure functions, no I/O: gateway/group.py reads the members and acts on the answer.
"""

from collections.abc import Sequence

from services import model_identity
from services.cluster import GroupAssignment, Member


def rank_identity(member: Member) -> dict:
    """The model identity a rank registered ({} if none)."""
    settings = member.info.get("group_settings")
    if not isinstance(settings, dict):
        return {}
    return {key: settings[key] for key in model_identity.IDENTITY_KEYS if key in settings}


def _differs(gateway: dict, rank: dict) -> bool:
    """True if a hash both registered differs (the shape is only for the message)."""
    return any(key in rank and rank[key] != gateway.get(key) for key in ("model_config", "tokenizer"))


def mismatch(gateway: dict, group: GroupAssignment, members: Sequence[Member]) -> str | None:
    """None if every rank of the group that registered a model identity registered the
    gateway's; else the error, naming the gateway's identity and each differing rank's."""
    by_id = {member.member_id: member for member in members}
    differing = []
    for rank in group.ranks:
        member = by_id.get(rank.member_id)
        identity = {} if member is None else rank_identity(member)
        if identity and _differs(gateway, identity):
            differing.append(f"rank {rank.rank} ({rank.member_id}): {model_identity.describe(identity)}")
    if not differing:
        return None
    return (f"the gateway's model ({model_identity.describe(gateway)}) differs from the model of group "
            f"{group.group_id!r} epoch {group.epoch}: {'; '.join(differing)}. Start the gateway with the "
            f"ranks' checkpoint (--model), or point it at a group that serves its own")
