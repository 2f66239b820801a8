"""Requests refused under load at the transports: gRPC RESOURCE_EXHAUSTED with trailing
`retry-after-ms`, HTTP 429 with Retry-After, before any model work; admitted ones complete.

The engines here do not run steps (the first request waits), and their step-cost model is
set to 1 ms a prefill token, so a request's predicted queueing delay is known exactly.
"""

import asyncio

import grpc
import pytest

from gateway.servicer import RETRY_AFTER_KEY
from gateway.step_cost import StepCostModel
from moe.gateway.v1 import gateway_pb2
from tests.gateway.http.test_app import raw_request, serving
from tests.gateway.test_engine import Gateway, make_engine, run

SLOW = (0.0, 0.0, 1000.0, 0.0)      # 1,000 ms per 1,000 prefill tokens, nothing else


def slow_engine(**kwargs):
    engine, ranks = make_engine(max_batch_tokens=256, num_blocks=256, **kwargs)
    engine.batcher.cost_model = StepCostModel(SLOW)
    return engine


async def refused_behind(gw: Gateway, first_ids: list[int]):
    """(the error, the trailing metadata) of a request sent while one of first_ids waits."""
    first = gw.stub.Generate(gateway_pb2.GenerateRequest(
        request_id="a", input_ids=gateway_pb2.TokenIds(ids=first_ids)), timeout=10)
    while not gw.engine.batcher.num_waiting:
        await asyncio.sleep(0.01)
    call = gw.stub.Generate(gateway_pb2.GenerateRequest(request_id="b", prompt="abc"), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    trailing = dict(await call.trailing_metadata())
    first.cancel()
    return err.value, trailing


def test_grpc_refuses_a_request_that_would_wait_too_long_with_a_retry_hint():
    async def scenario():
        async with Gateway() as gw:
            gw.engine = slow_engine(max_queue_delay_ms=10.0)
            return *await refused_behind(gw, [30] * 80), gw.engine   # 80 ms of prefill ahead

    err, trailing, engine = run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "about 80 ms" in err.details() and "max_queue_delay_ms 10" in err.details()
    assert trailing[RETRY_AFTER_KEY] == "70"         # when the queue ahead is down to the bound
    assert engine.stats.num_rejected_overload == 1 and engine.batcher.num_waiting == 1


def test_grpc_full_queue_also_carries_the_hint():
    async def scenario():
        async with Gateway() as gw:
            gw.engine = slow_engine(max_waiting_requests=1, max_queue_delay_ms=0.0)
            return await refused_behind(gw, [30] * 3)

    err, trailing = run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_requests 1" in err.details()
    assert int(trailing[RETRY_AFTER_KEY]) >= 50


def test_http_answers_429_with_retry_after():
    async def scenario():
        async with serving(is_running=False, max_queue_delay_ms=10.0, max_batch_tokens=256,
                           num_blocks=256) as (engine, _, client, url):
            engine.batcher.cost_model = StepCostModel(SLOW)
            waiting = asyncio.create_task(client.completions.create(model="fake", prompt="a" * 900, max_tokens=3))
            while not engine.batcher.num_waiting:
                await asyncio.sleep(0.01)
            refused = await raw_request(url, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
            waiting.cancel()
            return refused

    status, headers, body = run(scenario())
    assert status == 429 and b"max_queue_delay_ms 10" in body
    assert headers["retry-after-ms"] == "890" and headers["retry-after"] == "1"   # 900 ms ahead, 10 allowed
