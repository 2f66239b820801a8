"""The control-plane records in etcd and the key layout that holds them.

Pure data: no etcd calls here. The layout and JSON values are those of
docs/internals.md ("etcd layout"); `Keys` is the only place that spells the
keys. The leader's term is the mod revision of `/leader`: a campaign
creates the key and a graceful handover rebinds it to the heir's lease in
one put, and either gives it a revision larger than every earlier one.
"""

import collections.abc
import dataclasses
import json
import logging
import time

log = logging.getLogger(__name__)

ROLES = ("scheduler", "gateway", "expert", "router")


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """A registered process: `/members/<role>/<member_id>`."""

    member_id: str
    role: str
    address: str  # its gRPC address, host:port
    info: dict = dataclasses.field(default_factory=dict)  # role-specific, e.g. rendezvous_port
    lease_id: int = 0  # the member's session lease (0 in records made outside etcd)
    revision: int = 0  # the mod revision of the member key: one registration under that lease

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]


@dataclasses.dataclass(frozen=True, slots=True)
class RankInfo:
    """One expert service's place in a group."""

    rank: int
    member_id: str
    address: str


@dataclasses.dataclass(frozen=True, slots=True)
class GroupAssignment:
    """A worker group: `/groups/<group_id>`, written by the leader."""

    group_id: str
    epoch: int  # placement epoch: 1 when formed, bumped by placement changes
    term: int  # the leader term that wrote it
    world_size: int
    rendezvous_address: str  # rank 0's host and rendezvous_port
    ranks: list[RankInfo]  # by rank
    gateway_id: str | None = None  # None while no gateway is assigned

    def rank_of(self, member_id: str) -> int | None:
        """The rank of an expert member in this group, None if it has none."""
        return next((r.rank for r in self.ranks if r.member_id == member_id), None)

    def has_member(self, member_id: str) -> bool:
        """True if member_id is one of the ranks or the gateway."""
        return member_id == self.gateway_id or self.rank_of(member_id) is not None

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "GroupAssignment":
        value = json.loads(raw)
        ranks = [RankInfo(int(r["rank"]), r["member_id"], r["address"]) for r in value["ranks"]]
        return cls(
            group_id=value["group_id"], epoch=int(value["epoch"]), term=int(value["term"]),
            world_size=int(value["world_size"]), rendezvous_address=value["rendezvous_address"],
            ranks=sorted(ranks, key=lambda r: r.rank), gateway_id=value.get("gateway_id") or None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderInfo:
    """The scheduler leader: `/leader`. The term is the key's mod revision."""

    member_id: str
    address: str
    term: int
    elected_at: float  # Unix time in seconds
    lease_id: int = 0  # the leader's lease: a follower that finds it dead may revoke it


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything under the prefix at one etcd revision."""

    revision: int
    leader: LeaderInfo | None
    members: list[Member]
    groups: list[GroupAssignment]
    # (group_id, epoch) -> rank -> member id of the ready key
    ready: dict[tuple[str, int], dict[int, str]]

    def is_rank_ready(self, group: GroupAssignment, rank: int) -> bool:
        """True if the rank's ready key exists and was written by its member."""
        member_id = self.ready.get((group.group_id, group.epoch), {}).get(rank)
        return member_id is not None and member_id == group.ranks[rank].member_id


class Keys:
    """The etcd key layout of docs/internals.md under a prefix."""

    def __init__(self, prefix: str = "/moemesh"):
        self.root = prefix.rstrip("/") + "/"
        self.leader = self.root + "leader"
        self.members = self.root + "members/"
        self.groups = self.root + "groups/"
        self.ready_root = self.root + "ready/"

    def member(self, role: str, member_id: str) -> str:
        return f"{self.members}{role}/{member_id}"

    def group(self, group_id: str) -> str:
        return self.groups + group_id

    def ready_dir(self, group_id: str, epoch: int | None = None) -> str:
        """The ready keys of a group (all epochs if epoch is None), as a prefix."""
        return f"{self.ready_root}{group_id}/" + ("" if epoch is None else f"{epoch}/")

    def ready(self, group_id: str, epoch: int, rank: int) -> str:
        return f"{self.ready_dir(group_id, epoch)}{rank}"

    def failure(self, group_id: str, epoch: int, rank: int) -> str:
        """A rank's report that its group failed under it (no lease: it outlives the rank)."""
        return f"{self.failure_dir(group_id, epoch)}{rank}"

    def failure_dir(self, group_id: str | None = None, epoch: int | None = None) -> str:
        """The failure reports of all groups, of a group (all epochs), or of one epoch, as a prefix."""
        if group_id is None:
            return f"{self.root}failures/"
        return f"{self.root}failures/{group_id}/" + ("" if epoch is None else f"{epoch}/")

    def parse(self, revision: int, kvs: collections.abc.Iterable) -> ClusterSnapshot:
        """A snapshot from the key-values under the root; bad values are logged and skipped."""
        leader, members, groups, ready = None, [], [], {}
        for kv in kvs:
            key = kv.key.decode()
            try:
                if key == self.leader:
                    leader = leader_from_kv(kv)
                elif key.startswith(self.members):
                    members.append(member_from_kv(kv))
                elif key.startswith(self.groups):
                    groups.append(GroupAssignment.from_json(kv.value))
                elif key.startswith(self.ready_root):
                    group_id, epoch, rank = key[len(self.ready_root):].split("/")
                    ready.setdefault((group_id, int(epoch)), {})[int(rank)] = json.loads(kv.value)["member_id"]
            except (ValueError, KeyError, TypeError) as error:
                log.warning("skipping malformed etcd key %s: %r", key, error)
        members.sort(key=lambda m: (m.role, m.member_id))
        groups.sort(key=lambda g: g.group_id)
        return ClusterSnapshot(revision, leader, members, groups, ready)


def member_from_kv(kv) -> Member:
    value = json.loads(kv.value)
    return Member(value["member_id"], value["role"], value["address"], value.get("info") or {},
                  kv.lease, kv.mod_revision)


def member_value(role: str, member_id: str, address: str, info: dict) -> bytes:
    return json.dumps({"member_id": member_id, "role": role, "address": address, "info": info}).encode()


def leader_from_kv(kv) -> LeaderInfo:
    value = json.loads(kv.value)
    return LeaderInfo(value["member_id"], value["address"], kv.mod_revision, float(value["elected_at"]), kv.lease)


def leader_value(member_id: str, address: str) -> bytes:
    return json.dumps({"member_id": member_id, "address": address, "elected_at": time.time()}).encode()
