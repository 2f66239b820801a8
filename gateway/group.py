"""Following this gateway's worker group: from an etcd assignment to a running Engine.

`GroupManager.run()` registers the gateway in etcd, watches its group
assignment, and for each assignment: waits until every rank of the group's
epoch is ready, asks each rank for its KV pool (GetRankInfo, rejecting a rank
that runs another group, epoch or rank), opens one ExecuteSteps stream per
rank and starts an Engine on them. The gateway is SERVING exactly while that
engine runs. When the assignment goes away or changes, or a stream breaks,
the engine fails its requests with UNAVAILABLE (resuming them from their
checkpoints is a later issue) and health goes NOT_SERVING. A changed
assignment is followed at once; a group that broke under the same assignment
is tried again, with backoff, once all its ranks are ready again (re-forming a
group after a rank's death is the scheduler's job).
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from gateway.engine import Engine, GroupFailure, error_text
from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from services import grpc_util, telemetry
from services.cluster import ClusterClient, GroupAssignment

log = logging.getLogger("gateway.group")

# Backoff between attempts to serve the same group.
_RETRY_MIN_S = 0.5
_RETRY_MAX_S = 10.0

# Builds the engine of a ready group from its rank infos (by rank) and step streams.
EngineFactory = Callable[[GroupAssignment, Sequence[expert_pb2.GetRankInfoResponse], Sequence], Engine]


class GroupSetupError(Exception):
    """A rank of the assigned group is not what the assignment says."""


def check_rank_info(group: GroupAssignment, rank: int, info: expert_pb2.GetRankInfoResponse) -> None:
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
    ) -> None:
        self._cluster = cluster
        self._member_id = member_id
        self._address = address
        self._make_engine = make_engine
        self._set_serving = set_serving
        self._rank_call_timeout_s = rank_call_timeout_s
        self._lease_ttl_s = lease_ttl_s
        self._engine: Engine | None = None
        self._group: GroupAssignment | None = None
        self._task: asyncio.Task | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine of the ready group, None while no group is ready."""
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
                if group is not None:
                    self._task = asyncio.create_task(self._serve(group), name=f"group-{group.group_id}")
        finally:
            await self._stop_group("the gateway is stopping")

    async def _stop_group(self, reason: str) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.fail_all(f"no worker group is ready: {reason}")

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
            try:
                num_steps = await self._serve_once(group)
            except (GroupSetupError, GroupFailure, grpc.RpcError) as error:
                log.error("%s is not usable: %s; retrying in %.1f s", name, error_text(error), delay_s)
                num_steps = 0
            delay_s = _RETRY_MIN_S if num_steps else min(2 * delay_s, _RETRY_MAX_S)
            await asyncio.sleep(delay_s)

    async def _serve_once(self, group: GroupAssignment) -> int:
        """Sets up the group's engine and runs it until it fails; returns its step count."""
        name = _describe(group)
        channels = [grpc_util.channel(r.address) for r in group.ranks]
        streams = []
        engine = None
        try:
            infos = await self._connect(group, channels)
            streams = [expert_pb2_grpc.ExpertServiceStub(c).ExecuteSteps() for c in channels]
            engine = self._make_engine(group, infos, streams)
            self._engine = engine
            await self._set_serving(True)
            log.info("serving %s: %s", name, ", ".join(
                f"rank {i.rank}: {i.num_kv_blocks} KV blocks of {i.kv_block_size}" for i in infos))
            await engine.run()
        except GroupFailure:
            return engine.num_steps
        finally:
            await self._set_serving(False)
            self._engine = None
            if engine is not None:
                engine.fail_all(f"no worker group is ready: {name} is gone")
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    @telemetry.traced("gateway.connect_group")
    async def _connect(self, group: GroupAssignment, channels) -> list[expert_pb2.GetRankInfoResponse]:
        """GetRankInfo on every rank, checked against the assignment."""
        calls = [
            expert_pb2_grpc.ExpertServiceStub(c).GetRankInfo(
                expert_pb2.GetRankInfoRequest(), timeout=self._rank_call_timeout_s, wait_for_ready=True)
            for c in channels
        ]
        infos = await asyncio.gather(*calls)
        for rank, info in enumerate(infos):
            check_rank_info(group, rank, info)
        return list(infos)


def _describe(group: GroupAssignment | None) -> str:
    if group is None:
        return "none"
    return f"group {group.group_id!r} epoch {group.epoch} ({group.world_size} ranks)"
