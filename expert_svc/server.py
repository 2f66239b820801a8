"""The life of one expert service: listen, register, wait for a group, load, join, serve.

1. Start the gRPC server (GetRankInfo answers from here on, is_ready false)
   and write the port file.
2. Allocate the KV pool where its size does not depend on the rank (the
   CPU, or a fixed --kv-blocks) and freeze the startup heap, then register
   in etcd as role "expert" with info {"rendezvous_port", "device"}: a
   standby is placed only once warm.
3. Watch for the group assignment. Once assigned rank r of N: load only the
   experts [r*E/N, (r+1)*E/N) plus the trunk and gates, join the group's
   torch.distributed process group (gloo on the CPU, NCCL on CUDA) at the
   rendezvous, build the model and the KV pool (expert_svc/model_builder.py),
   mark the rank ready in etcd and turn health SERVING.
4. Serve step plans until stopped.
5. If a step fails (a collective timed out after `collective_timeout_s` or
   errored, e.g. a peer was killed, or a step overran twice that), the rank
   writes /failures/<group>/<epoch>/<rank> in etcd, goes NOT_SERVING and
   leaves its process group, but keeps its weights and waits: the scheduler
   re-forms the group in a new epoch (docs/internals.md, "Rank failures").
6. When the assignment moves to a new epoch with this member at the same
   rank (and the same group and size), the rank joins the new epoch's
   process group (expert_svc/rendezvous.py) WITHOUT reloading its weights,
   drops every sequence, marks itself ready for the new epoch and serves
   again (a step of the old epoch still waiting in a collective on a hung
   peer is made to fail at once: ProcessGroupLink.sever); a failed rendezvous is reported like a failed step. If the
   assignment is deleted or gives this member another rank, group or size
   (or none: a standby took its place while it hung), `run` returns
   EXIT_ASSIGNMENT_LOST so that the supervisor restarts it clean (it then
   registers again as a standby).
7. Fencing (expert_svc/fencing.py): once the rank's etcd lease has gone a
   TTL without renewal (etcd unreachable: the host may be partitioned and
   replaced), the serving epoch's steps are held and the rank is
   NOT_SERVING; the same lease confirmed alive lifts the hold, a new lease
   fails the epoch as in 5, so a cut-off rank never serves its old epoch
   beside the group re-formed without it.

On CUDA, steps 5 and 6 are not taken: NCCL's timeout does not free a host
thread waiting on a stuck collective (seen on H200s with torch 2.11: still
blocked 40 s past a 5 s timeout, whatever TORCH_NCCL_ASYNC_ERROR_HANDLING
said), and tearing down a communicator whose peer died is not verified, so
a failed step there still makes `run` return EXIT_RANK_FAILED (the step
deadline is what fires; main exits without joining the model thread) and a
new epoch EXIT_ASSIGNMENT_LOST: the restarted process is the new member.

All model work (loading, the rendezvous, steps, teardown) runs on one
dedicated thread, so the event loop keeps answering RPCs and etcd; with
`pipeline_steps`, a second thread waits for each step's sampled tokens, so
the model thread can launch the next step meanwhile (expert_svc/executor.py).
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import pathlib
import socket
import time

import torch

from expert_svc import fencing, observability, placement
from expert_svc.assignment import Action, AssignmentLostError, joined_placement, next_action
from expert_svc.config import ExpertConfig
from expert_svc.executor import StepExecutor
from expert_svc.model_builder import ModelBuilder
from expert_svc.observability import step_hook
from expert_svc.rendezvous import ProcessGroupLink, RendezvousError, StorePortError, use_interface
from expert_svc.router_client import RouterClient
from expert_svc.runner import StepRunner
from expert_svc.state import RankState
from expert_svc.servicer import ExpertServicer
from expert_svc.stats_reporter import StatsReporter
from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from services import gc_pauses, grpc_util, http_probes, telemetry
from services.cluster import ClusterClient, GroupAssignment
from services.model.moe_dispatch import local_expert_ids
from services.process import announce_port, stop_on_signals

log = logging.getLogger("expert_svc")

SERVICE_NAME = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name
EXIT_ASSIGNMENT_LOST = 3
EXIT_RANK_FAILED = 4
# How long a failing rank tries to write its failure report before it exits anyway.
FAILURE_REPORT_TIMEOUT_S = 5.0


async def serve(config: ExpertConfig) -> tuple[int, bool]:
    """Runs one rank, with its /metrics and probes, until SIGTERM or SIGINT (or a failure);
    returns (exit status, whether its model thread finished: see ExpertRank.stop)."""
    stop = stop_on_signals()
    rank = ExpertRank(config)
    probes = await http_probes.start_probes("expert", config, observability.readiness(rank.state))
    probes.add_collector(observability.ExpertStateCollector(rank.state, lambda: rank.reporter))
    try:
        await rank.start()
        code = await rank.run(stop)
    finally:
        is_clean = await rank.stop()
        await probes.close()
    return code, is_clean


class ExpertRank:
    """One expert service process. `start`, then `run` until stopped, then `stop`."""

    def __init__(self, config: ExpertConfig):
        self.config = config
        self._builder = ModelBuilder(config)
        self.model_config = self._builder.model_config
        self.state = RankState(member_id=config.member_id,
                               model_name=pathlib.Path(config.model).name or config.random_weights)
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="model", initializer=self._init_model_thread)
        self._reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="step-reader", initializer=self._init_model_thread)
        self._server: grpc_util.Server | None = None
        self._cluster: ClusterClient | None = None
        self._reporter: StatsReporter | None = None
        self._joined: tuple | None = None
        self._address = ""  # registered gRPC address, once started
        # (group_id, rank, world_size) whose weights are loaded; kept across epochs.
        self._loaded: tuple | None = None
        self._link = ProcessGroupLink("nccl" if config.is_cuda else "gloo", config.collective_timeout_s)
        self._model = None
        self._runner: StepRunner | None = None
        self._failure_tasks: set[asyncio.Task] = set()
        self._placement_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._fence_task: asyncio.Task | None = None
        self._step_failed = asyncio.Event()
        self._failure_reason = ""

    def _init_model_thread(self) -> None:
        if self.config.is_cuda:
            torch.cuda.set_device(torch.device(self.config.device))

    async def _on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @property
    def reporter(self) -> StatsReporter | None:
        """The hit-count reporter, once the rank has joined its group."""
        return self._reporter

    @property
    def port(self) -> int:
        """The bound gRPC port (after start)."""
        return self._server.port

    async def start(self) -> None:
        """Listens, writes the port file, registers, and starts following the assignment."""
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.collective_interface:
            use_interface(cfg.collective_interface, override=bool(cfg.ep_interface))
        servicer = ExpertServicer(self.state)
        self._server = await grpc_util.start_server(
            [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(servicer, s)],
            [SERVICE_NAME], host=cfg.host, port=cfg.port)
        await self._set_serving(False)
        announce_port("expert", cfg, self._server.port)
        # Before registering (a standby is placed only once warm), what does not depend on
        # the rank: the KV pool, and the startup heap frozen (the join then freezes only
        # what it loads), so that taking a failed rank's place costs neither.
        await self._on_model_thread(self._builder.prepare_kv_pool)
        gc_pauses.freeze("startup", enabled=cfg.gc_freeze)
        self._cluster = ClusterClient(cfg.etcd, prefix=cfg.key_prefix, reach_timeout_s=cfg.etcd_connect_timeout_s)
        await self._cluster.connect()
        rendezvous_port = cfg.rendezvous_port or _free_port(cfg.host)
        await self._cluster.register("expert", cfg.member_id, cfg.address(self._server.port),
                                     {"rendezvous_port": rendezvous_port, "device": cfg.device,
                                      "num_spare_expert_slots": cfg.fixed_spare_slots or 0,
                                      "num_experts": self.model_config.num_experts,
                                      "group_settings": cfg.group_settings(self.model_config)},
                                     ttl=cfg.lease_ttl_s)
        self._address = self._link.advertised_address = cfg.address(self._server.port)
        self._watch_task = asyncio.create_task(self._follow_assignment(), name="follow-assignment")
        self._fence_task = fencing.start(self.state, self._set_serving, lambda: self._cluster.session)

    async def run(self, stop: asyncio.Event) -> int:
        """Serves until `stop` is set (0), the assignment fails or is lost, or a
        step fails (reported in etcd first): non-zero."""
        stopped = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(self._step_failed.wait())
        await asyncio.wait([stopped, failed, self._watch_task], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        failed.cancel()
        if self._step_failed.is_set():
            await self._report_failure_and_exit()
            return EXIT_RANK_FAILED
        if not self._watch_task.done():
            return 0
        error = self._watch_task.exception()
        if error is None:
            log.error("the assignment watch ended (etcd client closed)")
            return 1
        if isinstance(error, AssignmentLostError):
            log.error("%s; exiting so that the rank restarts clean", error)
            return EXIT_ASSIGNMENT_LOST
        log.error("cannot join the group: %s", error, exc_info=error)
        return 1

    async def _follow_assignment(self) -> None:
        member_id = self.config.member_id
        async for group in self._cluster.watch_group_for_member(member_id):
            action = next_action(group, member_id=member_id, address=self._address,
                                 num_experts=self.model_config.num_experts, joined=self._joined,
                                 loaded=self._loaded, can_rejoin=not self.config.is_cuda)
            if action is Action.JOIN:
                await self._join(group)
            elif action is Action.REJOIN:
                await self._rejoin(group)

    @telemetry.traced("expert.join")
    async def _join(self, group: GroupAssignment) -> None:
        cfg, mc, member_id = self.config, self.model_config, self.config.member_id
        rank = group.rank_of(member_id)
        expert_ids = local_expert_ids(mc.num_experts, rank, group.world_size)
        s = self.state
        s.group_id, s.rank, s.world_size, s.placement_epoch = group.group_id, rank, group.world_size, group.epoch
        s.expert_ids = tuple(expert_ids)
        log.info("assigned rank %d of %d in group %s epoch %d (experts %d..%d); loading", rank,
                 group.world_size, group.group_id, group.epoch, expert_ids.start, expert_ids.stop - 1)
        self._joined = joined_placement(group, member_id)
        try:
            model, kv_pool = await self._on_model_thread(
                self._builder.build, expert_ids, lambda: self._link.connect(group, rank))
        except RendezvousError as error:  # the weights go; the next epoch loads them again
            await self._move_rendezvous_port(error)
            self._report_failure(group.epoch, str(error))
            return
        self._model, self._loaded = model, (group.group_id, rank, group.world_size)
        runner = self._builder.runner(model, kv_pool, group)
        router = RouterClient(self._router_address, group_id=group.group_id, rank=rank,
                              moe_layers=mc.moe_layers, deadline_s=cfg.stats_deadline_s)
        self._reporter = StatsReporter(model.hit_counts_LE, mc.moe_layers, every_steps=cfg.stats_every_steps,
                                       router=router, loop=asyncio.get_running_loop())
        s.num_kv_blocks, s.kv_block_size = kv_pool.num_blocks, cfg.kv_block_size
        self._runner = runner
        if cfg.fixed_spare_slots is None:  # auto: the router scales by what the build chose
            await self._cluster.update_info({"num_spare_expert_slots": model.num_spare_expert_slots})
        if model.num_spare_expert_slots:  # expert replicas: stage and install placements
            self._placement_task = placement.start_following(
                model, runner, self._cluster, group_id=group.group_id, rank=rank, member_id=member_id,
                load_experts=self._builder.expert_loader())
        self._new_executor(runner)
        gc_pauses.freeze("loading the weights", enabled=cfg.gc_freeze, young_threshold=cfg.gc_young_threshold,
                         keep_frozen=True)
        await self._mark_ready(group)
        log.info("rank %d of group %s ready: %d KV blocks of %d tokens", rank, group.group_id,
                 kv_pool.num_blocks, cfg.kv_block_size)

    def _new_executor(self, runner: StepRunner) -> None:
        """A fresh executor (a failed one stays failed) on the runner: the rank is ready."""
        self.state.executor = StepExecutor(
            runner, self._thread, step_hook(self._reporter.after_step, self._model.comm),
            reader=self._reader if self.config.pipeline_steps else None,
            on_failure=self._on_step_failure, deadline_s=2 * self.config.collective_timeout_s)

    async def _mark_ready(self, group: GroupAssignment) -> None:
        """Marks (group, epoch, rank) ready in etcd and turns SERVING, unless the group moved on."""
        rank = group.rank_of(self.config.member_id)
        if await self._cluster.mark_rank_ready(group.group_id, group.epoch, rank, self.config.member_id):
            await self._set_serving(True)
        else:  # the watch brings the newer assignment next
            log.warning("group %s epoch %d changed before rank %d was ready", group.group_id, group.epoch, rank)

    @telemetry.traced("expert.rejoin")
    async def _rejoin(self, group: GroupAssignment) -> None:
        """Joins the new epoch of the group at the same rank, keeping the weights."""
        s, rank = self.state, group.rank_of(self.config.member_id)
        old, s.executor = s.executor, None
        if old is not None and old.failure is None:
            # Plans of the old epoch that are still queued must not run on the new process group.
            old.failure = f"superseded by epoch {group.epoch}"
        # A step of the old epoch may wait in a collective on a peer that hung: fail it now
        # rather than at the collective timeout, so the model thread is free to rejoin.
        await asyncio.to_thread(self._link.sever, s.placement_epoch)
        await self._set_serving(False)
        self._joined = joined_placement(group, self.config.member_id)
        s.placement_epoch = group.epoch
        log.info("group %s re-formed: joining epoch %d as rank %d (weights kept) at %s", group.group_id,
                 group.epoch, rank, group.rendezvous_address)
        started = time.monotonic()
        try:
            waited_s, connect_s = await self._on_model_thread(self._reconnect, group, rank, self._runner, started)
        except RendezvousError as error:
            await self._move_rendezvous_port(error)
            self._report_failure(group.epoch, str(error))
            return
        self._new_executor(self._runner)
        await self._mark_ready(group)
        # The split says where a slow recovery went: the old epoch's step, or the rendezvous.
        log.info("rank %d of group %s ready again in epoch %d (%.0f ms for the model thread, %.0f ms rendezvous)",
                 rank, group.group_id, group.epoch, 1e3 * waited_s, 1e3 * connect_s)

    def _reconnect(self, group: GroupAssignment, rank: int, runner: StepRunner,
                   queued_at: float) -> tuple[float, float]:
        """Model thread: the new epoch's process group under the same model; no sequence survives.
        Returns (seconds it waited for the model thread, seconds the rendezvous took)."""
        started = time.monotonic()
        runner.reset()
        runner.placement_epoch = group.epoch
        self._model.comm.group = self._link.connect(group, rank)
        self._builder.plan_dispatch(self._model.comm)  # the new epoch's hosts
        return started - queued_at, time.monotonic() - started

    async def _move_rendezvous_port(self, error: RendezvousError) -> None:
        """Rank 0 could not host the store at its registered rendezvous port (another
        process bound it since it was chosen free): registers a fresh one before the
        failure is reported, so that the re-formed epoch meets there, not again at the
        taken port. A port set with --rendezvous-port is kept."""
        if not isinstance(error, StorePortError) or self.config.rendezvous_port:
            return
        port = _free_port(self.config.host)
        log.warning("the rendezvous port is taken; registering port %d for the next epoch", port)
        await self._cluster.update_info({"rendezvous_port": port})

    def _on_step_failure(self, reason: str) -> None:
        if self.config.is_cuda:  # see the module docstring: exit, the restarted process rejoins
            self._failure_reason = reason
            self._step_failed.set()
            return
        self._report_failure(self.state.placement_epoch, reason)

    def _report_failure(self, epoch: int, reason: str) -> None:
        """The group failed under this rank in `epoch`: NOT_SERVING, report it in
        etcd, leave the process group, and wait for the next epoch."""
        task = asyncio.create_task(self._fail_epoch(epoch, reason), name=f"report-failure-{epoch}")
        self._failure_tasks.add(task)
        task.add_done_callback(self._failure_tasks.discard)

    async def _fail_epoch(self, epoch: int, reason: str) -> None:
        s = self.state
        if s.placement_epoch == epoch:
            s.executor = None
            await self._set_serving(False)
        log.error("rank %d of group %s epoch %d failed: %s; reporting it and waiting for the group to be "
                  "re-formed", s.rank, s.group_id, epoch, reason)
        await self._write_failure(epoch, reason)
        await self._on_model_thread(self._link.close, epoch)

    async def _report_failure_and_exit(self) -> None:
        s = self.state
        log.error("rank %d of group %s epoch %d failed: %s; reporting it and exiting", s.rank, s.group_id,
                  s.placement_epoch, self._failure_reason)
        await self._write_failure(s.placement_epoch, self._failure_reason)

    async def _write_failure(self, epoch: int, reason: str) -> None:
        s = self.state
        try:
            await asyncio.wait_for(self._cluster.report_rank_failure(
                s.group_id, epoch, s.rank, s.member_id, reason), FAILURE_REPORT_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as error:
            log.error("could not report the failure to etcd: %r", error)

    async def _set_serving(self, is_serving: bool) -> None:
        await self._server.set_serving(is_serving)

    async def _router_address(self) -> str | None:
        routers = await self._cluster.list_members("router")
        return routers[0].address if routers else None

    async def stop(self, grace_s: float = 5.0) -> bool:
        """Leaves the mesh: NOT_SERVING, deregister, drain the stream, leave the process group.

        Returns False if the model or the reader thread did not finish in time
        (a step stuck in a collective); the caller should then exit without
        joining them.
        """
        if self._server is not None:
            await self._set_serving(False)
        for task in (self._watch_task, self._fence_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._cluster is not None:
            await self._cluster.close()  # revokes the lease: peers see us leave at once
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._reporter is not None:
            await self._reporter.close()
        if self._placement_task is not None:
            self._placement_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._placement_task
        try:
            await asyncio.wait_for(asyncio.gather(self._on_model_thread(self._link.close),
                                                  asyncio.wrap_future(self._reader.submit(lambda: None))), grace_s)
        except TimeoutError:
            log.warning("the model or reader thread is still busy after %.1fs (a step stuck in a collective?)",
                        grace_s)
            return False
        self._thread.shutdown(wait=False)
        self._reader.shutdown(wait=False)
        return True


def _free_port(host: str) -> int:
    """A port free now on host (the rendezvous store binds it later, if this becomes rank 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
