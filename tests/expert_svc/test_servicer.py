"""ExpertService over real gRPC (port 0, no etcd): streams of step plans, status codes,
GetRankInfo, the hit counts that reach a (fake) router, and pipelined steps."""

import asyncio
import concurrent.futures
import dataclasses
import threading

import grpc
import pytest
import torch

from tests.conftest import hf_greedy
from expert_svc.executor import StepExecutor
from expert_svc.runner import StepRunner
from expert_svc.state import RankState
from expert_svc.servicer import ExpertServicer
from expert_svc.router_client import RouterClient
from expert_svc.stats_reporter import StatsReporter
from moe.expert.v1 import expert_pb2 as pb
from moe.expert.v1 import expert_pb2_grpc
from moe.router.v1 import router_pb2, router_pb2_grpc
from services import grpc_util
from services.kv_pool import KVPool
from services.model.checkpoint import load_weights
from tests.expert_svc.conftest import SMALL
from services.model.qwen3_moe import Qwen3MoeModel

BLOCK_SIZE, NUM_BLOCKS = 16, 32
GROUP, EPOCH = "g7", 2
GREEDY = pb.SequenceSampling(temperature=0.0, top_p=1.0)
PROMPTS = {10: [5, 17, 300, 42, 7, 9, 511, 0, 64], 11: [100, 200, 300]}
NUM_DECODE_STEPS = 5






@pytest.fixture(scope="module")
def model(small_model_dir):
    experts = range(SMALL.num_experts)
    return Qwen3MoeModel(SMALL, load_weights(small_model_dir, SMALL, experts), expert_ids=experts)


@pytest.fixture(scope="module")
def expected(hf_small):
    return {seq_id: hf_greedy(hf_small, prompt, 1 + NUM_DECODE_STEPS) for seq_id, prompt in PROMPTS.items()}


@pytest.fixture()
def thread():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    yield pool
    pool.shutdown()


@pytest.fixture()
def reader():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-reader")
    yield pool
    pool.shutdown()


class LaunchAheadRunner(StepRunner):
    """Pipelines on the CPU as on CUDA: a launched step's tokens count as still on the
    device until the next step is launched (or 0.5 s have passed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_launches = 0
        self.num_read_after_next_launch = 0
        self.launched = threading.Condition()

    def launch(self, plan):
        step = super().launch(plan)
        with self.launched:
            self.num_launches += 1
            self.launched.notify_all()
        return dataclasses.replace(step, ready=_UntilNextLaunch(self, self.num_launches))


@dataclasses.dataclass
class _UntilNextLaunch:
    """The stand-in CUDA event of a LaunchAheadRunner's step."""

    runner: LaunchAheadRunner
    num_launches: int

    def synchronize(self) -> None:
        with self.runner.launched:
            if self.runner.launched.wait_for(lambda: self.runner.num_launches > self.num_launches, 0.5):
                self.runner.num_read_after_next_launch += 1


def make_state(model, thread, after_step=None, reader=None) -> RankState:
    """A ready rank on `model`; pipelined (with a LaunchAheadRunner) when a reader thread is given."""
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    runner = (StepRunner if reader is None else LaunchAheadRunner)(
        model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, group_id=GROUP, placement_epoch=EPOCH)
    return RankState(member_id="e0", model_name="small", group_id=GROUP, rank=0, world_size=1,
                     placement_epoch=EPOCH, expert_ids=tuple(range(SMALL.num_experts)),
                     num_kv_blocks=NUM_BLOCKS, kv_block_size=BLOCK_SIZE,
                     executor=StepExecutor(runner, thread, after_step, reader=reader))


async def serve(state: RankState, fn):
    """Runs fn(stub) against the servicer on a port-0 server."""
    server = await grpc_util.start_server(
        [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(ExpertServicer(state), s)],
        ["moe.expert.v1.ExpertService"])
    try:
        async with grpc_util.channel(f"127.0.0.1:{server.port}") as channel:
            return await fn(expert_pb2_grpc.ExpertServiceStub(channel))
    finally:
        await server.stop(0)


def plans(epoch=EPOCH, sampling=GREEDY):
    """Prefill both prompts (one block each), decode NUM_DECODE_STEPS steps, an idle step, finish."""
    yield pb.StepPlan(
        step_id=1, group_id=GROUP, placement_epoch=epoch,
        new_sequences=[pb.NewSequence(seq_id=i, sampling=sampling, block_ids=[i]) for i in PROMPTS],
        scheduled=[pb.ScheduledSequence(seq_id=i, token_ids=p, is_sampled=True) for i, p in PROMPTS.items()])
    for step_id in range(2, 2 + NUM_DECODE_STEPS):
        yield pb.StepPlan(step_id=step_id, group_id=GROUP, placement_epoch=epoch,
                          scheduled=[pb.ScheduledSequence(seq_id=i, is_sampled=True) for i in PROMPTS])
    yield pb.StepPlan(step_id=2 + NUM_DECODE_STEPS, group_id=GROUP, placement_epoch=epoch)
    yield pb.StepPlan(step_id=3 + NUM_DECODE_STEPS, group_id=GROUP, placement_epoch=epoch,
                      finished_seq_ids=list(PROMPTS))


async def run_stream(stub, step_plans) -> list[pb.StepResult]:
    """Plan, wait for the result, plan again: as the gateway drives a rank."""
    call = stub.ExecuteSteps(timeout=30)
    results = []
    for plan in step_plans:
        await call.write(pb.ExecuteStepsRequest(plan=plan))
        results.append((await call.read()).result)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return results


async def run_stream_ahead(stub, step_plans) -> list[pb.StepResult]:
    """Plan k+1 sent before result k is read, as the gateway overlaps (two plans unanswered at most)."""
    call = stub.ExecuteSteps(timeout=30)
    results, step_plans = [], list(step_plans)
    await call.write(pb.ExecuteStepsRequest(plan=step_plans[0]))
    for plan in step_plans[1:]:
        await call.write(pb.ExecuteStepsRequest(plan=plan))
        results.append((await call.read()).result)
    results.append((await call.read()).result)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return results


def test_stream_of_plans_gives_the_reference_tokens(model, thread, expected):
    state = make_state(model, thread)
    results = asyncio.run(serve(state, lambda stub: run_stream(stub, plans())))
    assert [r.step_id for r in results] == list(range(1, 4 + NUM_DECODE_STEPS))
    got = {seq_id: [] for seq_id in PROMPTS}
    for r in results:
        assert r.execute_seconds > 0
        for token in r.tokens:
            got[token.seq_id].append(token.token_id)
    assert got == expected
    assert results[-2].tokens == [] and results[-1].tokens == []  # the idle step, the finish
    assert state.executor.runner.seq_ids == []


def test_plan_of_another_epoch_fails_the_stream_and_the_next_stream_starts_clean(model, thread, expected):
    state = make_state(model, thread)

    async def scenario(stub):
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await run_stream(stub, [*list(plans())[:2], pb.StepPlan(step_id=3, group_id=GROUP,
                                                                     placement_epoch=EPOCH + 1)])
        # The failed stream's sequences are gone: the same plans from step 1 work again.
        return stale.value, await run_stream(stub, plans())

    error, results = asyncio.run(serve(state, scenario))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"epoch {EPOCH + 1}" in error.details()
    assert [t.token_id for r in results for t in r.tokens if t.seq_id == 10] == expected[10]


def test_bad_plan_is_invalid_argument_naming_the_sequence(model, thread):
    state = make_state(model, thread)
    bad = pb.StepPlan(step_id=1, group_id=GROUP, placement_epoch=EPOCH,
                      scheduled=[pb.ScheduledSequence(seq_id=99, token_ids=[1], is_sampled=True)])
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(serve(state, lambda stub: run_stream(stub, [bad])))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 99" in error.value.details()


def test_second_stream_is_refused_while_one_is_open(model, thread):
    state = make_state(model, thread)

    async def scenario(stub):
        first = stub.ExecuteSteps(timeout=30)
        await first.write(pb.ExecuteStepsRequest(plan=next(plans())))
        assert len((await first.read()).result.tokens) == len(PROMPTS)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ExecuteSteps(timeout=30).read()
        await first.done_writing()
        assert await first.read() is grpc.aio.EOF
        return error.value

    error = asyncio.run(serve(state, scenario))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_rank_info_before_and_after_ready(model, thread):
    state = RankState(member_id="e3", model_name="small")

    async def scenario(stub):
        before = await stub.GetRankInfo(pb.GetRankInfoRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as not_ready:
            await run_stream(stub, plans())
        ready = make_state(model, thread)
        for field in dataclasses.fields(RankState):
            setattr(state, field.name, getattr(ready, field.name))
        return before, not_ready.value, await stub.GetRankInfo(pb.GetRankInfoRequest(), timeout=5)

    before, not_ready, after = asyncio.run(serve(state, scenario))
    assert (before.member_id, before.is_ready, before.group_id, before.model_name) == ("e3", False, "", "small")
    assert not_ready.code() == grpc.StatusCode.UNAVAILABLE
    assert after.is_ready and after.member_id == "e0"
    assert (after.group_id, after.rank, after.world_size, after.placement_epoch) == (GROUP, 0, 1, EPOCH)
    assert list(after.expert_ids) == list(range(SMALL.num_experts))
    assert (after.num_kv_blocks, after.kv_block_size) == (NUM_BLOCKS, BLOCK_SIZE)


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self):
        self.reports: list[router_pb2.ReportExpertHitsRequest] = []

    async def ReportExpertHits(self, request, context):
        self.reports.append(request)
        return router_pb2.ReportExpertHitsResponse()


@pytest.mark.parametrize("is_pipelined", [False, True])
def test_hit_counts_reach_the_router_every_n_steps(model, thread, reader, is_pipelined):
    """Pipelined, each step's hits are read right after its launch: the reports hold the same steps."""
    router = FakeRouter()

    async def scenario():
        router_server = await grpc_util.start_server(
            [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(router, s)], [])

        async def resolve():
            return f"127.0.0.1:{router_server.port}"

        client = RouterClient(resolve, group_id=GROUP, rank=0, moe_layers=SMALL.moe_layers, deadline_s=5)
        reporter = StatsReporter(model.hit_counts_LE, SMALL.moe_layers, every_steps=3, router=client,
                                 loop=asyncio.get_running_loop())
        state = make_state(model, thread, reporter.after_step, reader if is_pipelined else None)
        await serve(state, lambda stub: (run_stream_ahead if is_pipelined else run_stream)(stub, plans()))
        for _ in range(100):
            if reporter.num_sent == 2:
                break
            await asyncio.sleep(0.02)
        await reporter.close()
        await router_server.stop(0)

    asyncio.run(scenario())
    # 8 steps, a report every 3: steps 1-3 (prefill + 2 decodes) and 4-6 (3 decodes).
    assert [(r.first_step_id, r.last_step_id) for r in router.reports] == [(1, 3), (4, 6)]
    tokens = [sum(map(len, PROMPTS.values())) + 2 * len(PROMPTS), 3 * len(PROMPTS)]
    for report, num_tokens in zip(router.reports, tokens):
        assert (report.group_id, report.rank) == (GROUP, 0)
        assert [layer.layer for layer in report.layers] == SMALL.moe_layers
        assert all(sum(layer.counts) == num_tokens * SMALL.num_experts_per_tok for layer in report.layers)
        assert all(len(layer.counts) == SMALL.num_experts for layer in report.layers)


def _tokens(results) -> list[list[tuple[int, int]]]:
    return [[(t.seq_id, t.token_id) for t in r.tokens] for r in results]


def test_pipelined_steps_give_the_tokens_of_unpipelined_ones(model, thread, reader, expected):
    drawn = pb.SequenceSampling(temperature=0.8, top_p=0.9, top_k=40, seed=3)
    got = {}
    for mode, pool in (("pipelined", reader), ("one by one", None)):
        state = make_state(model, thread, reader=pool)
        for sampling in (GREEDY, drawn):
            results = asyncio.run(serve(state, lambda stub: run_stream_ahead(stub, plans(sampling=sampling))))
            assert [r.step_id for r in results] == list(range(1, 4 + NUM_DECODE_STEPS))
            got[mode, sampling.seed] = _tokens(results)
        if pool is not None:  # decode steps were launched while the step before still "ran"
            assert state.executor.runner.num_read_after_next_launch >= NUM_DECODE_STEPS
    assert got["pipelined", 0] == got["one by one", 0]
    assert got["pipelined", 3] == got["one by one", 3] != got["pipelined", 0]
    assert [t for step in got["pipelined", 0] for s, t in step if s == 10] == expected[10]


def test_a_bad_plan_behind_a_running_step_is_invalid_argument_after_its_result(model, thread, reader):
    state = make_state(model, thread, reader=reader)
    bad = pb.StepPlan(step_id=3, group_id=GROUP, placement_epoch=EPOCH,
                      scheduled=[pb.ScheduledSequence(seq_id=99, is_sampled=True)])

    async def scenario(stub):
        call = stub.ExecuteSteps(timeout=30)
        for plan in [*list(plans())[:2], bad]:
            await call.write(pb.ExecuteStepsRequest(plan=plan))
        results = [(await call.read()).result for _ in range(2)]
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        return results, error.value

    results, error = asyncio.run(serve(state, scenario))
    assert [r.step_id for r in results] == [1, 2] and all(len(r.tokens) == len(PROMPTS) for r in results)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "step 3: scheduled sequence 99 is unknown"
