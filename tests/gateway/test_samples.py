"""n samples of one request: the fan-out (seeds, merging per sample), their
placement with the prompt prefilled once (batcher on simulated ranks), and
the servicer's stream of all samples with abort, cancellation and deadlines."""

import asyncio
import collections
import dataclasses

import grpc
import pytest

from gateway.observability import EngineObserver
from gateway.requests import FinishReason, RequestOutput, Sequence, merge_outputs
from gateway.samples import coalesce, sample_requests
from moe.gateway.v1 import gateway_pb2
from services import metrics
from services.step import LogprobSpec
from services.text import IncrementalDetokenizer
from tests.gateway.fakes import FakeTokenizer, SimRank, make_request, reference_tokens
from tests.gateway.test_engine import Gateway, SlowRank, assert_pool_clean, make_engine, run, wait_for
from tests.gateway.test_scheduling import Sim, prompt


def output(index: int, token_ids, *, final=False) -> RequestOutput:
    return RequestOutput(request_id="r", token_ids=tuple(token_ids), text="".join(map(str, token_ids)),
                         prompt_tokens=4, completion_tokens=len(token_ids),
                         finish_reason=FinishReason.LENGTH if final else None, index=index)


def test_sample_i_draws_with_seed_plus_i_wrapping_at_2_to_the_64():
    request = dataclasses.replace(make_request(), n=3)
    request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=2**64 - 2))
    samples = sample_requests(request)
    assert [s.sampling.seed for s in samples] == [2**64 - 2, 2**64 - 1, 0]
    assert all(s.n == 1 and s.prompt_ids == request.prompt_ids and s.request_id == "r" for s in samples)
    single = make_request()
    assert sample_requests(single) == [single]


def test_only_the_first_sample_scores_the_prompt_so_the_others_can_share_it():
    request = dataclasses.replace(make_request(), n=3,
                                  logprobs=LogprobSpec(logprobs=True, top_logprobs=2, prompt_logprobs=True))
    samples = sample_requests(request)
    assert [s.logprobs.prompt_logprobs for s in samples] == [True, False, False]
    assert all(s.logprobs.logprobs and s.logprobs.top_logprobs == 2 for s in samples)


def test_coalescing_merges_each_sample_on_its_own_and_never_two_samples():
    merged = coalesce([output(0, [1]), output(1, [2]), output(0, [3]), output(1, [4], final=True)])
    assert [(o.index, o.token_ids, o.is_final) for o in merged] == [(0, (1, 3), False), (1, (2, 4), True)]
    with pytest.raises(AssertionError, match="different samples"):
        merge_outputs([output(0, [1]), output(1, [2])])


class SampleSim(Sim):
    """Sim with requests of n samples: the later ones led by the first (as the Frontend submits them)."""

    def add_samples(self, prompt_ids, max_new_tokens, n, **request_fields):
        """n samples of one request (request_fields: ValidatedRequest's, beside the defaults)."""
        request = dataclasses.replace(make_request(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                                   ignore_eos=True), **request_fields)
        seqs = []
        for i in range(n):
            seq = Sequence(self.batcher.new_seq_id(), request, IncrementalDetokenizer(FakeTokenizer()),
                           leader=seqs[0] if seqs else None)
            self.batcher.add(seq)
            seqs.append(seq)
        return seqs


@pytest.mark.parametrize("depth", [1, 2])
def test_samples_prefill_the_prompt_once_on_the_first_samples_rank_whatever_the_load(depth):
    # Two idle ranks and a running cap whose affinity slack (1) would spread the samples:
    # they stay on the rank of the first one, which alone computes the prompt (3 chunks).
    sim = SampleSim(num_ranks=2, depth=depth, block_size=4, prefill_chunk_size=8, max_running_requests=8)
    num_prompt, num_new, n = 21, 3, 4
    seqs = sim.add_samples(prompt(num_prompt), num_new, n)
    sim.run()
    for seq in seqs:
        sim.assert_reference(seq, num_new)
    ranks = {p.rank for b in sim.batches for p in b.plans for s in p.new_sequences}
    assert len(ranks) == 1
    # The prompt once, then per later sample only its last token (the last block is not full).
    num_cached = (num_prompt - 1) // 4 * 4
    assert sum(r.num_tokens_computed for r in sim.ranks) == num_prompt + (n - 1) * (num_prompt - num_cached) \
        + n * (num_new - 1)
    assert [sim.final[s.seq_id].cached_tokens for s in seqs] == [0] + [num_cached] * (n - 1)
    assert sim.batcher.stats.num_cached_prompt_tokens == (n - 1) * num_cached


def test_samples_of_a_first_sample_that_finished_already_still_reuse_its_cached_prompt():
    sim = SampleSim(block_size=4)
    seqs = sim.add_samples(prompt(9), 1, 3)
    sim.run()
    assert [sim.final[s.seq_id].cached_tokens for s in seqs] == [0, 8, 8]
    for seq in seqs:
        sim.assert_reference(seq, 1)


def sampled(**kwargs) -> gateway_pb2.SamplingParams:
    return gateway_pb2.SamplingParams(temperature=0.7, **kwargs)


def by_index(responses) -> dict[int, list]:
    grouped = collections.defaultdict(list)
    for response in responses:
        grouped[response.index].append(response)
    return grouped


def attach(gw: Gateway, **kwargs) -> list[SimRank]:
    """Starts an engine over simulated ranks in the gateway; the ranks."""
    gw.engine, ranks = make_engine(**kwargs)
    gw.loop_task = asyncio.create_task(gw.engine.run())
    return ranks


def start_long_samples(gw: Gateway, request_id: str, n: int, *, delay_s=0.005, timeout=10.0):
    """A call for n samples of 450 tokens on one slow simulated rank: (call, ranks)."""
    ranks = attach(gw, ranks=[SlowRank(64, 4, delay_s=delay_s)])
    call = gw.stub.Generate(gateway_pb2.GenerateRequest(
        request_id=request_id, prompt="abcdef", sampling=sampled(n=n, max_new_tokens=450)), timeout=timeout)
    return call, ranks


async def wait_drained(gw: Gateway, ranks: list[SimRank]) -> None:
    """Until no request is left in the engine, its batcher or the rank."""
    await wait_for(lambda: gw.engine.num_active == 0 and not gw.engine.batcher.has_work and ranks[0].seqs == {})


def test_a_request_for_n_samples_streams_each_with_its_index_seed_usage_and_finish():
    async def scenario():
        async with Gateway(coalesce_outputs=False) as gw:
            ranks = attach(gw, block_size=4)
            responses = await gw.generate(request_id="n", prompt="abcdefghij", sampling=sampled(
                n=3, seed=7, max_new_tokens=4))
            return gw.engine, ranks, responses

    engine, ranks, responses = run(scenario())
    samples = by_index(responses)
    assert sorted(samples) == [0, 1, 2]
    expected = reference_tokens(FakeTokenizer().encode("abcdefghij"), 4)
    for index, messages in samples.items():
        assert [t for m in messages for t in m.token_ids] == expected
        assert [m.finish_reason for m in messages] == [gateway_pb2.FINISH_REASON_UNSPECIFIED] * 3 + [
            gateway_pb2.FINISH_REASON_LENGTH]
        usage = messages[-1].usage
        # A later sample: two full blocks of the first's prompt shared, its third block's first token copied.
        assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (10, 4, 9 if index else 0)
        assert all(m.request_id == "n" for m in messages)
    assert sorted(new.sampling.seed for plan in ranks[0].plans for new in plan.new_sequences) == [7, 8, 9]
    # The prompt once, then the last prompt token of each later sample; 3 decodes each.
    assert ranks[0].num_tokens_computed == 10 + 2 * 1 + 3 * 3
    assert ranks[0].num_block_copies == 2
    assert_pool_clean(engine, ranks)


def test_the_call_is_observed_through_its_first_sample_and_forgotten_after_it():
    async def scenario():
        async with Gateway() as gw:
            ranks = [SimRank(64, 4)]
            gw.engine, _ = make_engine(ranks=ranks)
            observer = gw.engine._observer = EngineObserver(1)
            gw.loop_task = asyncio.create_task(gw.engine.run())
            before = metrics.gateway_metrics().prompt_tokens._value.get()
            responses = await gw.generate(request_id="o", prompt="abcdefgh", sampling=sampled(n=3, max_new_tokens=2))
            return observer, responses, metrics.gateway_metrics().prompt_tokens._value.get() - before

    observer, responses, num_prompt_tokens = run(scenario())
    assert sorted({r.index for r in responses}) == [0, 1, 2]
    assert num_prompt_tokens == 8  # one prompt, shared by the samples
    assert observer._requests == {} and observer._traced == {}


def test_abort_ends_every_sample_with_abort_and_frees_their_blocks():
    async def scenario():
        async with Gateway() as gw:
            call, ranks = start_long_samples(gw, "a", 3)
            first = await call.read()
            await wait_for(lambda: gw.engine.num_active == 3 and not gw.engine.batcher.num_waiting)
            answer = await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="a"), timeout=5)
            rest = [first]
            while (response := await call.read()) is not grpc.aio.EOF:
                rest.append(response)
            await wait_drained(gw, ranks)
            return gw.engine, ranks, answer, rest

    engine, ranks, answer, responses = run(scenario())
    assert answer.num_aborted == 3
    samples = by_index(responses)
    assert sorted(samples) == [0, 1, 2]
    for messages in samples.values():
        assert [m.finish_reason for m in messages].count(gateway_pb2.FINISH_REASON_ABORT) == 1
        assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_ABORT
        assert messages[-1].usage.completion_tokens == sum(len(m.token_ids) for m in messages) < 450
    assert engine.stats.num_aborted == 3
    assert_pool_clean(engine, ranks)


def test_a_client_that_goes_away_ends_every_sample():
    async def scenario():
        async with Gateway() as gw:
            call, ranks = start_long_samples(gw, "c", 4)
            await call.read()
            await wait_for(lambda: gw.engine.num_active == 4 and not gw.engine.batcher.num_waiting)
            call.cancel()
            await wait_drained(gw, ranks)
            with pytest.raises(grpc.aio.AioRpcError) as not_live:
                await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="c"), timeout=5)
            return gw.engine, ranks, not_live.value

    engine, ranks, not_live = run(scenario())
    assert not_live.code() == grpc.StatusCode.NOT_FOUND
    assert engine.stats.num_aborted == 4
    assert_pool_clean(engine, ranks)


def test_a_failing_sample_ends_the_call_with_its_error_and_frees_every_sample():
    async def scenario():
        async with Gateway() as gw:
            call, ranks = start_long_samples(gw, "d", 2, delay_s=0.01, timeout=0.3)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            await wait_drained(gw, ranks)
            return gw.engine, ranks, err.value

    engine, ranks, err = run(scenario())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_pool_clean(engine, ranks)


def test_too_many_or_greedy_samples_are_refused_naming_sampling_n():
    async def scenario():
        async with Gateway() as gw:
            attach(gw)
            errors = []
            for sampling in (sampled(n=17), gateway_pb2.SamplingParams(n=2)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gw.generate(request_id="bad", prompt="abc", sampling=sampling)
                errors.append(err.value)
            return errors

    for error in run(scenario()):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("sampling.n ")
