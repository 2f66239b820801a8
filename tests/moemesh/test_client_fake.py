"""moemesh.Client and AsyncClient against an in-process fake gateway that scripts each attempt.

What a real mesh cannot be made to do on cue: fail a call with UNAVAILABLE
before or after its first message, record the metadata it received, and
answer with logprobs and n samples (served by the gateway's own code in
other tests). Each test checks what the client sent, how often, and what it
handed its caller.
"""

import asyncio
import threading

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import moemesh
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh.client_retry import RetryPolicy
from services import telemetry

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def message(index=0, token_ids=(), text="", finish=0, usage=None, **fields) -> gateway_pb2.GenerateResponse:
    response = gateway_pb2.GenerateResponse(request_id="fake", index=index, token_ids=token_ids, text=text,
                                            finish_reason=finish, **fields)
    if usage is not None:
        response.usage.CopyFrom(gateway_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1],
                                                  cached_tokens=usage[2]))
    return response


OK_STREAM = ([message(token_ids=[5, 6], text="ab"),
              message(token_ids=[7], text="c", finish=gateway_pb2.FINISH_REASON_LENGTH, usage=(4, 3, 0))], None)


class FakeGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Attempt i of Generate plays plan[i] (the last one again after that): its messages, then its error code."""

    def __init__(self, plan, tokenize_codes=()):
        self.plan = plan
        self.tokenize_codes = list(tokenize_codes)
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.metadata: list[tuple] = []
        self.num_tokenize = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(tuple(context.invocation_metadata()))
        responses, code = self.plan[min(len(self.requests), len(self.plan)) - 1]
        for response in responses:
            yield response
        if code is not None:
            await context.abort(code, f"fake {code.name} after {len(responses)} message(s)")

    async def Tokenize(self, request, context):
        self.num_tokenize += 1
        self.metadata.append(tuple(context.invocation_metadata()))
        if self.tokenize_codes:
            code = self.tokenize_codes.pop(0)
            if code is not None:
                await context.abort(code, "fake tokenize failure")
        return gateway_pb2.TokenizeResponse(token_ids=[len(request.text)])


@pytest.fixture
def serve():
    """serve(fake) -> its address: a grpc.aio server on its own event loop thread, stopped after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = []

    def start(fake: FakeGateway) -> str:
        async def run():
            server = grpc.aio.server()
            gateway_pb2_grpc.add_GenerationServiceServicer_to_server(fake, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            return f"127.0.0.1:{port}"
        return asyncio.run_coroutine_threadsafe(run(), loop).result(10)

    yield start
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_unavailable_before_the_first_token_is_retried(serve):
    fake = FakeGateway([([], UNAVAILABLE), ([], UNAVAILABLE), OK_STREAM])
    with moemesh.Client(serve(fake), retry=FAST_RETRY, timeout=10) as client:
        result = client.generate("hi", max_new_tokens=3, request_id="r1")
    assert len(fake.requests) == 3
    assert all(r == fake.requests[0] for r in fake.requests) and fake.requests[0].request_id == "r1"
    assert (result.text, result.token_ids, result.finish_reason) == ("abc", (5, 6, 7), "length")
    assert result.usage == moemesh.Usage(4, 3, 0)


def test_retries_are_bounded_and_the_last_error_is_raised(serve):
    fake = FakeGateway([([], UNAVAILABLE)])
    with moemesh.Client(serve(fake), retry=FAST_RETRY, timeout=10) as client:
        with pytest.raises(moemesh.UnavailableError) as err:
            client.generate("hi")
    assert len(fake.requests) == FAST_RETRY.max_attempts
    assert err.value.code == UNAVAILABLE and not err.value.after_first_token
    assert "fake UNAVAILABLE" in err.value.details


def test_unavailable_after_the_first_token_is_raised_not_retried(serve):
    fake = FakeGateway([([message(token_ids=[5], text="a")], UNAVAILABLE)])
    with moemesh.Client(serve(fake), retry=FAST_RETRY, timeout=10) as client:
        chunks = []
        with pytest.raises(moemesh.UnavailableError) as err:
            for chunk in client.stream("hi"):
                chunks.append(chunk)
        with pytest.raises(moemesh.UnavailableError):
            client.generate("hi")
    assert [c.token_ids for c in chunks] == [(5,)]
    assert err.value.after_first_token
    assert len(fake.requests) == 2  # one per call: neither was restarted


def test_other_codes_are_not_retried(serve):
    fake = FakeGateway([([], grpc.StatusCode.RESOURCE_EXHAUSTED), OK_STREAM])
    with moemesh.Client(serve(fake), retry=FAST_RETRY, timeout=10) as client:
        with pytest.raises(moemesh.ResourceExhaustedError):
            client.generate("hi")
    assert len(fake.requests) == 1


def test_unary_calls_are_retried_on_unavailable_only(serve):
    fake = FakeGateway([OK_STREAM], tokenize_codes=[UNAVAILABLE, None, grpc.StatusCode.INTERNAL])
    with moemesh.Client(serve(fake), retry=FAST_RETRY, timeout=10) as client:
        assert client.tokenize("four") == [4]
        assert fake.num_tokenize == 2
        with pytest.raises(moemesh.MoemeshError) as err:
            client.tokenize("four")
    assert fake.num_tokenize == 3 and err.value.code == grpc.StatusCode.INTERNAL
    assert type(err.value) is moemesh.MoemeshError


def test_the_async_client_retries_before_the_first_token_only(serve):
    retried = FakeGateway([([], UNAVAILABLE), OK_STREAM])
    broken = FakeGateway([([message(token_ids=[5], text="a")], UNAVAILABLE), OK_STREAM])

    async def run():
        async with moemesh.AsyncClient(serve(retried), retry=FAST_RETRY, timeout=10) as client:
            result = await client.generate("hi")
            assert await client.tokenize("abc") == [3]
        async with moemesh.AsyncClient(serve(broken), retry=FAST_RETRY, timeout=10) as client:
            chunks = []
            with pytest.raises(moemesh.UnavailableError) as err:
                async for chunk in client.stream("hi"):
                    chunks.append(chunk)
        return result, chunks, err.value

    result, chunks, error = asyncio.run(run())
    assert len(retried.requests) == 2 and result.text == "abc"
    assert len(broken.requests) == 1 and [c.text for c in chunks] == ["a"] and error.after_first_token


def test_the_callers_trace_context_reaches_the_gateway(serve):
    fake = FakeGateway([OK_STREAM])
    caller = SpanContext(trace_id=0x1234_5678_9ABC_DEF0_1234_5678_9ABC_DEF0, span_id=0x0BAD_CAFE_DEAD_BEEF,
                         is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    async def async_calls(address):
        async with moemesh.AsyncClient(address, timeout=10) as client:
            await client.generate("hi")

    with moemesh.Client(serve(fake), timeout=10, metadata=[("x-tenant", "t1")]) as client:
        client.generate("no trace")
        with trace.use_span(NonRecordingSpan(caller)):
            stream = client.stream("traced")  # the context is the one at the call, not at iteration
            client.tokenize("traced")
            asyncio.run(async_calls(client.target))
        list(stream)
    untraced, *traced = fake.metadata
    assert telemetry.metadata_value(untraced, "traceparent") == ""
    assert telemetry.metadata_value(untraced, "x-tenant") == "t1"
    assert len(traced) == 3
    for metadata in traced:
        # The gateway reads it so (services.telemetry, its server interceptor and gateway/observability.py).
        received = trace.get_current_span(telemetry.context_from_metadata(metadata)).get_span_context()
        assert (received.trace_id, received.span_id, received.is_remote) == (caller.trace_id, caller.span_id, True)
        assert telemetry.metadata_value(metadata, "traceparent") == \
            "00-123456789abcdef0123456789abcdef0-0badcafedeadbeef-01"


def logprob(token_id, value, *top) -> gateway_pb2.TokenLogprob:
    return gateway_pb2.TokenLogprob(token_id=token_id, logprob=value,
                                    top=[gateway_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_logprobs_and_n_samples_are_sent_and_gathered_per_sample(serve):
    stop = gateway_pb2.FINISH_REASON_STOP
    fake = FakeGateway([([
        message(0, [5], "a", logprobs=[logprob(5, -0.5, (5, -0.5), (9, -1.5))],
                prompt_logprobs=[logprob(2, -3.0, (7, -0.25), (2, -3.0))]),
        message(1, [6], "b", logprobs=[logprob(6, -0.75, (6, -0.75), (5, -1.0))],
                prompt_logprobs=[logprob(2, -3.0, (7, -0.25), (2, -3.0))]),
        message(1, [4], "", finish=stop, usage=(2, 2, 1), matched_stop="!",
                logprobs=[logprob(4, -2.0, (3, -1.0), (4, -2.0))]),
        message(0, [8, 4], "c", finish=gateway_pb2.FINISH_REASON_LENGTH, usage=(2, 3, 0),
                logprobs=[logprob(8, -1.0, (8, -1.0), (1, -2.0)), logprob(4, -0.5, (4, -0.5), (0, -4.0))]),
    ], None)])
    with moemesh.Client(serve(fake), timeout=10) as client:
        result = client.generate(input_ids=[1, 2], temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=2,
                                 prompt_logprobs=True, stop=["!"], max_new_tokens=3)
        chunks = list(client.stream(input_ids=[1, 2], n=2, temperature=0.8))
    sent = fake.requests[0]
    assert list(sent.input_ids.ids) == [1, 2]
    assert (sent.sampling.n, sent.sampling.logprobs, sent.sampling.top_logprobs, sent.sampling.prompt_logprobs) == \
        (2, True, 2, True)
    assert sent.sampling.seed == 3 and list(sent.sampling.stop) == ["!"]
    assert [c.index for c in chunks] == [0, 1, 1, 0]
    assert chunks[2].finish_reason == "stop" and chunks[2].matched_stop == "!" and chunks[0].finish_reason is None
    assert chunks[0].logprobs == (moemesh.TokenLogprob(5, -0.5, (moemesh.TopLogprob(5, -0.5),
                                                                 moemesh.TopLogprob(9, -1.5))),)

    first, second = result.samples
    assert (first.index, first.text, first.token_ids, first.finish_reason) == (0, "ac", (5, 8, 4), "length")
    assert (second.index, second.text, second.token_ids, second.finish_reason) == (1, "b", (6, 4), "stop")
    assert second.matched_stop == "!" and second.usage == moemesh.Usage(2, 2, 1)
    assert [lp.token_id for lp in first.logprobs] == [5, 8, 4] and first.logprobs[2].top[1].token_id == 0
    assert [lp.logprob for lp in second.logprobs] == [-0.75, -2.0]
    assert first.prompt_logprobs == (moemesh.TokenLogprob(2, -3.0, (moemesh.TopLogprob(7, -0.25),
                                                                    moemesh.TopLogprob(2, -3.0))),)
    # Sample 0 is the result's own; usage counts the prompt once and the completions of both.
    assert (result.text, result.logprobs, result.finish_reason) == ("ac", first.logprobs, "length")
    assert result.usage == moemesh.Usage(prompt_tokens=2, completion_tokens=5, cached_tokens=0)


def test_the_deadline_covers_the_call(serve):
    class Slow(FakeGateway):
        async def Generate(self, request, context):
            self.requests.append(request)
            yield message(token_ids=[1], text="x")
            await asyncio.sleep(5)
            yield message(token_ids=[2], text="y", finish=gateway_pb2.FINISH_REASON_LENGTH)

    fake = Slow([])
    with moemesh.Client(serve(fake), timeout=10) as client:
        with pytest.raises(moemesh.DeadlineExceededError) as err:
            client.generate("hi", timeout=0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.after_first_token
    assert len(fake.requests) == 1
