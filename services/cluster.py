"""ClusterClient: a process's view of the mesh's control-plane state in etcd.

Every process registers itself under one lease (its session) and keeps it
alive in the background; closing the client revokes the lease, so peers see
the departure at once instead of after the TTL. The key layout and JSON
values are those of docs/internals.md ("etcd layout"); `Keys` is the only
place that spells them.

etcd being unreachable is survivable: one-shot calls retry with backoff for
up to `retry_s` and then raise ClusterUnavailableError; the keepalive and
the watches retry until close(). A session is declared lost (its `lost`
event is set: a scheduler leader steps down on it) at the first keepalive
that fails, since the lease may then expire before the next one gets
through. The keepalive goes on refreshing the same lease: once etcd answers
that it is alive (an etcd restart keeps leases and restarts their TTLs), a
new session on that lease replaces the lost one and the member's keys never
left; only if etcd says the lease is gone is a new one granted and the
member key put again. So an etcd blip costs no process its membership.

Watches yield a state only when it changes: a watch that breaks and is
re-established (an etcd restart) reads the state again and yields nothing
if it is unchanged. The group watch also ignores (and logs) a record of a
group that carries an older leader term than one already seen for that
group: no deposed leader's assignment is ever acted on.

Nothing here waits on etcd without a deadline, and no cancellation is lost:
every etcd call runs in a task of its own that the caller waits for with
asyncio.wait (at most `call_timeout_s` plus a grace; a call that misses it
is cancelled and abandoned, and counts as etcd being unreachable). Never
asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as
the awaited call completes (CPython gh-86296), which once left the
keepalive running after close() had cancelled it, and close() waiting for
it forever. Each watch is a gRPC stream of its own, cancelled
synchronously, rather than aetcd's shared Watcher (whose locks and bounded
request queue can block cancel and close for good). close() finishes in
bounded time even if etcd never answers.

    client = ClusterClient("127.0.0.1:2379")
    await client.connect()
    await client.register("expert", "e0", "10.0.0.5:50051", {"rendezvous_port": 29500})
    async for group in client.watch_group_for_member("e0"):
        ...  # a GroupAssignment, or None once the member has lost its group
    await client.close()
"""

import asyncio
import collections.abc
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import aetcd
import grpc
from aetcd import rpc as etcd_rpc
from aetcd import utils as etcd_utils

from services import metrics, telemetry

log = logging.getLogger(__name__)

ROLES = ("scheduler", "gateway", "expert", "router")
# Errors that mean "etcd did not answer": retried, never fatal in loops.
_UNREACHABLE = (
    aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, asyncio.TimeoutError, OSError,
)
_ETCD_ERRORS = (aetcd.ClientError, grpc.RpcError, *_UNREACHABLE)
# Reconnect quickly after an etcd restart; the gRPC default backs off to 120 s.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
}
# How long past the gRPC deadline (call_timeout_s) a call may take before it
# is abandoned: the gRPC deadline should fire first and give a proper error.
_DEADLINE_GRACE_S = 1.0
# close(): how long the keepalive may take to stop, and abandoned calls to end.
_CLOSE_TASKS_S = 2.0
_UNSET = object()
_STALE = object()  # a group record older than the newest seen for its group
T = TypeVar("T")


class ClusterUnavailableError(ConnectionError):
    """etcd did not answer within the client's retry budget (or the client is closed)."""


class _WatchEnded(ConnectionError):
    """A watch stream ended or was cancelled by etcd: read again and re-watch."""


async def cancel_and_wait(tasks: collections.abc.Iterable[asyncio.Task | None], timeout_s: float = 5.0,
                          *, what: str = "tasks") -> bool:
    """Cancels the tasks and waits until all have ended, but for at most
    timeout_s. A task still running after a grace of a second is cancelled
    again every half second (a cancellation can be lost, see the module
    docstring). Returns False, logging the stragglers, if some still run."""
    loop = asyncio.get_running_loop()
    tasks = [t for t in tasks if t is not None]
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    wait_s = 1.0
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.error("%s still running %.1fs after being cancelled: %s", what, timeout_s,
                      ", ".join(t.get_name() for t in pending))
            return False
        _, pending = await asyncio.wait(pending, timeout=min(wait_s, remaining))
        wait_s = 0.5
    for task in tasks:  # their outcome is the caller's to inspect; never "never retrieved"
        if not task.cancelled():
            task.exception()
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """A registered process: `/members/<role>/<member_id>`."""

    member_id: str
    role: str
    address: str  # its gRPC address, host:port
    info: dict = dataclasses.field(default_factory=dict)  # role-specific, e.g. rendezvous_port

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
    """The scheduler leader: `/leader`. The term is the key's create revision."""

    member_id: str
    address: str
    term: int
    elected_at: float  # Unix time in seconds
    lease_id: int = 0  # the leader's lease: a follower that finds it dead may revoke it


@dataclasses.dataclass(frozen=True, slots=True)
class PendingHandover:
    """`/handover`: a leader stopping gracefully is handing its term's end to
    the follower member_id (ClusterClient.handover); /leader is absent meanwhile."""

    member_id: str
    from_term: int
    revision: int  # the marker's mod revision
    lease_id: int  # the follower's lease: the marker goes with the follower
    address: str  # the follower's


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
        self.handover = self.root + "handover"
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
                    leader = _leader_from_kv(kv)
                elif key.startswith(self.members):
                    value = json.loads(kv.value)
                    members.append(Member(value["member_id"], value["role"], value["address"],
                                          value.get("info") or {}))
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


def _leader_from_kv(kv) -> LeaderInfo:
    value = json.loads(kv.value)
    return LeaderInfo(value["member_id"], value["address"], kv.create_revision,
                      float(value["elected_at"]), kv.lease)


def _leader_value(member_id: str, address: str) -> bytes:
    return json.dumps({"member_id": member_id, "address": address, "elected_at": time.time()}).encode()


def _handover_from_kv(kv) -> PendingHandover:
    value = json.loads(kv.value)
    return PendingHandover(value["member_id"], int(value["from_term"]), kv.mod_revision, kv.lease,
                           value["address"])


def _raise_unless_lease_gone(error: Exception, session: "Session") -> None:
    """A write under session's lease failed: if because etcd no longer has the
    lease (revoked or expired before the keepalive noticed), marks the session
    lost (the keepalive then registers anew) and returns; else re-raises."""
    if "lease not found" not in str(error):
        raise error
    log.warning("lease %x is gone (%s); waiting for a new session", session.lease_id, error)
    session.lost.set()


def _leader_after(events: list) -> LeaderInfo | None:
    """The leader after a watch response's events on /leader (the last one counts)."""
    event = events[-1]
    return None if event.type == etcd_rpc.Event.DELETE else _leader_from_kv(event.kv)


async def _on_stream(stream: grpc.aio.StreamStreamCall, operation: Awaitable[T]) -> T:
    """Awaits a read or write of stream. gRPC raises CancelledError when the
    call was cancelled under us (its channel closed): that is _WatchEnded,
    not a cancellation of this task, which is re-raised as is."""
    try:
        return await operation
    except asyncio.CancelledError:
        if stream.cancelled() and not asyncio.current_task().cancelling():
            raise _WatchEnded("watch stream cancelled (channel closed)") from None
        raise


def _checked_watch_response(response):
    """A WatchResponse; raises _WatchEnded if the stream ended or etcd cancelled the watch."""
    if response is grpc.aio.EOF:
        raise _WatchEnded("watch stream ended")
    if response.canceled or response.compact_revision:
        raise _WatchEnded(f"watch cancelled by etcd (compact revision {response.compact_revision}): "
                          f"{response.cancel_reason!r}")
    return response


class _GroupTerms:
    """The newest term seen per group id by one member's group watch."""

    def __init__(self, member_id: str):
        self.member_id = member_id
        self._latest: dict[str, int] = {}
        self._warned: set[tuple[str, int]] = set()

    def current(self, groups: collections.abc.Iterable[GroupAssignment]) -> Any:
        """The member's group in `groups` (None if it has none), or _STALE if
        its only record there is stale."""
        mine = [g for g in groups if g.has_member(self.member_id)]
        fresh = []
        for group in mine:
            latest = self._latest.get(group.group_id, 0)
            if group.term >= latest:
                fresh.append(group)
                self._latest[group.group_id] = group.term
            elif (group.group_id, group.term) not in self._warned:
                self._warned.add((group.group_id, group.term))
                log.warning("ignoring a stale record of group %s for %s: written in term %d, but term %d "
                            "was already seen for it", group.group_id, self.member_id, group.term, latest)
        if fresh:
            return fresh[0]
        return _STALE if mine else None


@dataclasses.dataclass(slots=True)
class Session:
    """One lease of this process, for as long as its keepalive vouches for it.

    `lost` is set at the first refresh that fails, or once etcd says the
    lease is gone, and is never cleared: a lease that turns out alive goes
    on in a new Session with the same lease_id (see the module docstring)."""

    lease_id: int
    ttl: int
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # When the last successful refresh was sent (time.monotonic()).
    last_renewed: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True, slots=True)
class _Registration:
    role: str
    member_id: str
    address: str
    info: dict
    ttl: int


@contextlib.asynccontextmanager
async def registered(endpoint: str, role: str, member_id: str, address: str, *, info: dict | None = None,
                     ttl: int = 2, prefix: str = "/moemesh") -> AsyncIterator["ClusterClient"]:
    """A client connected (waiting for etcd as long as it takes) and registered
    for the life of the block; leaving it revokes the lease."""
    client = ClusterClient(endpoint, prefix=prefix)
    try:
        await client.connect(wait_s=None)
        await client.register(role, member_id, address, info, ttl=ttl)
        yield client
    finally:
        await client.close()


class ClusterClient:
    """The mesh's etcd client; one per process. See the module docstring."""

    def __init__(self, endpoint: str, *, prefix: str = "/moemesh",
                 call_timeout_s: float = 2.0, retry_s: float = 10.0):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
        self.endpoint = endpoint
        self.keys = Keys(prefix)
        self._etcd = aetcd.Client(host=host, port=int(port), timeout=call_timeout_s,
                                  options=_CHANNEL_OPTIONS)
        self._call_timeout_s = call_timeout_s
        self._retry_s = retry_s
        self._abandoned: set[asyncio.Task] = set()  # calls past their deadline, cancelled
        self._registration: _Registration | None = None
        self._session: Session | None = None
        self._session_changed = asyncio.Condition()
        self._keepalive_task: asyncio.Task | None = None
        self._closed = False

    # ---- lifecycle ----------------------------------------------------

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def connect(self, wait_s: float | None = 30.0) -> None:
        """Waits until etcd answers (None: forever); ClusterUnavailableError after wait_s."""
        await self._retry("connect", self._etcd.connect, budget_s=wait_s)
        await self._retry("connect", self._etcd.status, budget_s=wait_s)
        log.info("connected to etcd at %s", self.endpoint)

    @telemetry.traced("etcd.register")
    async def register(self, role: str, member_id: str, address: str,
                       info: dict | None = None, ttl: int = 2) -> None:
        """Puts /members/<role>/<member_id> under a new lease kept alive in the background."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if self._registration is not None:
            raise RuntimeError(f"already registered as {self._registration.member_id!r}")
        self._registration = _Registration(role, member_id, address, dict(info or {}), ttl)
        await self._new_session()
        self._keepalive_task = asyncio.create_task(self._keepalive(), name=f"keepalive-{member_id}")

    @property
    def session(self) -> Session | None:
        """The current session (None before register); check `session.lost`."""
        return self._session

    async def live_session(self) -> Session:
        """The current session once it is not lost (waits until etcd confirms the
        lease again, or a new one is registered). Raises ClusterUnavailableError
        once the client is closed."""
        async with self._session_changed:
            await self._session_changed.wait_for(
                lambda: self._closed or (self._session is not None and not self._session.lost.is_set()))
            if self._closed:
                raise ClusterUnavailableError(f"etcd at {self.endpoint}: client closed")
            return self._session

    async def close(self) -> None:
        """Revokes the lease first (peers see us leave, and a leader's term ends,
        at once), then stops the keepalive and closes the channel. Takes a few
        seconds at most, even if etcd does not answer."""
        if self._closed:
            return
        self._closed = True  # from here on the keepalive neither refreshes nor registers again
        session = self._session
        if session is not None:
            session.lost.set()
            await self.revoke_lease(session.lease_id)
        async with self._session_changed:
            self._session_changed.notify_all()  # live_session() waiters raise
        await cancel_and_wait([self._keepalive_task], _CLOSE_TASKS_S, what="keepalive")
        if self._session is not session:  # registered again meanwhile: that lease goes too
            self._session.lost.set()
            await self.revoke_lease(self._session.lease_id)
        await cancel_and_wait(list(self._abandoned), _CLOSE_TASKS_S, what="abandoned etcd calls")
        try:
            await self._call("close", self._etcd.close)
        except _ETCD_ERRORS as error:
            log.warning("closing the etcd client failed (%r); closing its channel", error)
            channel = self._etcd.channel
            if channel is not None:
                with contextlib.suppress(*_ETCD_ERRORS):
                    await self._call("close", channel.close, 0)

    async def __aenter__(self) -> "ClusterClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # ---- reads ----------------------------------------------------------

    async def snapshot(self) -> ClusterSnapshot:
        """Everything under the prefix, read at one revision."""
        result = await self._retry("snapshot", self._etcd.get_prefix, self.keys.root.encode())
        return self.keys.parse(result.header.revision, result)

    async def list_members(self, role: str | None = None) -> list[Member]:
        prefix = self.keys.members + (f"{role}/" if role else "")
        return (await self._read_prefix(prefix))[1].members

    async def list_groups(self) -> list[GroupAssignment]:
        return (await self._read_prefix(self.keys.groups))[1].groups

    async def get_group(self, group_id: str) -> GroupAssignment | None:
        got = await self._retry("get_group", self._etcd.get, self.keys.group(group_id).encode())
        return None if got is None else GroupAssignment.from_json(got.value)

    async def get_leader(self) -> LeaderInfo | None:
        return (await self._read_leader())[1]

    async def ready_ranks(self, group_id: str, epoch: int) -> set[int]:
        """Ranks whose ready key for (group_id, epoch) exists."""
        snapshot = (await self._read_prefix(self.keys.ready_dir(group_id, epoch)))[1]
        return set(snapshot.ready.get((group_id, epoch), {}))

    # ---- watches --------------------------------------------------------

    async def watch_members(self) -> AsyncIterator[list[Member]]:
        """The member list now and after each change."""
        async with contextlib.aclosing(self._watch_state(
                self.keys.members, lambda: self._read_prefix(self.keys.members), key=lambda s: s.members)) as states:
            async for members in states:
                yield members

    async def watch_leader(self) -> AsyncIterator[LeaderInfo | None]:
        """The leader now and after each change (None while there is none)."""
        async with contextlib.aclosing(self._watch_state(self.keys.leader, self._read_leader, is_prefix=False,
                                                         from_events=_leader_after)) as states:
            async for leader in states:
                yield leader

    async def watch_group_for_member(self, member_id: str) -> AsyncIterator[GroupAssignment | None]:
        """The group holding member_id (as a rank or as the gateway): now if it
        has one, then on every change; None once it has lost its group.

        A record of a group whose term is older than one this watch has
        already seen for that group id is stale (a deposed leader's, or etcd
        restored from an old backup): it is logged and ignored, as if that
        change had not happened. Expert services and gateways follow their
        assignment through this watch, so none of them acts on one."""
        terms = _GroupTerms(member_id)
        last = _UNSET
        async with contextlib.aclosing(self._watch_state(
                self.keys.groups, lambda: self._read_prefix(self.keys.groups), key=lambda s: s.groups)) as states:
            async for groups in states:
                group = terms.current(groups)
                if group is _STALE or group == last:
                    continue
                if group is not None or last is not _UNSET:
                    yield group
                last = group

    async def watch_ready(self, group_id: str, epoch: int) -> AsyncIterator[set[int]]:
        """The ready ranks of (group_id, epoch) now and after each change."""
        prefix = self.keys.ready_dir(group_id, epoch)
        async with contextlib.aclosing(self._watch_state(
                prefix, lambda: self._read_prefix(prefix),
                key=lambda s: set(s.ready.get((group_id, epoch), {})))) as states:
            async for ready in states:
                yield ready

    async def wait_group_ready(self, group: GroupAssignment) -> None:
        """Returns once every rank of the group has marked itself ready."""
        async with contextlib.aclosing(self.watch_ready(group.group_id, group.epoch)) as states:
            async for ready in states:
                if ready >= set(range(group.world_size)):
                    return

    # ---- writes ---------------------------------------------------------

    @telemetry.traced("etcd.mark_rank_ready")
    async def mark_rank_ready(self, group_id: str, epoch: int, rank: int, member_id: str) -> bool:
        """Puts /ready/<group>/<epoch>/<rank> under this member's lease, only
        while that exact assignment (epoch, rank -> member_id) is current.
        Returns False if it is not (the group moved on; nothing written)."""
        group_key = self.keys.group(group_id).encode()
        value = json.dumps({"member_id": member_id}).encode()
        while True:
            session = await self.live_session()
            got = await self._retry("mark_rank_ready", self._etcd.get, group_key)
            group = None if got is None else GroupAssignment.from_json(got.value)
            if group is None or group.epoch != epoch or group.rank_of(member_id) != rank:
                return False
            try:
                is_written, _ = await self._retry(
                    "mark_rank_ready", self._etcd.transaction,
                    compare=[self._etcd.transactions.mod(group_key) == got.mod_revision],
                    success=[self._etcd.transactions.put(
                        self.keys.ready(group_id, epoch, rank).encode(), value, lease=session.lease_id)],
                    failure=[],
                )
            except aetcd.ClientError as error:
                _raise_unless_lease_gone(error, session)
                continue  # under the next session's lease
            if is_written:
                return True  # else the group key changed under us: check it again

    @telemetry.traced("etcd.campaign")
    async def campaign(self, member_id: str, address: str) -> "LeaderInfo | PendingHandover":
        """One election attempt: creates /leader under this session's lease if
        absent and no handover is pending. Returns the leader after the attempt;
        we won iff its lease_id is our session's (true also when an earlier
        attempt's reply was lost). A handover pending to this session is
        completed here (we win); one pending to another replica is returned:
        wait for it, or cancel_handover() it once it has taken too long."""
        session = await self.live_session()
        key, handover_key = self.keys.leader.encode(), self.keys.handover.encode()
        txn = self._etcd.transactions
        try:
            is_won, responses = await self._retry(
                "campaign", self._etcd.transaction,
                compare=[txn.create(key) == 0, txn.version(handover_key) == 0],
                success=[txn.put(key, _leader_value(member_id, address), lease=session.lease_id), txn.get(key)],
                failure=[txn.get(key), txn.get(handover_key)],
            )
        except aetcd.ClientError as error:
            _raise_unless_lease_gone(error, session)
            raise ClusterUnavailableError(f"etcd at {self.endpoint}: campaign: our lease is gone") from error
        leaders = responses[-1] if is_won else responses[0]
        if leaders:
            return _leader_from_kv(leaders[0][1])
        (_, kv), = responses[1]
        pending = _handover_from_kv(kv)
        if pending.lease_id != session.lease_id:
            return pending
        return await self._complete_handover(pending) or pending

    @telemetry.traced("etcd.handover")
    async def handover(self, term: int, from_member_id: str) -> LeaderInfo | None:
        """A leader's graceful stop: ends its term and makes another live
        scheduler member (the first by member id) the leader, under that
        member's lease, without an election.

        etcd refuses a delete and a put of one key in one transaction, and the
        new term must be a new create revision of /leader; so: one transaction
        fenced on create_revision(/leader) == term and on the follower's member
        key being unchanged deletes /leader and puts the `/handover` marker
        naming the follower (under its lease: it goes if the follower does),
        then a second creates /leader for the follower while that marker is
        current. Campaigns do not win while a marker exists (the named
        follower completes it itself if this process dies in between).
        Returns the new leader, None if the handover did not happen (term
        over, no follower: the caller resigns as usual)."""
        leader_key, handover_key = self.keys.leader.encode(), self.keys.handover.encode()
        prefix = self.keys.member("scheduler", "").encode()
        members = await self._retry("handover", self._etcd.get_prefix, prefix)
        txn = self._etcd.transactions
        for kv in sorted(members, key=lambda kv: kv.key):
            member_id = kv.key[len(prefix):].decode()
            if member_id == from_member_id or not kv.lease:
                continue
            address = json.loads(kv.value)["address"]
            marker = json.dumps({"member_id": member_id, "address": address, "from_term": term}).encode()
            is_started, responses = await self._retry(
                "handover", self._etcd.transaction,
                compare=[txn.create(leader_key) == term, txn.mod(kv.key) == kv.mod_revision],
                success=[txn.delete(leader_key), txn.put(handover_key, marker, lease=kv.lease),
                         txn.get(handover_key)],
                failure=[txn.get(leader_key)])
            if is_started:
                return await self._complete_handover(_handover_from_kv(responses[-1][0][1]))
            if not responses[-1] or responses[-1][0][1].create_revision != term:
                return None  # our term is over
        return None

    async def _complete_handover(self, pending: PendingHandover) -> LeaderInfo | None:
        """Creates /leader for the follower a still current marker names and
        deletes the marker; None if the marker is gone (another completed or
        cancelled it, or the follower's lease ended)."""
        leader_key, handover_key = self.keys.leader.encode(), self.keys.handover.encode()
        txn = self._etcd.transactions
        is_done, responses = await self._retry(
            "handover", self._etcd.transaction,
            compare=[txn.create(leader_key) == 0, txn.mod(handover_key) == pending.revision],
            success=[txn.put(leader_key, _leader_value(pending.member_id, pending.address), lease=pending.lease_id),
                     txn.delete(handover_key), txn.get(leader_key)],
            failure=[txn.get(leader_key)])
        leader = _leader_from_kv(responses[-1][0][1]) if responses[-1] else None
        if is_done:
            log.info("term %d handed over to %s (term %d)", pending.from_term, pending.member_id, leader.term)
        return leader if leader is not None and leader.lease_id == pending.lease_id else None

    async def cancel_handover(self, pending: PendingHandover) -> None:
        """Deletes a handover marker that is still the one seen (its follower
        never took the term): campaigns can win again."""
        key = self.keys.handover.encode()
        txn = self._etcd.transactions
        await self._retry("cancel_handover", self._etcd.transaction, compare=[txn.mod(key) == pending.revision],
                          success=[txn.delete(key)], failure=[])

    @telemetry.traced("etcd.resign")
    async def resign(self, term: int) -> None:
        """Deletes /leader if it is still the one created at `term`."""
        key = self.keys.leader.encode()
        txn = self._etcd.transactions
        await self._retry("resign", self._etcd.transaction, compare=[txn.create(key) == term],
                          success=[txn.delete(key)], failure=[])

    @telemetry.traced("etcd.write_groups")
    async def write_groups(self, term: int, put: collections.abc.Sequence[GroupAssignment] = (),
                           delete: collections.abc.Sequence[str] = (),
                           stale_epochs: collections.abc.Sequence[tuple[str, int]] = ()) -> bool:
        """Puts and deletes groups in one transaction fenced on
        create_revision(/leader) == term; a deleted group's ready and failure
        keys go with it, and so do those of each (group_id, epoch) in
        stale_epochs. Returns False (nothing written) if the term is no longer current."""
        leader_key = self.keys.leader.encode()
        txn = self._etcd.transactions
        ops = [txn.put(self.keys.group(g.group_id).encode(), g.to_json()) for g in put]
        prefixes = [p for i in delete for p in (self.keys.ready_dir(i), self.keys.failure_dir(i))]
        prefixes += [p for i, e in stale_epochs for p in (self.keys.ready_dir(i, e), self.keys.failure_dir(i, e))]
        ops += [txn.delete(self.keys.group(group_id).encode()) for group_id in delete]
        ops += [txn.delete(p.encode(), range_end=etcd_utils.prefix_range_end(p.encode())) for p in prefixes]
        is_written, _ = await self._retry("write_groups", self._etcd.transaction,
                                          compare=[txn.create(leader_key) == term], success=ops, failure=[])
        return is_written

    async def depose_member(self, role: str, member_id: str, address: str) -> bool:
        """Revokes the lease of a member found dead (its address refuses
        connections), so that its key goes now rather than after the TTL; only
        if its member key still holds that address (a restarted process
        registered anew elsewhere is left alone). One attempt of each call.
        Returns True if the lease was revoked by this call."""
        try:
            got = await self._call("depose", self._etcd.get, self.keys.member(role, member_id).encode())
            if got is None or not got.lease or json.loads(got.value).get("address") != address:
                return False
            await self._call("depose", self._etcd.revoke_lease, got.lease)
            log.warning("revoked the lease of %s %s at %s", role, member_id, address)
        except _ETCD_ERRORS as error:
            log.info("did not depose %s %s: %r", role, member_id, error)
            return False
        return True

    async def depose_leader(self, leader: LeaderInfo) -> bool:
        """Revokes the lease of a leader found dead, so that its term ends now,
        but only if etcd answers us and `/leader` still holds that term under
        that lease: a follower cut off from etcd, or one that saw an old
        leader, deposes nobody. One attempt of each call, each bounded by the
        call deadline. Returns True if the lease was revoked by this call."""
        try:
            got = await self._call("depose", self._etcd.get, self.keys.leader.encode())
            if got is None or (got.create_revision, got.lease) != (leader.term, leader.lease_id):
                log.info("not deposing leader %s (term %d): /leader has changed", leader.member_id, leader.term)
                return False
            await self._call("depose", self._etcd.revoke_lease, leader.lease_id)
            log.warning("revoked the lease of leader %s (term %d)", leader.member_id, leader.term)
        except _ETCD_ERRORS as error:  # etcd unreachable, or another follower revoked it first
            log.info("did not depose leader %s (term %d): %r", leader.member_id, leader.term, error)
            return False
        return True

    async def revoke_lease(self, lease_id: int) -> None:
        """Revokes a lease (ours on close, or a dead leader's); absent leases are
        fine. One attempt, bounded by the call deadline; failures are logged."""
        try:
            await self._call("revoke_lease", self._etcd.revoke_lease, lease_id)
        except _ETCD_ERRORS as error:
            log.warning("could not revoke lease %x: %r", lease_id, error)

    # ---- internals ------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., Awaitable[T]], *args,
                    timeout_s: float | None = None, **kwargs) -> T:
        """Awaits fn(*args, **kwargs), run as a task of its own, for at most
        timeout_s (default: the call deadline plus a grace). Past it the task is
        cancelled and abandoned and TimeoutError (etcd unreachable) is raised.
        If the caller is cancelled it is at once: whatever the callee does with
        its own cancellation cannot keep the caller waiting or swallow it."""
        if timeout_s is None:
            timeout_s = self._call_timeout_s + _DEADLINE_GRACE_S
        task = asyncio.get_running_loop().create_task(fn(*args, **kwargs), name=f"etcd-{what}")
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except BaseException:
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError(f"{what}: no answer within {timeout_s:.2f}s")
        if task.cancelled():  # not by us: e.g. its channel was closed under it
            raise TimeoutError(f"{what}: call cancelled")
        return task.result()

    def _abandon(self, task: asyncio.Task) -> None:
        """Cancels a call nobody waits for any more; close() waits for the stragglers."""
        task.cancel()
        if not task.done():
            self._abandoned.add(task)
            task.add_done_callback(self._forget_abandoned)

    def _forget_abandoned(self, task: asyncio.Task) -> None:
        self._abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("abandoned etcd call %s failed: %r", task.get_name(), task.exception())

    async def _retry(self, what: str, fn: Callable[..., Awaitable[T]], *args,
                     budget_s: float | None = _UNSET, **kwargs) -> T:
        """Calls fn (each attempt under the call deadline), retrying while etcd
        is unreachable, for up to budget_s (None: until close())."""
        budget_s = self._retry_s if budget_s is _UNSET else budget_s
        loop = asyncio.get_running_loop()
        deadline = None if budget_s is None else loop.time() + budget_s
        delay = 0.05
        while True:
            if self._closed:
                raise ClusterUnavailableError(f"etcd at {self.endpoint}: {what}: client closed")
            try:
                return await self._call(what, fn, *args, **kwargs)
            except _UNREACHABLE as error:
                metrics.count_etcd_error(what)
                if self._closed or (deadline is not None and loop.time() + delay > deadline):
                    raise ClusterUnavailableError(f"etcd at {self.endpoint}: {what}: {error!r}") from error
                log.warning("etcd at %s unreachable (%s: %r); retrying in %.2fs",
                            self.endpoint, what, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _read_prefix(self, prefix: str) -> tuple[int, ClusterSnapshot]:
        result = await self._retry("read", self._etcd.get_prefix, prefix.encode())
        return result.header.revision, self.keys.parse(result.header.revision, result)

    async def _read_leader(self) -> tuple[int, LeaderInfo | None]:
        revision, snapshot = await self._read_prefix(self.keys.leader)
        return revision, snapshot.leader

    async def _watch_state(self, watch_key: str, read: Callable[[], Awaitable[tuple[int, Any]]], *,
                           is_prefix: bool = True, key: Callable[[Any], Any] = lambda s: s,
                           from_events: Callable[[list], Any] | None = None) -> AsyncIterator[Any]:
        """Yields key(state) now and whenever it changes, state being read()
        again after each event on watch_key (or, given from_events, the state
        that the events of one response leave: one round trip less); survives
        etcd outages until close(), then ends. Closing it (or cancelling its
        consumer) cancels the watch at once."""
        watch_bytes = watch_key.encode()
        range_end = etcd_utils.prefix_range_end(watch_bytes) if is_prefix else b""
        last = _UNSET
        delay = 0.05
        while not self._closed:
            stream = None
            try:
                revision, state = await read()
                if key(state) != last:
                    last = key(state)
                    yield last
                stream = await self._open_watch(watch_bytes, range_end, revision + 1)
                while True:
                    response = _checked_watch_response(await _on_stream(stream, stream.read()))
                    if not response.events:
                        continue  # a progress notification
                    state = from_events(response.events) if from_events else (await read())[1]
                    delay = 0.05
                    if key(state) != last:
                        last = key(state)
                        yield last
            except (*_ETCD_ERRORS, ClusterUnavailableError) as error:
                if self._closed:
                    return
                metrics.count_etcd_error("watch")
                log.warning("watch on %s failed (%r); retrying in %.2fs", watch_key, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            finally:
                if stream is not None:
                    stream.cancel()  # synchronous: cannot block, even during cancellation

    async def _open_watch(self, key: bytes, range_end: bytes, start_revision: int) -> grpc.aio.StreamStreamCall:
        """A Watch stream of its own on [key, range_end) from start_revision,
        once etcd has confirmed it (within the call deadline)."""
        channel = self._etcd.channel
        if self._closed or channel is None:
            raise ClusterUnavailableError(f"etcd at {self.endpoint}: watch: client closed")
        stream = etcd_rpc.WatchStub(channel).Watch(metadata=self._etcd.metadata)
        create = etcd_rpc.WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision)
        try:
            async with asyncio.timeout(self._call_timeout_s):
                await _on_stream(stream, stream.write(etcd_rpc.WatchRequest(create_request=create)))
                response = _checked_watch_response(await _on_stream(stream, stream.read()))
            if not response.created:
                raise _WatchEnded(f"watch on {key!r}: expected a created response, got {response}")
        except asyncio.InvalidStateError as error:  # the stream finished before the write
            stream.cancel()
            raise _WatchEnded(f"watch on {key!r}: stream finished: {error}") from error
        except BaseException:
            stream.cancel()
            raise
        return stream

    async def _new_session(self) -> None:
        """Grants a lease and registers the member key under it (retries until it works)."""
        reg = self._registration
        lease = await self._retry("lease", self._etcd.lease, reg.ttl, budget_s=None)
        value = json.dumps({"member_id": reg.member_id, "role": reg.role,
                            "address": reg.address, "info": reg.info}).encode()
        await self._retry("register", self._etcd.put, self.keys.member(reg.role, reg.member_id).encode(),
                          value, lease=lease.id, budget_s=None)
        await self._publish_session(Session(lease.id, reg.ttl))
        log.info("registered %s %s at %s (lease %x, ttl %ds)", reg.role, reg.member_id,
                 reg.address, lease.id, reg.ttl)

    async def _keepalive(self) -> None:
        """Refreshes the lease every ttl/3. A failed refresh marks the session
        lost at once and is retried with backoff; see the module docstring."""
        delay = 0.05
        while not self._closed:
            session = self._session
            interval = session.ttl / 3
            sent = time.monotonic()
            try:
                reply = await self._call("keepalive", self._etcd.refresh_lease, session.lease_id,
                                         timeout_s=interval)
                if reply is None:
                    raise ConnectionError("the keepalive stream ended without a reply")
            except _ETCD_ERRORS as error:
                metrics.count_etcd_error("keepalive")
                # Warn once per outage; the retries that follow log at debug.
                log.log(logging.DEBUG if session.lost.is_set() else logging.WARNING,
                        "keepalive of lease %x failed: %r; session lost until etcd confirms the lease",
                        session.lease_id, error)
                session.lost.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, interval)
                continue
            if self._closed:  # close() revokes the lease and sets lost itself
                return
            delay = 0.05
            if reply.TTL <= 0:
                log.warning("lease %x expired; registering again", session.lease_id)
                session.lost.set()
                await self._replace_session()
                continue
            if session.lost.is_set():
                await self._publish_session(Session(session.lease_id, session.ttl, last_renewed=sent))
                log.info("lease %x confirmed alive again: session resumed", session.lease_id)
            else:
                session.last_renewed = sent
            await asyncio.sleep(max(0.0, sent + interval - time.monotonic()))

    async def _publish_session(self, session: Session) -> None:
        async with self._session_changed:
            self._session = session
            self._session_changed.notify_all()

    async def _replace_session(self) -> None:
        """Registers again under a new lease (the old one is gone), until it works."""
        delay = 0.05
        while not self._closed:
            try:
                await self._new_session()
                return
            except (*_ETCD_ERRORS, ClusterUnavailableError) as error:
                if self._closed:
                    return
                log.warning("re-registration failed: %r; retrying in %.2fs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    @telemetry.traced("etcd.report_rank_failure")
    async def report_rank_failure(self, group_id: str, epoch: int, rank: int, member_id: str,
                                  reason: str) -> None:
        """Puts /failures/<group>/<epoch>/<rank>: this rank's group failed under it (a
        collective timed out or errored) and the rank is about to exit. Written
        without a lease, so it survives the rank; retried like every one-shot call."""
        value = json.dumps({"group_id": group_id, "epoch": epoch, "rank": rank, "member_id": member_id,
                            "reason": reason, "reported_at": time.time()}).encode()
        await self._retry("report_rank_failure", self._etcd.put,
                          self.keys.failure(group_id, epoch, rank).encode(), value)

    async def snapshot_with_failures(self) -> tuple[ClusterSnapshot, set[tuple[str, int]]]:
        """snapshot(), and the (group_id, epoch) that have a failure report, read at the same revision."""
        result = await self._retry("snapshot", self._etcd.get_prefix, self.keys.root.encode())
        prefix = self.keys.failure_dir()
        failed = set()
        for kv in result:
            key = kv.key.decode()
            if key.startswith(prefix):
                with contextlib.suppress(ValueError):
                    group_id, epoch, _rank = key[len(prefix):].split("/")
                    failed.add((group_id, int(epoch)))
        return self.keys.parse(result.header.revision, result), failed

    async def watch_failures(self) -> AsyncIterator[set[str]]:
        """The keys of the failure reports now and after each change."""
        prefix = self.keys.failure_dir()

        async def read() -> tuple[int, set[str]]:
            result = await self._retry("read", self._etcd.get_prefix, prefix.encode())
            return result.header.revision, {kv.key.decode() for kv in result}

        async with contextlib.aclosing(self._watch_state(prefix, read)) as states:
            async for keys in states:
                yield keys
