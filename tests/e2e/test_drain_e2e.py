"""Graceful stop (SIGTERM) of each role in a whole mesh (tiny model, CPU).

The module starts a mesh of its own with two gateways, each with a 3 s
shutdown grace. In order:

- the serving gateway, with requests in flight: they complete with every
  token, new requests get UNAVAILABLE, it exits 0 within the grace, and the
  standby takes the group over;
- that standby, with requests longer than the grace: they end with
  UNAVAILABLE once the grace is over, and it exits 0 soon after;
- the router and a scheduler follower: exit 0 promptly, the leader keeps its
  term;
- the expert service: exits 0 promptly (deregistered).
"""

import asyncio
import signal
import subprocess
import time

import grpc
import pytest

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from moemesh import launcher
from services.grpc_util import channel
from tests.bounded import eventually, run
from tests.conftest import hf_greedy

GRACE_S = 3.0
PROMPT_IDS = [9707, 11, 1879, 0, 220, 1234, 5678]


@pytest.fixture(scope="module")
def drain_mesh(tiny_model_dir):
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=1, device="cpu", num_gateways=2,
                             extra_args={"gateway": ["--shutdown-grace-s", str(GRACE_S)]})
    with launcher.Mesh(spec) as running:
        yield running


def role(mesh, name: str) -> launcher.Role:
    return next(r for r in mesh.roles if r.name == name)


async def generate(stub, request_id: str, max_new_tokens: int, on_first: asyncio.Event | None = None):
    """(status code, token ids, finish reason) of one greedy request."""
    sampling = gateway_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=PROMPT_IDS),
                                          sampling=sampling)
    ids, finish = [], None
    try:
        async for response in stub.Generate(request, timeout=60):
            ids.extend(response.token_ids)
            finish = response.finish_reason
            if on_first is not None:
                on_first.set()
    except grpc.RpcError as error:
        return error.code(), ids, finish
    return grpc.StatusCode.OK, ids, finish


async def in_flight(stub, prefix: str, num: int, max_new_tokens: int) -> list[asyncio.Task]:
    """num requests, returned once each has streamed its first token."""
    firsts = [asyncio.Event() for _ in range(num)]
    tasks = [asyncio.create_task(generate(stub, f"{prefix}-{i}", max_new_tokens, firsts[i])) for i in range(num)]
    await asyncio.gather(*(f.wait() for f in firsts))
    return tasks


async def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The exit status once proc has exited, None if it still runs after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return proc.poll()


async def serves(address: str) -> bool:
    async with channel(address) as ch:
        code, _, _ = await generate(gateway_pb2_grpc.GenerationServiceStub(ch), "probe", 1)
    return code == grpc.StatusCode.OK


def test_sigterm_drains_the_gateway_then_the_standby_serves(drain_mesh, hf_model):
    mesh = drain_mesh
    active, standby = mesh.gateway_addresses
    num_tokens = 48
    expected = hf_greedy(hf_model, PROMPT_IDS, num_tokens)

    async def body():
        async with channel(active) as ch:
            stub = gateway_pb2_grpc.GenerationServiceStub(ch)
            tasks = await in_flight(stub, "drained", 2, num_tokens)
            proc = role(mesh, "gateway").proc
            signalled_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)  # the gateway has seen the signal
            code, ids, _ = await generate(stub, "refused", 4)
            assert code == grpc.StatusCode.UNAVAILABLE and ids == []
            for code, ids, finish in await asyncio.gather(*tasks):
                assert (code, finish) == (grpc.StatusCode.OK, gateway_pb2.FINISH_REASON_LENGTH)
                assert ids == expected
            assert await wait_exit(proc, GRACE_S + 5) == 0
            assert time.monotonic() - signalled_at < GRACE_S + 5
        deadline = time.monotonic() + 30  # deregistered at exit: the standby gets the group
        while not await serves(standby):
            assert time.monotonic() < deadline, "the standby did not take over"
            await asyncio.sleep(0.1)

    run(body(), timeout_s=90)


def test_sigterm_cuts_off_requests_still_running_after_the_grace(drain_mesh):
    mesh = drain_mesh
    standby = mesh.gateway_addresses[1]

    async def body():
        async with channel(standby) as ch:
            stub = gateway_pb2_grpc.GenerationServiceStub(ch)
            tasks = await in_flight(stub, "long", 2, 4000)
            proc = role(mesh, "gateway-1").proc
            signalled_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            cut_after_s = time.monotonic() - signalled_at
            assert [code for code, _, _ in results] == [grpc.StatusCode.UNAVAILABLE] * 2
            assert all(0 < len(ids) < 4000 for _, ids, _ in results)
            assert GRACE_S - 0.5 < cut_after_s < GRACE_S + 5, cut_after_s
            assert await wait_exit(proc, 10) == 0

    run(body(), timeout_s=60)


async def cluster_state(mesh) -> scheduler_pb2.GetClusterStateResponse:
    """The cluster state from the first scheduler replica that answers and names a leader."""
    for address in mesh.scheduler_addresses:
        async with channel(address) as ch:
            try:
                state = await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetClusterState(
                    scheduler_pb2.GetClusterStateRequest(), timeout=2)
            except grpc.RpcError:
                continue
            if state.HasField("leader"):
                return state
    raise AssertionError("no scheduler replica names a leader")


async def leader_of(mesh) -> scheduler_pb2.Leader:
    return (await cluster_state(mesh)).leader


def test_sigterm_stops_the_router_and_a_scheduler_follower_promptly(drain_mesh):
    mesh = drain_mesh

    async def body():
        leader = await leader_of(mesh)
        follower = next(r for r in mesh.roles if r.name.startswith("scheduler") and r.name != leader.member_id)
        for stopped in (role(mesh, "router"), follower):
            stopped.proc.send_signal(signal.SIGTERM)
            assert await wait_exit(stopped.proc, 5) == 0, stopped.name
        after = await leader_of(mesh)
        assert (after.member_id, after.term) == (leader.member_id, leader.term)

    run(body(), timeout_s=60)


def test_sigterm_stops_the_expert_service_promptly(drain_mesh):
    """It leaves the process group and deregisters: no group is left."""
    mesh = drain_mesh
    expert = role(mesh, "expert-0")

    async def body():
        expert.proc.send_signal(signal.SIGTERM)
        assert await wait_exit(expert.proc, 15) == 0

        async def deregistered():  # the schedulers answer from a watch: the change lands within ms
            return "expert-0" not in {m.member_id for m in (await cluster_state(mesh)).members}

        assert await eventually(deregistered)

    run(body(), timeout_s=30)
