"""Abort by request id: the registry of live requests, and the Abort call over real gRPC."""

import asyncio

import grpc
import pytest

from gateway.live_requests import LiveRequests
from gateway.requests import FinishReason
from moe.gateway.v1 import gateway_pb2
from tests.gateway.fakes import FakeTokenizer, SimRank, make_request, reference_tokens
from tests.gateway.test_engine import Gateway, SlowRank, assert_pool_clean, collect, make_engine, run, wait_for


def forgotten_at(rank: SimRank, seq_id: int) -> list[int]:
    """The steps whose plan told the rank to forget seq_id."""
    return [p.step_id for p in rank.plans if seq_id in p.finished_seq_ids]


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_by_id_frees_the_blocks_at_the_next_step_and_leaves_the_others(overlap):
    async def scenario():
        engine, (rank,) = make_engine(ranks=[SlowRank(64, 4, delay_s=0.002)], overlap=overlap)
        live = LiveRequests()
        loop_task = asyncio.create_task(engine.run())
        long = engine.submit(make_request(6, max_new_tokens=500, request_id="long"))
        other = engine.submit(make_request(prompt_ids=[33, 34], max_new_tokens=20, request_id="other"))
        live.add("long", engine, long)
        live.add("other", engine, other)
        for _ in range(3):
            await long.__anext__()
        assert engine.batcher.ranks[0].num_available < engine.batcher.ranks[0].num_blocks
        num_aborted = live.abort("long")
        last_planned = engine.stats.num_steps     # the step ids are 1, 2, ...: the last one sent
        rest = await collect(long)
        other_outputs = await collect(other)
        await wait_for(lambda: not engine.batcher.has_work and rank.seqs == {})
        loop_task.cancel()
        return engine, rank, long, rest, other_outputs, num_aborted, last_planned, live

    engine, rank, long, rest, other_outputs, num_aborted, last_planned, live = run(scenario())
    assert num_aborted == 1
    assert rest[-1].finish_reason is FinishReason.ABORT and rest[-1].completion_tokens < 500
    # The next plan after the abort tells the rank to forget it: its blocks are free from that step on.
    assert forgotten_at(rank, long.seq.seq_id) == [last_planned + 1]
    assert [t for o in other_outputs for t in o.token_ids] == reference_tokens([33, 34], 20)
    assert other_outputs[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats.num_aborted == 1
    assert_pool_clean(engine, [rank])
    # Finished requests are not live: aborting them again finds nothing.
    assert live.abort("long") == 0 and live.abort("other") == 0


def test_live_requests_abort_every_request_sharing_an_id_and_forget_removed_ones():
    engine, _ = make_engine()
    live = LiveRequests()
    first, second, third = (engine.submit(make_request(2, request_id=rid)) for rid in ("dup", "dup", "solo"))
    for handle in (first, second, third):
        live.add(handle.seq.request_id, engine, handle)
    live.remove("solo", third)
    live.remove("solo", third)  # a second removal is a no-op
    assert len(live) == 2
    assert live.abort("solo") == 0
    assert live.abort("dup") == 2
    assert first.seq.is_aborted and second.seq.is_aborted and not third.seq.is_aborted
    live.remove("dup", first)
    live.remove("dup", second)
    assert len(live) == 0 and live.abort("dup") == 0


def test_the_abort_call_ends_the_stream_with_abort_and_refuses_unknown_and_empty_ids():
    async def scenario():
        async with Gateway() as gw:
            gw.engine, ranks = make_engine(ranks=[SlowRank(64, 4, delay_s=0.002)])
            gw.loop_task = asyncio.create_task(gw.engine.run())
            long = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="long", prompt="abcdef", sampling=gateway_pb2.SamplingParams(max_new_tokens=400)),
                timeout=10)
            other = asyncio.create_task(gw.generate(
                request_id="other", prompt="abc", sampling=gateway_pb2.SamplingParams(max_new_tokens=10)))
            first = await long.read()
            answer = await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="long"), timeout=5)
            long_rest = []
            while (response := await long.read()) is not grpc.aio.EOF:
                long_rest.append(response)
            other_responses = await other
            errors = {}
            for name, request_id in (("unknown", "nobody"), ("finished", "long"), ("empty", "")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gw.stub.Abort(gateway_pb2.AbortRequest(request_id=request_id), timeout=5)
                errors[name] = err.value
            await wait_for(lambda: not gw.engine.batcher.has_work and ranks[0].seqs == {})
            return gw.engine, ranks, answer, [first, *long_rest], other_responses, errors

    engine, ranks, answer, long, other, errors = run(scenario())
    assert answer.num_aborted == 1
    assert long[-1].finish_reason == gateway_pb2.FINISH_REASON_ABORT
    assert long[-1].usage.prompt_tokens == 6 and 0 < long[-1].usage.completion_tokens < 400
    assert long[-1].usage.completion_tokens == sum(len(r.token_ids) for r in long)
    assert [t for r in other for t in r.token_ids] == reference_tokens(FakeTokenizer().encode("abc"), 10)
    assert other[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert errors["unknown"].code() == grpc.StatusCode.NOT_FOUND and "'nobody'" in errors["unknown"].details()
    assert errors["finished"].code() == grpc.StatusCode.NOT_FOUND
    assert errors["empty"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in errors["empty"].details()
    assert_pool_clean(engine, ranks)



def test_with_owners_abort_ends_only_the_owners_requests():
    engine, _ = make_engine()
    live = LiveRequests()
    mine, theirs = (engine.submit(make_request(2, request_id="same")) for _ in range(2))
    live.add("same", engine, mine, "alice")
    live.add("same", engine, theirs, "bob")
    assert live.abort("same", "mallory") == 0 and live.abort("same") == 0  # no key: not an owner
    assert not mine.seq.is_aborted and not theirs.seq.is_aborted
    assert live.abort("same", "alice") == 1
    assert mine.seq.is_aborted and not theirs.seq.is_aborted
