"""Following this gateway's worker group: from an etcd assignment to a running Engine.

`GroupManager.run()` registers the gateway in etcd, watches its group
assignment, and for each assignment: waits until every rank of the group's
epoch is ready, asks each rank for its KV pool (gateway/rank_client.py,
rejecting a rank that runs another group, epoch or rank), opens one step
stream per rank and starts an Engine on them. The gateway is SERVING exactly while that
engine runs.

When the assignment changes (the scheduler re-formed the group after a
rank's failure: same group id, a new epoch) or a stream breaks, health goes
NOT_SERVING but no request fails: the stopped engine is parked, its requests
keep their checkpoints, and new requests still queue in it (bounded by
max_waiting_requests). The next engine that starts, on the re-formed group
or on the same one once its ranks are ready again, adopts them all and
resumes each from its checkpoint (Engine.adopt). If none starts within
`resume_timeout_s` of the failure, the parked requests fail with
UNAVAILABLE. A changed assignment is followed at once; a group that broke
under the same assignment is tried again, with backoff, once all its ranks
are ready again.

Before setting up a group, the gateway checks that its ranks serve its model
(gateway/model_check.py, against what they registered in etcd). A group that
does not is never sent a step: the error naming both models is logged, the
parked requests fail with it, `model_mismatch` holds it (new requests get it
as UNAVAILABLE, readiness reports it), and the check is repeated with
backoff until the assignment changes.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from gateway import model_check, placement_watch
from gateway.engine import Engine, GroupFailure
from gateway.rank_client import GroupConnection, RankCallError, RankStatus, error_text
from services import telemetry
from services.cluster import ClusterClient, GroupAssignment

log = logging.getLogger("gateway.group")

# Backoff between attempts to serve the same group.
_RETRY_MIN_S = 0.5
_RETRY_MAX_S = 10.0

# Builds the engine of a ready group from its rank statuses (by rank) and step streams.
EngineFactory = Callable[[GroupAssignment, Sequence[RankStatus], Sequence], Engine]


class GroupSetupError(Exception):
    """A rank of the assigned group is not what the assignment says."""


def check_rank_info(group: GroupAssignment, rank: int, info: RankStatus) -> None:
    """Raises GroupSetupError unless the rank runs this group, epoch and rank with a KV pool."""
    expected = (group.group_id, group.epoch, rank, group.world_size)
    actual = (info.group_id, info.placement_epoch, info.rank, info.world_size)
    if actual != expected:
        raise GroupSetupError(
            f"rank {rank} ({group.ranks[rank].address}) reports group/epoch/rank/world_size "
            f"{actual}, the assignment says {expected}")
    if not info.is_ready:
        raise GroupSetupError(f"rank {rank} ({group.ranks[rank].address}) is not ready")
    if info.num_kv_blocks <= 0 or info.kv_block_size <= 0:
        raise GroupSetupError(
            f"rank {rank} reports an empty KV pool ({info.num_kv_blocks} blocks of {info.kv_block_size})")


def _same_group(a: GroupAssignment | None, b: GroupAssignment | None) -> bool:
    """Equal for serving: a new leader term rewriting the same group changes nothing."""
    if a is None or b is None:
        return a is b
    return (a.group_id, a.epoch, a.ranks) == (b.group_id, b.epoch, b.ranks)


class GroupManager:
    """Keeps an Engine for this gateway's current worker group while it is ready."""

    def __init__(
        self,
        cluster: ClusterClient,
        *,
        member_id: str,
        address: str,
        make_engine: EngineFactory,
        set_serving: Callable[[bool], Awaitable[None]],
        rank_call_timeout_s: float = 10.0,
        lease_ttl_s: int = 2,
        resume_timeout_s: float = 60.0,
        model_identity: dict | None = None,
    ) -> None:
        self._cluster = cluster
        self._member_id = member_id
        self._address = address
        self._make_engine = make_engine
        self._set_serving = set_serving
        self._rank_call_timeout_s = rank_call_timeout_s
        self._lease_ttl_s = lease_ttl_s
        self._resume_timeout_s = resume_timeout_s
        # The gateway's model identity (services/model_identity.py); None: not checked.
        self._model_identity = model_identity
        # Why the assigned group is refused (its ranks serve another model); None otherwise.
        self.model_mismatch: str | None = None
        # The engine that takes requests: the running one, or the parked one of a
        # failed group whose requests wait for the next engine.
        self._engine: Engine | None = None
        self._group: GroupAssignment | None = None
        self._task: asyncio.Task | None = None
        self._expiry: asyncio.Task | None = None  # fails the parked requests at the resume timeout
        # Metrics of resumption: failures survived, requests resumed, seconds from failure to resume.
        self.num_resumed_groups = 0
        self.num_resumed_requests = 0
        self.resume_seconds: list[float] = []
        self._parked_at: float | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine taking requests: the ready group's, or while a failed group is
        re-formed the parked one (its requests wait); None when there is neither."""
        return self._engine

    @property
    def group(self) -> GroupAssignment | None:
        """The current assignment of this gateway, None while it has none."""
        return self._group

    async def run(self) -> None:
        """Registers the gateway and follows its assignment until cancelled."""
        await self._cluster.register("gateway", self._member_id, self._address, {}, ttl=self._lease_ttl_s)
        try:
            async for group in self._cluster.watch_group_for_member(self._member_id):
                if _same_group(group, self._group):
                    continue
                await self._stop_group(f"the worker group assignment changed to {_describe(group)}")
                self._group = group
                self.model_mismatch = None
                if group is not None:
                    self._task = asyncio.create_task(self._serve(group), name=f"group-{group.group_id}")
        finally:
            await self._stop_group("the gateway is stopping")
            self._fail_parked("the gateway is stopping")

    async def _stop_group(self, reason: str) -> None:
        """Stops serving the current group; its engine's requests stay parked."""
        task, self._task = self._task, None
        if task is not None:
            log.info("stopping %s: %s", _describe(self._group), reason)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _park(self, engine: Engine, name: str) -> None:
        """The engine stopped: keep it taking (queueing) requests until the next
        engine adopts them, or the resume timeout fails them."""
        if self._engine is not engine:
            return
        if self._expiry is None:
            self._parked_at = asyncio.get_running_loop().time()
            self._expiry = asyncio.create_task(self._expire(name), name="resume-timeout")
        if engine.num_active:
            log.warning("%d requests wait for %s to be re-formed (up to %.0f s)", engine.num_active, name,
                        self._resume_timeout_s)

    async def _expire(self, name: str) -> None:
        await asyncio.sleep(self._resume_timeout_s)
        self._expiry = None
        self._fail_parked(f"{name} failed and no worker group was ready again within "
                          f"{self._resume_timeout_s:g} s (resume_timeout_s)")

    def _fail_parked(self, message: str) -> None:
        engine, self._engine = self._engine, None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if engine is not None:
            if engine.num_active:
                log.error("failing %d requests: %s", engine.num_active, message)
            engine.fail_all(f"no worker group is ready: {message}")

    def _adopt_parked(self, engine: Engine) -> None:
        """The new engine takes the parked requests; it is the one taking requests now."""
        parked, self._engine = self._engine, engine
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if parked is None:
            return
        num_resumed = engine.adopt(parked)
        self.num_resumed_groups += 1
        self.num_resumed_requests += num_resumed
        if self._parked_at is not None:
            self.resume_seconds.append(asyncio.get_running_loop().time() - self._parked_at)
            self._parked_at = None
        log.info("resuming %d requests on %s", num_resumed, _describe(self._group))

    async def _serve(self, group: GroupAssignment) -> None:
        """Serves the group until the assignment changes (this task is cancelled).

        A group that fails to set up or breaks is tried again, with backoff,
        once all its ranks are ready again: a rank drops its sequences when its
        stream ends, so a fresh engine on fresh streams starts clean.
        """
        name = _describe(group)
        delay_s = _RETRY_MIN_S
        while True:
            log.info("assigned to %s; waiting until its ranks are ready", name)
            await self._cluster.wait_group_ready(group)
            if await self._refuse_other_model(group):
                delay_s = min(2 * delay_s, _RETRY_MAX_S)
                await asyncio.sleep(delay_s)
                continue
            try:
                num_steps = await self._serve_once(group)
            except (GroupSetupError, GroupFailure, RankCallError) as error:
                log.error("%s is not usable: %s; retrying in %.1f s", name, error_text(error), delay_s)
                num_steps = 0
            delay_s = _RETRY_MIN_S if num_steps else min(2 * delay_s, _RETRY_MAX_S)
            await asyncio.sleep(delay_s)

    async def _serve_once(self, group: GroupAssignment) -> int:
        """Sets up the group's engine and runs it until it fails; returns its step count."""
        name = _describe(group)
        connection = GroupConnection(group)
        engine = None
        try:
            infos = await self._connect(group, connection)
            engine = self._make_engine(group, infos, connection.open_step_streams())
            self._adopt_parked(engine)
            await self._set_serving(True)
            log.info("serving %s: %s", name, ", ".join(
                f"rank {i.rank}: {i.num_kv_blocks} KV blocks of {i.kv_block_size}" for i in infos))
            async with placement_watch.following(self._cluster, group, engine):
                await engine.run()
        except GroupFailure:
            return engine.num_steps
        finally:
            await self._set_serving(False)
            if engine is not None:
                self._park(engine, name)
            await connection.close()

    async def _refuse_other_model(self, group: GroupAssignment) -> bool:
        """True (logged, parked requests failed) if the group's ranks registered another model."""
        if self._model_identity is None:
            return False
        members = await self._cluster.list_members("expert")
        problem = model_check.mismatch(self._model_identity, group, members)
        if problem is None:
            self.model_mismatch = None
            return False
        if problem != self.model_mismatch:
            log.error("not serving %s: %s", _describe(group), problem)
        self.model_mismatch = problem
        self._fail_parked(problem)
        return True

    @telemetry.traced("gateway.connect_group")
    async def _connect(self, group: GroupAssignment, connection: GroupConnection) -> list[RankStatus]:
        """Every rank's status, checked against the assignment."""
        infos = await connection.rank_statuses(self._rank_call_timeout_s)
        for rank, info in enumerate(infos):
            check_rank_info(group, rank, info)
        return infos


def _describe(group: GroupAssignment | None) -> str:
    if group is None:
        return "none"
    return f"group {group.group_id!r} epoch {group.epoch} ({group.world_size} ranks)"
