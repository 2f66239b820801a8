"""The step loop against in-process fake ranks, and the servicer over real gRPC."""

import asyncio
import dataclasses

import grpc
import pytest

from gateway.batcher import Batcher
from gateway.engine import Engine, GroupFailure
from gateway.group import GroupManager, GroupSetupError, check_rank_info
from gateway.kv_accounting import RankKV
from gateway.rank_client import status_from_proto
from gateway.requests import ErrorCode, FinishReason, GenerationError
from gateway.servicer import SERVICE_NAME, GenerationServicer
from gateway.validation import RequestLimits
from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services import grpc_util
from services.cluster import GroupAssignment, RankInfo
from services.text import IncrementalDetokenizer
from tests.gateway.fakes import EOS, MODEL_INFO, FakeTokenizer, SimRank, make_request, reference_tokens


def assert_pool_clean(engine: Engine, ranks=()) -> None:
    """Every block back (free or cached without references), no sequence left anywhere."""
    for kv in engine.batcher.ranks:
        kv.check_invariants()
        assert kv.num_available == kv.num_blocks
    assert all(rank.seqs == {} for rank in ranks)
    assert engine.num_active == 0 and not engine.batcher.has_work


def make_engine(num_ranks=1, *, num_blocks=64, block_size=4, max_running_requests=8,
                max_batch_tokens=256, ranks=None, overlap=True, stream_interval=1,
                **kwargs) -> tuple[Engine, list[SimRank]]:
    ranks = ranks or [SimRank(num_blocks, block_size) for _ in range(num_ranks)]
    batcher = Batcher([RankKV(num_blocks, block_size) for _ in ranks],
                      max_running_requests=max_running_requests, max_batch_tokens=max_batch_tokens,
                      max_context=1000, eos_token_ids=[EOS], **kwargs)
    engine = Engine(batcher, ranks, make_detokenizer=lambda: IncrementalDetokenizer(FakeTokenizer()),
                    group_id="g1", placement_epoch=1, step_timeout_s=5.0, overlap=overlap,
                    stream_interval=stream_interval)
    return engine, ranks


async def collect(handle):
    outputs = []
    async for output in handle:
        outputs.append(output)
    return outputs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("overlap", [True, False])
def test_concurrent_requests_share_steps_and_get_every_token_once(overlap):
    async def scenario():
        engine, (rank,) = make_engine(overlap=overlap)
        loop_task = asyncio.create_task(engine.run())
        prompts = [[30, 31], [40, 41, 42, 43, 44], [27]]
        lengths = [5, 7, 3]
        handles = [engine.submit(make_request(prompt_ids=p, max_new_tokens=n, request_id=f"r{i}"))
                   for i, (p, n) in enumerate(zip(prompts, lengths))]
        results = await asyncio.gather(*(collect(h) for h in handles))
        await asyncio.sleep(0.05)        # the step that forgets the last one
        loop_task.cancel()
        return engine, rank, prompts, lengths, results

    engine, rank, prompts, lengths, results = run(scenario())
    for prompt, n, outputs in zip(prompts, lengths, results):
        token_ids = [t for o in outputs for t in o.token_ids]
        assert token_ids == reference_tokens(prompt, n)
        assert "".join(o.text for o in outputs) == FakeTokenizer().decode(token_ids)
        assert [o.finish_reason for o in outputs] == [None] * (n - 1) + [FinishReason.LENGTH]
        assert (outputs[-1].prompt_tokens, outputs[-1].completion_tokens) == (len(prompt), n)
    # One prefill step for all three, then decodes: the longest request sets the step count
    # (plus the step that forgets the last one).
    assert len(rank.plans[0].scheduled) == 3
    assert engine.num_steps == max(lengths) + 1
    assert_pool_clean(engine, [rank])
    stats = engine.stats.snapshot()
    assert stats["num_steps"] == engine.num_steps and stats["plan_ms_p99"] > 0


def test_every_rank_gets_every_step_and_requests_spread_over_ranks():
    async def scenario():
        engine, ranks = make_engine(num_ranks=2)
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.submit(make_request(prompt_ids=[30 + i] * (3 + i), max_new_tokens=4 + i,
                                              request_id=f"r{i}")) for i in range(3)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        await asyncio.sleep(0.05)
        loop_task.cancel()
        return ranks, handles, results

    ranks, handles, results = run(scenario())
    assert sorted(h.seq.rank for h in handles) == [0, 0, 1]
    assert [p.step_id for p in ranks[0].plans] == [p.step_id for p in ranks[1].plans]
    assert all(p.group_id == "g1" and p.placement_epoch == 1 for r in ranks for p in r.plans)
    assert any(not p.scheduled for r in ranks for p in r.plans)    # idle steps were sent
    # Every rank's plan of a step carries the step's largest rank batch (a decode counts one).
    for plans in zip(*(r.plans for r in ranks)):
        sizes = [sum(len(s.token_ids) or 1 for s in p.scheduled) for p in plans]
        assert [p.max_tokens_per_rank for p in plans] == [max(sizes)] * len(plans)
    assert any(p.max_tokens_per_rank > 1 for p in ranks[0].plans)
    for i, outputs in enumerate(results):
        assert [t for o in outputs for t in o.token_ids] == reference_tokens([30 + i] * (3 + i), 4 + i)


def test_a_broken_rank_stream_keeps_the_requests_and_a_new_engine_resumes_them():
    """The group fails mid-generation: nothing fails, the next engine (the
    re-formed group) adopts every request, re-prefills it from its checkpoint
    and finishes it; each client sees every reference token exactly once."""
    async def scenario():
        block_size = 4
        engine, ranks = make_engine(ranks=[SimRank(64, block_size), SimRank(64, block_size, fail_at_step=3)])
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.submit(make_request(2 + i, max_new_tokens=12, request_id=f"r{i}")) for i in range(3)]
        collecting = [asyncio.create_task(collect(h)) for h in handles]
        with pytest.raises(GroupFailure, match="rank 1 step stream broke"):
            await loop_task
        assert not any(h.is_done for h in handles) and engine.num_active == 3
        queued = engine.submit(make_request(prompt_ids=[27, 28], max_new_tokens=4, request_id="late"))
        aborted = engine.submit(make_request(1, max_new_tokens=4, request_id="gone"))
        engine.abort(aborted)  # its client went away while the group was down
        resumed, new_ranks = make_engine(2, num_blocks=32)
        assert resumed.adopt(engine) == 4
        with pytest.raises(GenerationError) as refused:
            engine.submit(make_request(2))
        resumed_task = asyncio.create_task(resumed.run())
        outputs = await asyncio.gather(*collecting, collect(queued), collect(aborted))
        await resumed.wait_idle()
        resumed_task.cancel()
        return outputs, refused.value, resumed, new_ranks

    outputs, refused, resumed, new_ranks = run(scenario())
    for i, outs in enumerate(outputs[:3]):
        assert [t for o in outs for t in o.token_ids] == reference_tokens([30] * (2 + i), 12)
        assert outs[-1].completion_tokens == 12 and outs[-1].finish_reason is FinishReason.LENGTH
    assert [t for o in outputs[3] for t in o.token_ids] == reference_tokens([27, 28], 4)
    assert outputs[4][-1].finish_reason is FinishReason.ABORT
    assert refused.code is ErrorCode.UNAVAILABLE
    # The resumed sequences were prefilled with prompt plus the tokens already streamed.
    first_chunks = [list(s.token_ids) for r in new_ranks for p in r.plans for s in p.scheduled if s.token_ids]
    assert any(len(chunk) > 4 for chunk in first_chunks)
    assert_pool_clean(resumed, new_ranks)


def test_a_result_for_the_wrong_step_fails_the_group_but_not_the_request():
    async def scenario():
        engine, _ = make_engine(ranks=[SimRank(64, 4, skew_step_ids=True)])
        loop_task = asyncio.create_task(engine.run())
        handle = engine.submit(make_request(2))
        with pytest.raises(GroupFailure, match="answered step 2, expected 1"):
            await loop_task
        assert not handle.is_done
        engine.fail_all("no group came back")  # what the manager does at the resume timeout
        with pytest.raises(GenerationError) as err:
            await collect(handle)
        return err.value

    error = run(scenario())
    assert error.code is ErrorCode.UNAVAILABLE and error.message == "no group came back"


def test_an_aborted_request_is_forgotten_by_the_rank_and_its_blocks_freed():
    async def scenario():
        engine, (rank,) = make_engine()
        loop_task = asyncio.create_task(engine.run())
        cancelled = engine.submit(make_request(6, max_new_tokens=500, request_id="gone"))
        other = engine.submit(make_request(2, max_new_tokens=20, request_id="stays"))
        async for _ in cancelled:
            break
        engine.abort(cancelled)
        outputs = await collect(other)
        await asyncio.sleep(0.05)
        loop_task.cancel()
        return engine, rank, cancelled, outputs

    engine, rank, cancelled, outputs = run(scenario())
    forgotten = [sid for p in rank.plans for sid in p.finished_seq_ids]
    assert forgotten.count(cancelled.seq.seq_id) == 1
    assert len(outputs[-1].token_ids) == 1 and outputs[-1].completion_tokens == 20
    assert_pool_clean(engine, [rank])


def test_drain_waits_for_requests_in_flight_and_refuses_new_ones():
    async def scenario():
        engine, _ = make_engine()
        loop_task = asyncio.create_task(engine.run())
        handle = engine.submit(make_request(2, max_new_tokens=10))
        engine.stop_accepting()
        with pytest.raises(GenerationError) as refused:
            engine.submit(make_request(2))
        await asyncio.wait_for(engine.wait_idle(), 5)
        outputs = await collect(handle)
        loop_task.cancel()
        return refused.value, outputs

    refused, outputs = run(scenario())
    assert refused.code is ErrorCode.UNAVAILABLE and "shutting down" in refused.message
    assert outputs[-1].completion_tokens == 10


# The servicer over real gRPC, with a fake group (get_engine) and fake ranks.

LIMITS = RequestLimits(vocab_size=100, max_context=1000, max_new_tokens_default=16,
                       max_new_tokens_limit=500)


class Gateway:
    """A GenerationService on port 0 whose engine the test swaps in and out."""

    def __init__(self, *, coalesce_outputs: bool = True):
        self.engine: Engine | None = None
        self.loop_task: asyncio.Task | None = None
        self.coalesce_outputs = coalesce_outputs

    async def __aenter__(self):
        servicer = GenerationServicer(tokenizer=FakeTokenizer(), limits=LIMITS, model_info=MODEL_INFO,
                                      get_engine=lambda: self.engine,
                                      coalesce_outputs=self.coalesce_outputs)
        self.server = await grpc_util.start_server(
            [lambda s: gateway_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)], [SERVICE_NAME])
        self.channel = grpc_util.channel(f"127.0.0.1:{self.server.port}")
        self.stub = gateway_pb2_grpc.GenerationServiceStub(self.channel)
        return self

    def attach(self, **kwargs) -> Engine:
        self.engine, _ = make_engine(**kwargs)
        self.loop_task = asyncio.create_task(self.engine.run())
        return self.engine

    async def __aexit__(self, *exc):
        if self.loop_task:
            self.loop_task.cancel()
        await self.channel.close()
        await self.server.stop(0)

    async def generate(self, **kwargs):
        request = gateway_pb2.GenerateRequest(**kwargs)
        return [r async for r in self.stub.Generate(request, timeout=10)]


def test_servicer_is_unavailable_without_a_ready_group():
    async def scenario():
        async with Gateway() as gw:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.generate(request_id="u", prompt="hello")
            return err.value

    err = run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details() == "no worker group is ready"


ABC_TOKENS = reference_tokens([26, 27, 28], 10)        # after "abc"
ABC_TEXT = FakeTokenizer().decode(ABC_TOKENS)
STOP = ABC_TEXT[3:5]


def test_servicer_streams_tokens_and_text_and_refuses_bad_input():
    async def scenario():
        # One message per token: the fake ranks answer at once, so a coalescing stream
        # may find several outputs queued (tests/gateway/test_engine_pipeline.py).
        async with Gateway(coalesce_outputs=False) as gw:
            gw.attach(num_blocks=8, block_size=4, max_batch_tokens=64)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await gw.generate(request_id="bad", prompt="x",
                                  sampling=gateway_pb2.SamplingParams(temperature=7.5))
            with pytest.raises(grpc.aio.AioRpcError) as too_big:
                await gw.generate(request_id="big", input_ids=gateway_pb2.TokenIds(ids=[30] * 40))
            good = await gw.generate(request_id="good", prompt="abc",
                                     sampling=gateway_pb2.SamplingParams(max_new_tokens=4))
            stopped = await gw.generate(request_id="stop", prompt="abc",
                                        sampling=gateway_pb2.SamplingParams(max_new_tokens=10, stop=[STOP]))
            tokenized = await gw.stub.Tokenize(gateway_pb2.TokenizeRequest(text="abc"), timeout=5)
            return bad.value, too_big.value, good, stopped, tokenized

    bad, too_big, good, stopped, tokenized = run(scenario())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.details()
    assert too_big.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV cache" in too_big.details()
    assert [r.request_id for r in good] == ["good"] * 4
    assert [list(r.token_ids) for r in good] == [[t] for t in ABC_TOKENS[:4]]
    assert "".join(r.text for r in good) == ABC_TEXT[:4]
    assert [r.finish_reason for r in good] == [gateway_pb2.FINISH_REASON_UNSPECIFIED] * 3 + [
        gateway_pb2.FINISH_REASON_LENGTH]
    assert (good[-1].usage.prompt_tokens, good[-1].usage.completion_tokens) == (3, 4)
    assert not good[0].HasField("usage")
    assert "".join(r.text for r in stopped) == ABC_TEXT[:ABC_TEXT.index(STOP)]
    assert stopped[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP and stopped[-1].matched_stop == STOP
    assert list(tokenized.token_ids) == [26, 27, 28]


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache():
    async def scenario():
        async with Gateway() as gw:
            gw.attach(block_size=4)
            sampling = gateway_pb2.SamplingParams(max_new_tokens=3)
            first = await gw.generate(request_id="first", prompt="abcdefghij", sampling=sampling)
            again = await gw.generate(request_id="again", prompt="abcdefghij", sampling=sampling)
            return first[-1].usage, again[-1].usage

    first, again = run(scenario())
    assert (first.prompt_tokens, first.cached_tokens) == (10, 0)
    # Two full blocks of 4 shared, then the first's partly filled third block copied: all but the last
    # prompt token, which must be computed for its logits.
    assert (again.prompt_tokens, again.cached_tokens, again.completion_tokens) == (10, 9, 3)


def test_servicer_aborts_the_request_of_a_client_that_goes_away():
    """The same clean-up as the Abort call: blocks freed, and the request no longer live."""
    async def scenario():
        async with Gateway() as gw:
            engine = gw.attach()
            call = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="c", prompt="abcdef", sampling=gateway_pb2.SamplingParams(max_new_tokens=100)),
                timeout=10)
            await call.read()
            call.cancel()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if engine.num_active == 0 and not engine.batcher.has_work:
                    break
            with pytest.raises(grpc.aio.AioRpcError) as not_live:
                await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="c"), timeout=5)
            return engine, not_live.value

    engine, not_live = run(scenario())
    assert not_live.code() == grpc.StatusCode.NOT_FOUND
    assert_pool_clean(engine)
    assert engine.num_steps < 100     # aborted, not run to its 400 tokens
    assert engine.stats.num_aborted == 1


class SlowRank(SimRank):
    """A SimRank whose steps take delay_s each."""

    def __init__(self, *args, delay_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    async def read(self):
        await asyncio.sleep(self.delay_s)
        return await super().read()


def test_the_grpc_deadline_ends_the_request_and_frees_its_blocks():
    async def scenario():
        async with Gateway() as gw:
            gw.engine, ranks = make_engine(ranks=[SlowRank(64, 4, delay_s=0.01)])
            gw.loop_task = asyncio.create_task(gw.engine.run())
            call = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="d", prompt="abcdef", sampling=gateway_pb2.SamplingParams(max_new_tokens=450)),
                timeout=0.3)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            await wait_for(lambda: gw.engine.num_active == 0 and not gw.engine.batcher.has_work
                           and ranks[0].seqs == {})
            return err.value, gw.engine, ranks

    err, engine, ranks = run(scenario())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_pool_clean(engine, ranks)
    assert engine.num_steps < 100


def test_a_deadline_the_gateway_sees_first_ends_the_request_with_deadline_exceeded():
    async def scenario():
        engine, ranks = make_engine(ranks=[SlowRank(64, 4, delay_s=0.01)])
        loop_task = asyncio.create_task(engine.run())
        loop = asyncio.get_running_loop()
        handle = engine.submit(make_request(4, max_new_tokens=900), deadline=loop.time() + 0.2)
        with pytest.raises(GenerationError) as err:
            await collect(handle)
        await wait_for(lambda: not engine.batcher.has_work and ranks[0].seqs == {})
        loop_task.cancel()
        return err.value, engine, ranks

    err, engine, ranks = run(scenario())
    assert err.code is ErrorCode.DEADLINE_EXCEEDED and "deadline" in err.message
    assert_pool_clean(engine, ranks)


def test_a_full_waiting_queue_answers_resource_exhausted_with_the_limit():
    async def scenario():
        async with Gateway() as gw:
            gw.attach(max_running_requests=1, max_waiting_requests=1)
            first = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="a", prompt="abc", sampling=gateway_pb2.SamplingParams(max_new_tokens=200)), timeout=10)
            await first.read()                  # running
            second = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="b", prompt="abc", sampling=gateway_pb2.SamplingParams(max_new_tokens=2)), timeout=10)
            await wait_for(lambda: gw.engine.batcher.num_waiting == 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.generate(request_id="c", prompt="abc")
            first.cancel()
            rest = [r async for r in second]
            return err.value, rest

    err, rest = run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_requests 1" in err.details()
    assert rest[-1].usage.completion_tokens == 2


# The group manager: a fake etcd view, a fake rank over real gRPC.

class FakeCluster:
    """The ClusterClient calls GroupManager makes; the test pushes assignments."""

    def __init__(self):
        self.assignments: asyncio.Queue = asyncio.Queue()
        self.registered: list[tuple] = []

    async def register(self, role, member_id, address, info=None, ttl=2):
        self.registered.append((role, member_id, address))

    async def watch_group_for_member(self, member_id):
        while True:
            yield await self.assignments.get()

    async def wait_group_ready(self, group):
        return None


class FakeExpertService(expert_pb2_grpc.ExpertServiceServicer):
    """A rank that runs group g1, epoch 1, with SimRank's step logic."""

    def __init__(self, num_broken_streams: int = 0):
        self.num_broken_streams = num_broken_streams
        self.info = expert_pb2.GetRankInfoResponse(
            member_id="e0", group_id="g1", rank=0, world_size=1, placement_epoch=1,
            num_kv_blocks=32, kv_block_size=4, is_ready=True)

    async def GetRankInfo(self, request, context):
        return self.info

    async def ExecuteSteps(self, request_iterator, context):
        rank = SimRank(self.info.num_kv_blocks, self.info.kv_block_size)
        if self.num_broken_streams:
            self.num_broken_streams -= 1
            await context.abort(grpc.StatusCode.INTERNAL, "a peer rank timed out")
        async for request in request_iterator:
            await rank.write(request)
            yield await rank.read()


def assignment(address: str, epoch: int = 1) -> GroupAssignment:
    return GroupAssignment(group_id="g1", epoch=epoch, term=7, world_size=1, rendezvous_address="",
                           ranks=[RankInfo(0, "e0", address)], gateway_id="gw0")


async def wait_for(predicate, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def start_manager(cluster, make, serving=None, **kwargs) -> GroupManager:
    async def set_serving(is_serving):
        if serving is not None:
            serving.append(is_serving)

    return GroupManager(cluster, member_id="gw0", address="127.0.0.1:1", make_engine=make,
                        set_serving=set_serving, rank_call_timeout_s=5, **kwargs)


def make_from_infos(group, infos, streams):
    return make_engine(ranks=streams, num_blocks=infos[0].num_kv_blocks, block_size=infos[0].kv_block_size)[0]


def test_group_manager_serves_a_ready_group_and_fails_its_requests_once_it_is_gone_too_long():
    async def scenario():
        expert = await grpc_util.start_server(
            [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(FakeExpertService(), s)], [])
        address = f"127.0.0.1:{expert.port}"
        cluster, serving = FakeCluster(), []
        manager = start_manager(cluster, make_from_infos, serving, resume_timeout_s=0.5)
        task = asyncio.create_task(manager.run())
        try:
            await cluster.assignments.put(assignment(address))
            await wait_for(lambda: manager.engine is not None)
            engine = manager.engine
            outputs = await collect(engine.submit(make_request(prompt_ids=[30], max_new_tokens=3)))
            long_running = engine.submit(make_request(2, max_new_tokens=10_000))
            await long_running.__anext__()
            await cluster.assignments.put(None)                 # the group is removed
            await wait_for(lambda: serving[-1] is False)
            queued = manager.engine.submit(make_request(2))     # waits for a group meanwhile
            with pytest.raises(GenerationError) as gone:
                await collect(long_running)
            with pytest.raises(GenerationError):
                await collect(queued)
            assert manager.engine is None
            await cluster.assignments.put(assignment(address, epoch=2))   # the rank still runs epoch 1
            await asyncio.sleep(0.3)
            return cluster, serving, outputs, gone.value, manager.engine
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await expert.stop(0)

    cluster, serving, outputs, gone, engine_after = run(scenario())
    assert cluster.registered == [("gateway", "gw0", "127.0.0.1:1")]
    assert [t for o in outputs for t in o.token_ids] == reference_tokens([30], 3)
    assert gone.code is ErrorCode.UNAVAILABLE and "no worker group was ready again within 0.5 s" in gone.message
    assert serving[:2] == [True, False] and True not in serving[2:]
    assert engine_after is None


def test_a_group_whose_stream_broke_is_served_again_and_resumes_its_requests():
    async def scenario():
        expert = await grpc_util.start_server(
            [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(FakeExpertService(1), s)], [])
        cluster = FakeCluster()
        manager = start_manager(cluster, lambda group, infos, streams: make_engine(ranks=streams)[0])
        task = asyncio.create_task(manager.run())
        try:
            await cluster.assignments.put(assignment(f"127.0.0.1:{expert.port}"))
            await wait_for(lambda: manager.engine is not None)
            first = manager.engine
            outputs = await collect(first.submit(make_request(prompt_ids=[30, 31], max_new_tokens=5)))
            assert manager.engine is not first
            return outputs, manager.num_resumed_requests
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await expert.stop(0)

    outputs, num_resumed = run(scenario())
    assert [t for o in outputs for t in o.token_ids] == reference_tokens([30, 31], 5)
    assert num_resumed == 1


def test_requests_resume_on_the_re_formed_group_of_a_new_epoch():
    """A request mid-stream when the group is re-formed (epoch 1 -> 2) goes on on
    the new epoch's streams: every reference token once, none lost."""
    async def scenario():
        service = FakeExpertService()
        expert = await grpc_util.start_server(
            [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(service, s)], [])
        address = f"127.0.0.1:{expert.port}"
        cluster, serving = FakeCluster(), []
        manager = start_manager(cluster, make_from_infos, serving)
        task = asyncio.create_task(manager.run())
        try:
            await cluster.assignments.put(assignment(address))
            await wait_for(lambda: manager.engine is not None)
            handle = manager.engine.submit(make_request(prompt_ids=[33, 34, 35], max_new_tokens=100))
            first = [await handle.__anext__() for _ in range(3)]
            service.info.placement_epoch = 2                   # the rank rejoined in epoch 2
            await cluster.assignments.put(assignment(address, epoch=2))
            rest = await collect(handle)
            return first + rest, serving, manager.num_resumed_requests
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await expert.stop(0)

    outputs, serving, num_resumed = run(scenario())
    assert [t for o in outputs for t in o.token_ids] == reference_tokens([33, 34, 35], 100)
    assert serving[:3] == [True, False, True] and num_resumed == 1


def test_a_rank_of_another_epoch_is_rejected():
    info = status_from_proto(expert_pb2.GetRankInfoResponse(
        group_id="g1", rank=0, world_size=1, placement_epoch=1, num_kv_blocks=8, kv_block_size=4, is_ready=True))
    check_rank_info(assignment("x:1"), 0, info)
    with pytest.raises(GroupSetupError, match="epoch"):
        check_rank_info(assignment("x:1", epoch=2), 0, info)
    with pytest.raises(GroupSetupError, match="not ready"):
        check_rank_info(assignment("x:1"), 0, dataclasses.replace(info, is_ready=False))
