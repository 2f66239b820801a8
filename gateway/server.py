"""The gateway's lifecycle: servers up, follow the worker group, drain on stop.

Wiring: the GenerationService servicer asks the GroupManager for the engine
of the ready worker group; the manager registers the gateway in etcd, follows
its assignment and builds that engine (a Batcher over one RankKV per rank,
the ranks' ExecuteSteps streams) with `engine_factory`. Health ("" and the
GenerationService) is SERVING exactly while an engine runs. One GatewayStats
collects the counters of every engine; with --stats-file it is written as
JSON every stats_interval_s and at exit (bench/serve.py reads it), and a
summary is logged at exit.

The OpenAI-compatible HTTP endpoint (gateway/http/, --http-port) runs in the
same event loop over the servicer's Frontend; it stops after the drain.

Both public transports run behind the API key check when --api-keys is set
(gateway/auth.py); the gRPC server also behind the hostile-input interceptor
and its explicit limits (services/grpc_limits.py), and every stream under the
slow-reader watch (gateway/slow_readers.py); docs/security.md.

SIGTERM/SIGINT drain: health goes NOT_SERVING, new requests get UNAVAILABLE,
requests in flight finish within shutdown_grace_s (then fail with
UNAVAILABLE), the server stops and the etcd lease is revoked (deregistered).
"""

import asyncio
import logging

from gateway.auth import ApiKeyCollector, KeyStore
from gateway.auth_grpc import ApiKeyInterceptor
from gateway.batcher import Batcher
from gateway.config import GatewayConfig
from gateway.engine import Engine
from gateway.group import EngineFactory, GroupManager
from gateway.http.app import make_app
from gateway.http.server import HttpServer
from gateway.kv_accounting import RankKV
from gateway.model_info import model_info
from gateway.observability import EngineObserver, GatewayReadiness, GatewayStateCollector
from gateway.servicer import SERVICE_NAME, GenerationServicer
from gateway.slow_readers import SlowReaderCollector, SlowReaders
from gateway.stats import GatewayStats
from gateway.validation import GilFreeTokenizer, RequestLimits
from moe.gateway.v1 import gateway_pb2_grpc
from services import gc_pauses, grpc_limits, grpc_util, http_probes, model_identity, process
from services.cluster import ClusterClient
from services.constraints import Compiler
from services.model.config import ModelConfig
from services.text import IncrementalDetokenizer
from services.tokenizer import Tokenizer

ROLE = "gateway"
log = logging.getLogger(ROLE)


def request_limits(config: GatewayConfig, model: ModelConfig) -> RequestLimits:
    """The per-request limits from the gateway's flags and the model."""
    max_context = model.max_position_embeddings
    limit = config.max_new_tokens_limit or max_context
    return RequestLimits(
        vocab_size=model.vocab_size,
        max_context=max_context,
        max_new_tokens_default=min(config.max_new_tokens_default, limit),
        max_new_tokens_limit=limit,
    )


def eos_token_ids(model: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """The tokens that end a sequence: the model's (config.json) and the tokenizer's."""
    return set(model.eos_token_ids) | set(tokenizer.eos_token_ids)


def constraint_compiler(model: ModelConfig, tokenizer: Tokenizer) -> Compiler:
    """The gateway's one Compiler of requests' constraints, over the model's logits width.

    Built before the servers start: building llguidance's tokenizer holds the GIL for about a
    second, which must not stall streams or health checks.
    """
    return Compiler(tokenizer.backend.to_str(), sorted(eos_token_ids(model, tokenizer)), model.vocab_size)


def engine_factory(config: GatewayConfig, model: ModelConfig, tokenizer: Tokenizer,
                   stats: GatewayStats) -> EngineFactory:
    """Builds the engine of a ready group: one KV accounting (and prefix cache) per rank."""
    eos_ids = eos_token_ids(model, tokenizer)

    def make(group, infos, streams) -> Engine:
        batcher = Batcher(
            [RankKV(info.num_kv_blocks, info.kv_block_size, enable_prefix_cache=config.enable_prefix_cache)
             for info in infos],
            max_running_requests=config.max_running_requests,
            max_batch_tokens=config.max_batch_tokens,
            max_context=model.max_position_embeddings,
            eos_token_ids=eos_ids,
            prefill_chunk_size=config.prefill_chunk_size,
            max_waiting_requests=config.max_waiting_requests,
            tpot_target_ms=config.tpot_target_ms,
            ttft_target_ms=config.ttft_target_ms,
            min_prefill_tokens=config.min_prefill_tokens,
            policy=config.policy,
            stats=stats,
            jump_forward=config.jump_forward,
            jump_forward_min_tokens=config.jump_forward_min_tokens,
        )
        return Engine(batcher, streams, make_detokenizer=lambda: IncrementalDetokenizer(tokenizer),
                      group_id=group.group_id, placement_epoch=group.epoch,
                      step_timeout_s=config.step_timeout_s, overlap=config.overlap_steps,
                      stream_interval=config.stream_interval,
                      observer=EngineObserver(len(infos)))

    return make


async def serve(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Runs the gateway until stop is set; raises if following the group fails for good."""
    model = ModelConfig.from_model_dir(config.model)
    tokenizer = GilFreeTokenizer(Tokenizer.from_model_dir(config.model).backend)
    compiler = constraint_compiler(model, tokenizer)
    manager: GroupManager | None = None
    stats = GatewayStats()
    is_stopping = False
    draining: Engine | None = None

    def get_engine() -> Engine | None:
        # While stopping: only the draining engine, which refuses with "shutting down".
        if is_stopping:
            return draining
        return None if manager is None else manager.engine

    probes = await http_probes.start_probes(ROLE, config)
    probes.add_collector(GatewayStateCollector(get_engine, stats))
    limits = request_limits(config, model)
    info = model_info(config.model, model, context_length=limits.max_context,
                      enable_prefix_cache=config.enable_prefix_cache)
    slow_readers = SlowReaders(config.slow_reader_timeout_s)
    servicer = GenerationServicer(tokenizer=tokenizer, limits=limits, model_info=info,
                                  get_engine=get_engine, coalesce_outputs=config.coalesce_stream_outputs,
                                  compiler=compiler, slow_readers=slow_readers,
                                  no_group_reason=lambda: None if manager is None else manager.model_mismatch)
    keys = KeyStore(config.api_keys) if config.api_keys else None
    probes.add_collector(SlowReaderCollector(slow_readers))
    if keys is not None:
        probes.add_collector(ApiKeyCollector(keys))
    # Keys first: a caller without one learns nothing, not even whether its bytes parse.
    interceptors = [*([ApiKeyInterceptor(keys)] if keys else []), grpc_limits.HostileInputInterceptor()]
    server = await grpc_util.start_server(
        [lambda s: gateway_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME], host=config.host, port=config.port, interceptors=interceptors,
        options=config.server_limits().options())

    async def set_serving(is_serving: bool) -> None:
        await server.set_serving(is_serving and not is_stopping)

    await set_serving(False)
    process.announce_port(ROLE, config, server.port)
    http = await start_http(config, servicer.frontend, tokenizer, keys)
    gc_pauses.freeze("startup (tokenizer, servers)", enabled=config.gc_freeze,
                     young_threshold=config.gc_young_threshold)
    cluster = ClusterClient(config.etcd, prefix=config.key_prefix, reach_timeout_s=config.etcd_connect_timeout_s)
    manager = GroupManager(
        cluster, member_id=config.member_id, address=config.address(server.port),
        make_engine=engine_factory(config, model, tokenizer, stats), set_serving=set_serving,
        rank_call_timeout_s=config.rank_call_timeout_s, lease_ttl_s=config.lease_ttl_s,
        resume_timeout_s=config.resume_timeout_s, model_identity=model_identity.identity(model, config.model))
    probes.set_readiness(GatewayReadiness(manager, model.num_experts, cluster))

    async def follow_groups() -> None:
        await cluster.connect(wait_s=None)
        await manager.run()

    manager_task = asyncio.create_task(follow_groups(), name="group-manager")
    stop_task = asyncio.create_task(stop.wait(), name="stop-signal")
    stats_task = asyncio.create_task(write_stats_periodically(config, stats), name="stats-writer")
    slow_task = asyncio.create_task(slow_readers.run(), name="slow-readers")
    try:
        await asyncio.wait([manager_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
        if manager_task.done():
            log.error("following the worker group failed: %r", manager_task.exception())
        log.info("stopping: draining requests in flight (up to %.0f s)", config.shutdown_grace_s)
        is_stopping, draining = True, manager.engine
        await set_serving(False)
        await drain(draining, config.shutdown_grace_s)
    finally:
        stop_task.cancel()
        stats_task.cancel()
        slow_task.cancel()
        manager_task.cancel()
        await asyncio.gather(manager_task, stats_task, slow_task, return_exceptions=True)
        if http is not None:
            await http.stop()
        await server.stop(1.0)
        await cluster.close()  # revokes the lease: deregistered at once
        await probes.close()
        write_stats(config, stats)
        log.info("stopped; %s", summary(stats))
    if not manager_task.cancelled() and manager_task.exception() is not None:
        raise manager_task.exception()


async def start_http(config: GatewayConfig, frontend, tokenizer: Tokenizer,
                     keys: KeyStore | None = None) -> HttpServer | None:
    """The OpenAI-compatible endpoint over the servicer's Frontend (with the gRPC API's keys),
    unless http_port is -1; its port is written to the port file + ".http"."""
    if config.http_port < 0:
        return None
    http = await HttpServer.start(make_app(frontend, tokenizer.token_bytes, keys=keys),
                                  config.host, config.http_port)
    log.info("OpenAI-compatible HTTP endpoint on http://%s:%d/v1", config.public_host, http.port)
    if config.port_file:
        process.write_port_file(process.http_port_file(config.port_file), http.port)
    return http


def summary(stats: GatewayStats) -> str:
    """One log line of the counters an operator looks at first."""
    snap = stats.snapshot()
    return (f"{snap['num_requests']} requests, {snap['num_steps']} steps, prefix-cache hit rate "
            f"{snap['prefix_hit_rate']:.1%}, {snap['num_preemptions']} preemptions, "
            f"planning {snap['plan_ms_mean']:.3f} ms/step (p99 {snap['plan_ms_p99']:.3f})")


def write_stats(config: GatewayConfig, stats: GatewayStats) -> None:
    """Writes the stats file if one is configured; a failure is logged, not raised."""
    if not config.stats_file:
        return
    try:
        stats.write_json(config.stats_file)
    except OSError as error:
        log.warning("cannot write the stats file %s: %s", config.stats_file, error)


async def write_stats_periodically(config: GatewayConfig, stats: GatewayStats) -> None:
    """Rewrites the stats file every stats_interval_s until cancelled."""
    if not config.stats_file or not config.stats_interval_s:
        return
    while True:
        write_stats(config, stats)
        await asyncio.sleep(config.stats_interval_s)


async def drain(engine: Engine | None, grace_s: float) -> None:
    """Lets the engine finish its requests within grace_s, then fails the rest."""
    if engine is None:
        return
    engine.stop_accepting()
    try:
        async with asyncio.timeout(grace_s):
            await engine.wait_idle()
    except TimeoutError:
        log.warning("%d requests still running after %.0f s; failing them", engine.num_active, grace_s)
        engine.fail_all("the gateway is shutting down")
