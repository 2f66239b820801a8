"""The host side of a step at high concurrency (issue 8): the next plan is written
before the last step's outputs wake their streams, which are woken a batch per
event-loop turn; the request handle's queue; streams that fall behind send
their queued outputs as one message."""

import asyncio
import types

import grpc
import pytest

from gateway import engine as engine_module
from gateway.requests import ErrorCode, FinishReason, GenerationError, RequestHandle, RequestOutput, merge_outputs
from moe.expert.v1 import expert_pb2
from moe.gateway.v1 import gateway_pb2
from tests.gateway.fakes import FakeTokenizer, SimRank, make_request, reference_tokens
from tests.gateway.test_engine import Gateway, collect, make_engine, run


class RecordingRank(SimRank):
    """A SimRank that notes each plan write in a shared log."""

    def __init__(self, log: list, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    async def write(self, request) -> None:
        self.log.append(("write", request.plan.step_id))
        await super().write(request)


def test_the_next_plan_is_written_before_the_outputs_of_the_last_step_are_delivered():
    log: list = []

    async def scenario():
        engine, _ = make_engine(ranks=[RecordingRank(log, 64, 4)])
        loop_task = asyncio.create_task(engine.run())
        handle = engine.submit(make_request(prompt_ids=[30, 31], max_new_tokens=6))
        async for output in handle:
            log.append(("output", output.completion_tokens))
        loop_task.cancel()

    run(scenario())
    # Token n comes from step n; once it is applied, step n + 2 (which samples token
    # n + 2 <= 6) is planned, step n + 1 being in flight.
    for n in range(1, 5):
        assert log.index(("write", n + 2)) < log.index(("output", n)), log


def output(n: int, *, final: bool = False) -> RequestOutput:
    return RequestOutput("r", (n,), chr(ord("a") + n), 3, n, FinishReason.LENGTH if final else None)


def test_the_handle_yields_in_order_up_to_an_error_or_the_final_output():
    async def scenario():
        handle = RequestHandle(None)
        waiting = asyncio.ensure_future(anext(handle))
        await asyncio.sleep(0)
        handle.put(output(1))  # wakes the waiting consumer
        first = await waiting
        handle.put(output(2))
        handle.put(GenerationError(ErrorCode.UNAVAILABLE, "gone"))
        handle.put(output(3))  # after the error: dropped
        second = await anext(handle)
        with pytest.raises(GenerationError):
            await anext(handle)
        with pytest.raises(StopAsyncIteration):
            await anext(handle)

        done = RequestHandle(None)
        for n in (1, 2, 3):
            done.put(output(n, final=n == 3))
        done.put(output(4))  # after the final output: dropped
        rest = [o async for o in done]
        return first, second, rest

    first, second, rest = run(scenario())
    assert (first.token_ids, second.token_ids) == ((1,), (2,))
    assert [o.token_ids for o in rest] == [(1,), (2,), (3,)]


def test_streams_are_woken_a_batch_per_event_loop_turn():
    batch = engine_module._WAKE_BATCH

    async def scenario():
        engine, _ = make_engine(max_running_requests=3 * batch)
        handles = [engine.submit(make_request(request_id=f"r{i}")) for i in range(3 * batch)]
        consumers = [asyncio.ensure_future(anext(h)) for h in handles]
        await asyncio.sleep(0)  # every consumer waits
        waker = asyncio.create_task(engine._wake_streams())
        engine._deliver([(h.seq, output(1)) for h in handles], is_paced=True)
        num_done = []
        for _ in range(5):
            await asyncio.sleep(0)
            num_done.append(sum(c.done() for c in consumers))
        waker.cancel()
        return num_done

    num_done = run(scenario())
    assert num_done[0] <= batch and num_done[-1] == 3 * batch, num_done
    assert all(b - a <= batch for a, b in zip(num_done, num_done[1:])), num_done


def test_with_a_stream_interval_a_decoding_stream_is_woken_every_n_outputs():
    async def scenario():
        engine, _ = make_engine(stream_interval=3)
        handle = engine.submit(make_request(request_id="r"))
        due = []
        for n in range(1, 8):
            engine._deliver([(handle.seq, output(n, final=n == 7))], is_paced=True)
            due.append(bool(engine._to_wake))
            if engine._to_wake:  # the consumer takes what is queued
                engine._wake_next()
                first = await anext(handle)
                taken = [first, *handle.take_ready()]
                due[-1] = [o.token_ids[0] for o in taken]
        return due

    # The first output at once, then every third, then the last.
    assert run(scenario()) == [[1], False, False, [2, 3, 4], False, False, [5, 6, 7]]
    with pytest.raises(ValueError, match="stream_interval"):
        make_engine(stream_interval=0)


def test_with_a_stream_interval_streams_get_every_token_in_fewer_wakeups():
    prompts = [[26 + i, 27] for i in range(4)]

    async def scenario():
        engine, _ = make_engine(max_running_requests=4, stream_interval=4)
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.submit(make_request(prompt_ids=p, max_new_tokens=9, request_id=f"r{i}"))
                   for i, p in enumerate(prompts)]

        async def groups(handle):
            out = []
            async for first in handle:
                out.append([first, *handle.take_ready()])
            return out

        results = await asyncio.gather(*(groups(h) for h in handles))
        loop_task.cancel()
        return results

    for prompt, taken in zip(prompts, run(scenario())):
        assert [t for group in taken for o in group for t in o.token_ids] == reference_tokens(prompt, 9)
        # The fake ranks answer at once, so a consumer may find more queued than woke it; no group
        # between the first and the last is smaller than the interval.
        sizes = [len(group) for group in taken]
        assert all(size >= 4 for size in sizes[1:-1]) and len(sizes) <= 4, sizes


def test_many_concurrent_requests_get_every_token_once():
    prompts = [[26 + i % 26, 27 + i // 26] for i in range(3 * engine_module._WAKE_BATCH)]

    async def scenario():
        engine, (rank,) = make_engine(num_blocks=512, max_running_requests=len(prompts), max_batch_tokens=512)
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.submit(make_request(prompt_ids=p, max_new_tokens=5, request_id=f"r{i}"))
                   for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        loop_task.cancel()
        return results

    for prompt, outputs in zip(prompts, run(scenario())):
        assert [t for o in outputs for t in o.token_ids] == reference_tokens(prompt, 5)
        assert [o.finish_reason for o in outputs] == [None] * 4 + [FinishReason.LENGTH]


def test_take_ready_stops_before_an_error_and_after_the_final_output():
    async def scenario():
        handle = RequestHandle(None)
        for item in (output(1), output(2), GenerationError(ErrorCode.UNAVAILABLE, "gone")):
            handle.put(item)
        first, ready = await anext(handle), handle.take_ready()
        with pytest.raises(GenerationError):
            await anext(handle)
        done = RequestHandle(None)
        for n in (1, 2, 3):
            done.put(output(n, final=n == 3))
        return first, ready, await anext(done), done.take_ready(), done.take_ready()

    first, ready, head, rest, nothing = run(scenario())
    assert first.token_ids == (1,) and [o.token_ids for o in ready] == [(2,)]
    assert head.token_ids == (1,) and [o.token_ids for o in rest] == [(2,), (3,)] and nothing == []


def test_merged_outputs_keep_the_tokens_text_and_finish_of_the_last():
    merged = merge_outputs([output(1), output(2), output(3, final=True)])
    assert merged == RequestOutput("r", (1, 2, 3), "bcd", 3, 3, FinishReason.LENGTH)
    assert merge_outputs([output(5)]) == output(5)


class QueuedEngine:
    """An engine whose requests' outputs are all queued before the stream reads any."""

    def __init__(self, outputs):
        self._outputs = outputs

    def submit(self, request, deadline=None, leader=None):
        handle = RequestHandle(types.SimpleNamespace(seq_id=1))
        for item in self._outputs:
            handle.put(item)
        return handle

    def abort(self, handle) -> None:
        pass


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_stream_that_falls_behind_sends_its_queued_outputs_as_one_message(coalesce):
    async def scenario():
        async with Gateway(coalesce_outputs=coalesce) as gw:
            gw.engine = QueuedEngine([output(1), output(2), output(3, final=True)])
            return await gw.generate(request_id="r", prompt="abc")

    messages = run(scenario())
    if coalesce:
        assert [list(m.token_ids) for m in messages] == [[1, 2, 3]] and messages[0].text == "bcd"
    else:
        assert [list(m.token_ids) for m in messages] == [[1], [2], [3]]
    assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 3


def test_an_error_after_queued_outputs_reaches_the_client_after_them():
    async def scenario():
        async with Gateway() as gw:
            gw.engine = QueuedEngine([output(1), output(2), GenerationError(ErrorCode.UNAVAILABLE, "gone")])
            messages = []
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for message in gw.stub.Generate(gateway_pb2.GenerateRequest(request_id="r", prompt="ab"),
                                                      timeout=10):
                    messages.append(message)
            return messages, error.value

    messages, error = run(scenario())
    assert [list(m.token_ids) for m in messages] == [[1, 2]]
    assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "gone"


def test_coalesced_streams_carry_every_token_and_the_text_once():
    prompts = [[26 + i, 27, 28] for i in range(6)]

    async def scenario():
        async with Gateway() as gw:
            gw.attach(num_blocks=64, block_size=4, max_batch_tokens=64)
            return await asyncio.gather(*(gw.generate(
                request_id=f"r{i}", input_ids=gateway_pb2.TokenIds(ids=p),
                sampling=gateway_pb2.SamplingParams(max_new_tokens=12)) for i, p in enumerate(prompts)))

    for prompt, messages in zip(prompts, run(scenario())):
        token_ids = [t for m in messages for t in m.token_ids]
        assert token_ids == reference_tokens(prompt, 12) and all(m.token_ids for m in messages)
        assert "".join(m.text for m in messages) == FakeTokenizer().decode(token_ids)
        assert all(m.finish_reason == gateway_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
        assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert messages[-1].usage.completion_tokens == 12
