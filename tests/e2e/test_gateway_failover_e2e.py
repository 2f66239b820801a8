"""Gateway failover in a whole mesh (tiny model, CPU): kill -9 of the serving
gateway while streams are open on it; the standby takes the group over.

The module starts a mesh of its own with two gateways: gateway-0 serves the
group, gateway-1 is registered and stands by (NOT_SERVING). Killing
gateway-0 ends its clients' open streams with UNAVAILABLE (not a hang: they
can retry elsewhere); the rank drops its sequences when the stream breaks;
the scheduler leader's gateway probe finds gateway-0's port refusing and
revokes its lease, and gives the group to gateway-1, which then serves
greedy requests with the reference tokens.
bench/gateway_failover.py measures the takeover time over many runs.
"""

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.grpc_util import channel
from tests.bounded import run
from tests.conftest import hf_greedy
from tests.e2e.test_drain_e2e import cluster_state

PROMPT_IDS = [9707, 11, 1879, 0, 220, 1234, 5678]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def two_gateways(tiny_model_dir):
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=1, device="cpu", num_gateways=2)
    with launcher.Mesh(spec) as running:
        yield running


def role(mesh, name: str) -> launcher.Role:
    return next(r for r in mesh.roles if r.name == name)


async def health(address: str) -> int | None:
    """The health status of a gateway, None if it does not answer."""
    async with channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        except grpc.RpcError:
            return None
    return reply.status


async def group_gateway(mesh) -> str | None:
    """The gateway the scheduler has given the group to."""
    state = await cluster_state(mesh)
    return (state.groups[0].gateway_id or None) if state.groups else None


async def greedy(stub, request_id: str, max_new_tokens: int = NUM_TOKENS) -> list[int]:
    sampling = gateway_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=PROMPT_IDS),
                                          sampling=sampling)
    ids = []
    async for response in stub.Generate(request, timeout=60):
        ids.extend(response.token_ids)
    return ids


async def open_stream(stub, request_id: str) -> tuple[asyncio.Task, asyncio.Event]:
    """A long Generate stream; returns (its task, an event set once a token arrived).
    The task ends with the stream's gRPC status code (OK if it completed)."""
    first = asyncio.Event()

    async def consume() -> grpc.StatusCode:
        sampling = gateway_pb2.SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
        request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling,
                                              input_ids=gateway_pb2.TokenIds(ids=PROMPT_IDS))
        try:
            async for _ in stub.Generate(request, timeout=120):
                first.set()
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    return asyncio.create_task(consume()), first


def test_kill9_of_the_gateway_fails_its_streams_and_the_standby_takes_over(two_gateways, hf_model):
    mesh = two_gateways
    active, standby = mesh.gateway_addresses
    expected = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)

    async def body():
        assert await group_gateway(mesh) == "gateway-0"
        assert await health(active) == health_pb2.HealthCheckResponse.SERVING
        assert await health(standby) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with channel(active) as ch_a, channel(standby) as ch_b:
            stub_a, stub_b = gateway_pb2_grpc.GenerationServiceStub(ch_a), gateway_pb2_grpc.GenerationServiceStub(ch_b)
            assert await greedy(stub_a, "before") == expected
            with pytest.raises(grpc.RpcError) as refused:  # the standby has no group yet
                await greedy(stub_b, "too-early")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            streams = [await open_stream(stub_a, f"open-{i}") for i in range(2)]
            await asyncio.gather(*(first.wait() for _, first in streams))

            killed_at = time.monotonic()
            os.kill(role(mesh, "gateway").proc.pid, signal.SIGKILL)
            done, _ = await asyncio.wait([task for task, _ in streams], timeout=10)
            assert len(done) == 2, "the open streams hung after their gateway died"
            assert [task.result() for task, _ in streams] == [grpc.StatusCode.UNAVAILABLE] * 2

            while True:  # new requests on the standby: UNAVAILABLE until it has the group
                try:
                    tokens = await greedy(stub_b, "after")
                    break
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                    assert time.monotonic() - killed_at < 30, "the standby did not take over"
                    await asyncio.sleep(0.05)
            takeover_s = time.monotonic() - killed_at
            assert tokens == expected  # the rank started clean for the new gateway's stream
            assert await group_gateway(mesh) == "gateway-1"
            assert await health(standby) == health_pb2.HealthCheckResponse.SERVING
            assert takeover_s < 5, takeover_s  # bench/gateway_failover.py: p50 0.23 s
        expert_log = role(mesh, "expert-0").log_path.read_text()
        assert "sequence state dropped" in expert_log
        # Found dead by the leader's probe, not left to its 2 s lease TTL.
        scheduler_logs = "".join(r.log_path.read_text() for r in mesh.roles if r.name.startswith("scheduler"))
        assert "revoked the lease of gateway gateway-0" in scheduler_logs

    run(body(), timeout_s=90)
