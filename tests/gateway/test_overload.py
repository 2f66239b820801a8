"""Requests refused under load at the transports: gRPC RESOURCE_EXHAUSTED with trailing
`retry-after-ms`, HTTP 429 with Retry-After, before any model work; the request ahead stays.

The engines here do not run steps (the first request waits), and their step-cost model is
set to 1 ms a prefill token and nothing else, so a request's predicted TTFT is known exactly.
"""

import asyncio

import grpc
import pytest

from gateway.servicer import RETRY_AFTER_KEY
from gateway.step_cost import StepCost
from moe.gateway.v1 import gateway_pb2
from tests.gateway.http.test_app import raw_request, serving
from tests.gateway.test_engine import Gateway, make_engine, run

SLOW = StepCost(fixed_ms=0.0, decode_ms=0.0, token_ms=1.0, pair_ms=0.0)


def slow_engine(**kwargs):
    engine, ranks = make_engine(max_batch_tokens=256, num_blocks=256, **kwargs)
    engine.batcher.cost = SLOW
    return engine


async def refused_behind(gw: Gateway, first_ids: list[int], ids: list[int], priority=gateway_pb2.PRIORITY_INTERACTIVE):
    """(the error, the trailing metadata) of a request of ids sent while one of first_ids waits."""
    first = gw.stub.Generate(gateway_pb2.GenerateRequest(
        request_id="a", input_ids=gateway_pb2.TokenIds(ids=first_ids)), timeout=10)
    while not gw.engine.batcher.num_waiting:
        await asyncio.sleep(0.01)
    call = gw.stub.Generate(gateway_pb2.GenerateRequest(
        request_id="b", input_ids=gateway_pb2.TokenIds(ids=ids), priority=priority), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    trailing = dict(await call.trailing_metadata())
    first.cancel()
    return err.value, trailing


def test_grpc_refuses_a_request_that_would_miss_its_ttft_with_a_retry_hint():
    async def scenario():
        async with Gateway() as gw:
            gw.engine = slow_engine(ttft_target_ms=50.0)
            return *await refused_behind(gw, [30] * 60, [31] * 100), gw.engine   # 60 ms of prefill ahead, 100 its own

    err, trailing, engine = run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "about 160 ms" in err.details() and "60 prompt tokens queued ahead of its 100" in err.details()
    assert "past the 100 ms it may wait (--ttft-target-ms 50)" in err.details()
    assert trailing[RETRY_AFTER_KEY] == "60"         # when the prediction is back within the bound
    assert engine.stats.num_rejected_overload == 1 and engine.batcher.num_waiting == 1


def test_grpc_refuses_a_batch_request_within_twice_the_target():
    async def scenario():
        async with Gateway() as gw:
            gw.engine = slow_engine(ttft_target_ms=50.0)
            # 52 ms: past the target, within twice it
            return await refused_behind(gw, [30] * 12, [31] * 40, gateway_pb2.PRIORITY_BATCH)

    err, trailing = run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "a batch-priority request" in err.details()
    assert trailing[RETRY_AFTER_KEY] == "50"         # 2 ms past: the least hint


def test_an_interactive_request_behind_the_same_queue_is_admitted():
    async def scenario():
        async with Gateway() as gw:
            gw.engine = slow_engine(ttft_target_ms=50.0)
            first = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="a", input_ids=gateway_pb2.TokenIds(ids=[30] * 12)), timeout=10)
            while not gw.engine.batcher.num_waiting:
                await asyncio.sleep(0.01)
            second = gw.stub.Generate(gateway_pb2.GenerateRequest(
                request_id="b", input_ids=gateway_pb2.TokenIds(ids=[31] * 40)), timeout=10)
            while gw.engine.batcher.num_waiting < 2:
                await asyncio.sleep(0.01)
            first.cancel()
            second.cancel()
            return gw.engine.stats.num_rejected_overload

    assert run(scenario()) == 0


def test_http_answers_429_with_retry_after():
    async def scenario():
        async with serving(is_running=False, ttft_target_ms=500.0, max_batch_tokens=256,
                           num_blocks=256) as (engine, _, client, url):
            engine.batcher.cost = SLOW
            waiting = asyncio.create_task(client.completions.create(model="fake", prompt="a" * 900, max_tokens=3))
            while not engine.batcher.num_waiting:
                await asyncio.sleep(0.01)
            refused = await raw_request(url, "/v1/completions", {"prompt": "b" * 200, "max_tokens": 3})
            waiting.cancel()
            return refused

    status, headers, body = run(scenario())
    assert status == 429 and b"--ttft-target-ms 500" in body
    assert 50 < int(headers["retry-after-ms"]) < 150 and headers["retry-after"] == "1"   # 1,100 ms against 1,000
