"""Log-probabilities through the gateway, over simulated ranks (tests/gateway/fakes.py's
fake_logprob): each message's logprobs are aligned with its token_ids (coalesced or not,
with stop strings, EOS and LENGTH), prompt logprobs come once on the first message, also
across chunked prefill, preemptions and a failover, and a request that asks for them takes no
cached prefix past the first one it lacks (none for all of them; prompt_logprobs_start's blocks
before it)."""

import asyncio
import dataclasses

import grpc
import pytest

from gateway.engine import GroupFailure
from gateway.requests import FinishReason, RequestOutput, merge_outputs
from moe.gateway.v1 import gateway_pb2
from services.step import LogprobSpec, TokenLogprob
from tests.gateway.fakes import EOS, SimRank, fake_logprob, fake_top, make_request, reference_tokens
from tests.gateway.test_engine import ABC_TEXT, Gateway, collect, make_engine, run

PROMPT = "abcdefghij"  # ids 26..35: the prompt a request is prefilled from


def check_message_logprobs(messages, prompt_len: int, num_top: int) -> None:
    """Every message's logprobs are its tokens' (fake_logprob at their positions), with num_top alternatives."""
    position = prompt_len
    for message in messages:
        assert [lp.token_id for lp in message.logprobs] == list(message.token_ids)
        for lp in message.logprobs:
            assert lp.logprob == pytest.approx(fake_logprob(position, lp.token_id), rel=1e-6)
            assert [(t.token_id, pytest.approx(t.logprob)) for t in lp.top] == list(fake_top(position, num_top))
            position += 1


def check_prompt_logprobs(messages, prompt_ids: list[int], num_top: int) -> None:
    """The first message carries one per prompt token after the first, the others none."""
    first = messages[0].prompt_logprobs
    assert [lp.token_id for lp in first] == prompt_ids[1:]
    assert [lp.logprob for lp in first] == pytest.approx([fake_logprob(p, t) for p, t in enumerate(prompt_ids)][1:])
    assert all(len(lp.top) == num_top for lp in first)
    assert not any(m.prompt_logprobs for m in messages[1:])


@pytest.mark.parametrize("coalesce", [True, False])
def test_logprobs_are_aligned_with_the_tokens_of_each_message(coalesce):
    stop = ABC_TEXT[5:7]

    async def scenario():
        async with Gateway(coalesce_outputs=coalesce) as gw:
            gw.attach(block_size=4, prefill_chunk_size=3)  # the prompt in four chunks
            asked = gateway_pb2.SamplingParams(max_new_tokens=8, top_logprobs=2, prompt_logprobs=True)
            length = await gw.generate(request_id="len", prompt=PROMPT, sampling=asked)
            stopped = await gw.generate(request_id="stop", prompt="abc", sampling=gateway_pb2.SamplingParams(
                max_new_tokens=10, stop=[stop], logprobs=True))
            plain = await gw.generate(request_id="plain", prompt="abc",
                                      sampling=gateway_pb2.SamplingParams(max_new_tokens=4))
            return length, stopped, plain

    length, stopped, plain = run(scenario())
    assert length[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    check_message_logprobs(length, 10, 2)
    check_prompt_logprobs(length, list(range(26, 36)), 2)
    assert sum(len(m.logprobs) for m in length) == 8
    # A stop string holds text back, never tokens: the tokens and their logprobs stay together.
    assert stopped[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    check_message_logprobs(stopped, 3, 0)
    assert sum(len(m.logprobs) for m in stopped) == sum(len(m.token_ids) for m in stopped) > 0
    assert not any(m.logprobs or m.prompt_logprobs for m in plain)


def test_an_eos_token_is_reported_with_its_logprob():
    async def scenario():
        engine, ranks = make_engine()
        task = asyncio.create_task(engine.run())
        request = dataclasses.replace(make_request(prompt_ids=[30, 31], max_new_tokens=50),
                                      logprobs=LogprobSpec(logprobs=True))
        real = ranks[0].run

        def eos_at_third(plan):  # the third sampled token of the sequence is EOS
            tokens = real(plan)
            for seq_id in tokens:
                if ranks[0].seqs[seq_id].num_computed == 4:
                    tokens[seq_id] = ranks[0].seqs[seq_id].pending = EOS
                    ranks[0].scored[-1] = (seq_id, 4, EOS)
            return tokens

        ranks[0].run = eos_at_third
        outputs = await collect(engine.submit(request))
        task.cancel()
        return outputs

    outputs = run(scenario())
    merged = merge_outputs(outputs)
    assert merged.finish_reason is FinishReason.STOP and merged.token_ids[-1] == EOS
    assert [lp.token_id for lp in merged.logprobs] == list(merged.token_ids)
    assert [lp.logprob for lp in merged.logprobs] == pytest.approx(
        [fake_logprob(2 + i, t) for i, t in enumerate(merged.token_ids)])


def test_merged_outputs_keep_logprobs_in_token_order_and_the_first_prompt_logprobs():
    def output(token_id, prompt=()):
        return RequestOutput("r", (token_id,), "x", 3, 1, logprobs=(TokenLogprob(token_id, -float(token_id)),),
                             prompt_logprobs=prompt)

    prompt = (TokenLogprob(5, -0.5), TokenLogprob(6, -0.25))
    merged = merge_outputs([output(1, prompt), output(2), output(3)])
    assert merged.token_ids == (1, 2, 3)
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.prompt_logprobs == prompt
    assert merge_outputs([output(2), output(3)]).prompt_logprobs == ()


def test_a_request_with_prompt_logprobs_takes_no_cached_prefix():
    async def scenario():
        async with Gateway() as gw:
            gw.attach(block_size=4)
            sampling = gateway_pb2.SamplingParams(max_new_tokens=3)
            await gw.generate(request_id="warm", prompt=PROMPT, sampling=sampling)
            scored = await gw.generate(request_id="scored", prompt=PROMPT, sampling=gateway_pb2.SamplingParams(
                max_new_tokens=3, prompt_logprobs=True))
            cached = await gw.generate(request_id="cached", prompt=PROMPT, sampling=sampling)
            return scored, cached

    scored, cached = run(scenario())
    assert scored[-1].usage.cached_tokens == 0
    check_prompt_logprobs(scored, list(range(26, 36)), 0)
    assert cached[-1].usage.cached_tokens == 9  # two full blocks and 1 of the third's 2 tokens (copied)


@pytest.mark.parametrize("fail_at_step", [2, 5])
def test_a_failover_sends_no_prompt_logprob_twice_and_keeps_the_tokens_aligned(fail_at_step):
    """The group fails while the prompt is prefilled (step 2) or decodes (step 5): the re-formed
    group re-prefills, and the client sees each prompt and generated logprob once, in order."""
    async def scenario():
        engine, _ = make_engine(ranks=[SimRank(64, 4, fail_at_step=fail_at_step)], prefill_chunk_size=4)
        task = asyncio.create_task(engine.run())
        request = dataclasses.replace(make_request(prompt_ids=list(range(26, 36)), max_new_tokens=6),
                                      logprobs=LogprobSpec(True, 1, True))
        collecting = asyncio.create_task(collect(engine.submit(request)))
        with pytest.raises(GroupFailure):
            await task
        resumed, new_ranks = make_engine(1)
        resumed.adopt(engine)
        resumed_task = asyncio.create_task(resumed.run())
        outputs = await collecting
        resumed_task.cancel()
        return outputs, new_ranks[0].plans[0].new_sequences[0]

    outputs, resumed_new = run(scenario())
    merged = merge_outputs(outputs)
    assert list(merged.token_ids) == reference_tokens(list(range(26, 36)), 6)
    assert [lp.token_id for lp in merged.logprobs] == list(merged.token_ids)
    assert [lp.logprob for lp in merged.logprobs] == pytest.approx(
        [fake_logprob(10 + i, t) for i, t in enumerate(merged.token_ids)])
    assert [lp.token_id for lp in outputs[0].prompt_logprobs] == list(range(27, 36))
    assert [lp.logprob for lp in outputs[0].prompt_logprobs] == pytest.approx(
        [fake_logprob(p, 26 + p) for p in range(1, 10)])
    assert not any(o.prompt_logprobs for o in outputs[1:])
    # Resumed after its prompt's logprobs were all in: the rank is not asked for them again.
    assert resumed_new.prompt_logprobs == (fail_at_step <= 3)


@pytest.mark.parametrize("sampling, field", [
    (gateway_pb2.SamplingParams(top_logprobs=21), "sampling.top_logprobs"),
    (gateway_pb2.SamplingParams(top_logprobs=100, logprobs=True), "sampling.top_logprobs"),
])
def test_bad_top_logprobs_are_invalid_argument_naming_the_field(sampling, field):
    async def scenario():
        async with Gateway() as gw:
            gw.attach()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await gw.generate(request_id="bad", prompt="abc", sampling=sampling)
            return bad.value

    bad = run(scenario())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.details().startswith(field)
    assert "20" in bad.details()


@pytest.mark.parametrize("num_blocks, len_a, new_a, len_b, chunk, mid_prefill", [
    (7, 10, 14, 10, 4, False),  # preempted after its first tokens: its prompt logprobs are in
    (6, 4, 16, 20, 8, True),    # preempted while its prompt is prefilled, several times
])
def test_a_preempted_request_keeps_its_logprobs_aligned_and_sends_its_prompt_logprobs_once(
        num_blocks, len_a, new_a, len_b, chunk, mid_prefill):
    """A pool too small for both requests: the newest is preempted and re-prefilled (a cached
    prefix only before the first prompt logprob it lacks); its client sees each logprob once, in order."""
    prompt_b = [26 + i % 26 for i in range(len_b)]

    async def scenario():
        engine, (rank,) = make_engine(num_blocks=num_blocks, block_size=4, prefill_chunk_size=chunk)
        task = asyncio.create_task(engine.run())
        first = engine.submit(make_request(prompt_ids=list(range(40, 40 + len_a)), max_new_tokens=new_a))
        asked = dataclasses.replace(make_request(prompt_ids=prompt_b, max_new_tokens=4, request_id="b"),
                                    logprobs=LogprobSpec(True, 2, True))
        outputs = await asyncio.gather(collect(first), collect(engine.submit(asked)))
        task.cancel()
        starts = [(n.prompt_logprobs, n.num_cached_tokens) for p in rank.plans for n in p.new_sequences
                  if n.seq_id == 2]
        return outputs[1], starts

    outputs, starts = run(scenario())
    # Asked for prompt logprobs exactly while they were missing; a re-prefill that still lacks some
    # may start from cached blocks (the rank scores from there: a position past them would go missing).
    assert len(starts) > 1 and starts[0] == (True, 0)
    assert starts[1][0] is mid_prefill
    merged = merge_outputs(outputs)
    assert list(merged.token_ids) == reference_tokens(prompt_b, 4)
    assert [lp.logprob for lp in merged.logprobs] == pytest.approx(
        [fake_logprob(len_b + i, t) for i, t in enumerate(merged.token_ids)])
    assert [lp.token_id for lp in merged.prompt_logprobs] == prompt_b[1:]
    assert [lp.logprob for lp in merged.prompt_logprobs] == pytest.approx(
        [fake_logprob(p, t) for p, t in enumerate(prompt_b)][1:])
    assert all(len(lp.top) == 2 for lp in (*merged.logprobs, *merged.prompt_logprobs))
    assert not any(o.prompt_logprobs for o in outputs[1:]) and merged.cached_tokens == 0


@pytest.mark.parametrize("start, num_cached", [(1, 0), (5, 4), (8, 7), (9, 8)])
def test_prompt_logprobs_start_scores_the_positions_from_it_on_a_cached_prefix_before_it(start, num_cached):
    """The prompt's first blocks are cached: a request scoring from `start` takes the cached tokens
    before position start - 1 (whose logits score token start) and reports exactly its positions,
    with the values a request scoring the whole prompt gets."""
    async def scenario():
        async with Gateway() as gw:
            gw.attach(block_size=4)
            await gw.generate(request_id="warm", prompt=PROMPT, sampling=gateway_pb2.SamplingParams(max_new_tokens=3))
            scored = await gw.generate(request_id="scored", prompt=PROMPT, sampling=gateway_pb2.SamplingParams(
                max_new_tokens=3, top_logprobs=1, prompt_logprobs=True, prompt_logprobs_start=start))
            full = await gw.generate(request_id="full", prompt=PROMPT, sampling=gateway_pb2.SamplingParams(
                max_new_tokens=3, top_logprobs=1, prompt_logprobs=True))
            return scored, full

    scored, full = run(scenario())
    assert scored[-1].usage.cached_tokens == num_cached and full[-1].usage.cached_tokens == 0
    prompt_ids = list(range(26, 36))
    assert [lp.token_id for lp in scored[0].prompt_logprobs] == prompt_ids[start:]
    assert list(scored[0].prompt_logprobs) == list(full[0].prompt_logprobs)[start - 1:]
    assert [lp.logprob for lp in scored[0].prompt_logprobs] == pytest.approx(
        [fake_logprob(p, prompt_ids[p]) for p in range(start, 10)])
    assert not any(m.prompt_logprobs for m in scored[1:])
    # The generated tokens and their logprobs are those of the full request.
    assert [t for m in scored for t in m.token_ids] == [t for m in full for t in m.token_ids]


@pytest.mark.parametrize("sampling, detail", [
    (gateway_pb2.SamplingParams(prompt_logprobs=True, prompt_logprobs_start=10), "below the prompt's length"),
    (gateway_pb2.SamplingParams(prompt_logprobs=True, prompt_logprobs_start=99), "got 99"),
    (gateway_pb2.SamplingParams(logprobs=True, prompt_logprobs_start=3), "needs sampling.prompt_logprobs"),
])
def test_a_bad_prompt_logprobs_start_is_invalid_argument_naming_the_field(sampling, detail):
    async def scenario():
        async with Gateway() as gw:
            gw.attach()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await gw.generate(request_id="bad", prompt=PROMPT, sampling=sampling)
            return bad.value

    bad = run(scenario())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details().startswith("sampling.prompt_logprobs_start") and detail in bad.details()
