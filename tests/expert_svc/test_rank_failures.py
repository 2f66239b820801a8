"""A rank that cannot serve its group: a group size that does not divide the experts (exit 1,
before loading), a failed or stuck step (StepExecutor), and a peer stuck in a collective (the
rank times out, reports under /failures/ in etcd and waits, NOT_SERVING, for the re-formed
group; the gateway keeps the request, which completes once the peer is back)."""

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time

import aetcd
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expert_svc.executor import StepExecutor, StepFailedError
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from moemesh.etcd import start_etcd
from services.cluster import ClusterClient, GroupAssignment, Keys, RankInfo
from tests.conftest import hf_greedy
from tests.expert_svc.conftest import plan_stream
from tests.e2e.test_mesh_e2e import greedy
from services.step import StepPlan, StepResult

COLLECTIVE_TIMEOUT_S = 5


def _etcd_client(endpoint: str) -> aetcd.Client:
    host, port = endpoint.rsplit(":", 1)
    return aetcd.Client(host=host, port=int(port))


def test_group_size_that_does_not_divide_the_experts_exits_non_zero(tiny_model_dir, tmp_path):
    with start_etcd(tmp_path / "etcd") as etcd:
        group = GroupAssignment("g0", 1, 1, 3, "127.0.0.1:1", [RankInfo(0, "e0", "127.0.0.1:2"),
                                                               RankInfo(1, "e1", "127.0.0.1:3"),
                                                               RankInfo(2, "e2", "127.0.0.1:4")], None)

        async def put_group():
            async with _etcd_client(etcd.endpoint) as client:
                await client.put(Keys().group("g0").encode(), group.to_json())

        asyncio.run(put_group())
        out = subprocess.run([sys.executable, "-m", "expert_svc.main", "--member-id", "e0", "--model",
                              str(tiny_model_dir), "--etcd", etcd.endpoint, "--port", "0"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "group 'g0' has 3 ranks, which does not divide the model's 8 experts" in out.stderr


# ---- StepExecutor: failed and stuck steps ----------------------------------------------------


class _FakeRunner:
    """run_step raises `error`, or blocks until `release` is set."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.release = threading.Event()

    def run_step(self, plan: StepPlan) -> StepResult:
        if self.error is not None:
            raise self.error
        self.release.wait(30)
        return StepResult(plan.step_id, (), 0.0)


def _execute(executor: StepExecutor, *step_ids: int) -> list:
    """Runs the steps one after the other, each in a stream of its own; each one's result or exception."""
    async def step(step_id: int) -> StepResult:
        [result] = [r async for r in executor.run(plan_stream(StepPlan(step_id, "g", 1)))]
        return result

    async def body():
        return [await asyncio.gather(step(i), return_exceptions=True) for i in step_ids]

    return [outcome for [outcome] in asyncio.run(body())]


@pytest.fixture()
def thread():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool


def test_a_step_error_fails_the_executor_once_and_for_good(thread):
    reasons = []
    executor = StepExecutor(_FakeRunner(RuntimeError("Timed out waiting 5000ms for recv")), thread,
                            on_failure=reasons.append)
    first, second = _execute(executor, 1, 2)
    assert isinstance(first, StepFailedError) and "step 1 failed: Timed out waiting" in str(first)
    assert isinstance(second, StepFailedError) and "refused" in str(second)
    assert reasons == ["step 1 failed: Timed out waiting 5000ms for recv"]


def test_a_bad_plan_does_not_fail_the_executor(thread):
    reasons = []
    executor = StepExecutor(_FakeRunner(ValueError("sequence 9 is unknown")), thread, on_failure=reasons.append)
    [outcome] = _execute(executor, 1)
    assert type(outcome) is ValueError and executor.failure is None and reasons == []


def test_a_step_past_its_deadline_fails_the_executor(thread):
    reasons, runner = [], _FakeRunner()
    executor = StepExecutor(runner, thread, on_failure=reasons.append, deadline_s=0.2)
    try:
        [outcome] = _execute(executor, 1)
    finally:
        runner.release.set()
    assert isinstance(outcome, StepFailedError)
    assert reasons == ["step 1 did not finish within 0.2 s (stuck in a collective?)"]


# ---- a peer stuck in a collective, through the whole mesh ---------------------------------------


def _read_failures(endpoint: str) -> list[dict]:
    async def body():
        async with _etcd_client(endpoint) as client:
            prefix = Keys().root + "failures/"
            return [json.loads(kv.value) for kv in await client.get_prefix(prefix.encode())]

    return asyncio.run(body())


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_rank_whose_peer_is_stuck_reports_waits_and_the_group_recovers_when_the_peer_wakes(
        tiny_model_dir, hf_model):
    """expert-1 is SIGSTOPped mid-generation, keeping its lease (a hung process, no
    standby): expert-0 times out in the next collective, writes its failure and goes
    NOT_SERVING but does not exit; the stream just pauses. Once expert-1 wakes, the
    scheduler re-forms the group with both (a new epoch, no reload) and the request
    completes with exactly the reference tokens."""
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=2, extra_args={
        "expert_svc": ["--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), "--lease-ttl-s", "60"],
        "scheduler_svc": ["--reform-settle-s", "1"]})
    prompt_ids = [9707, 11, 1879, 0, 220, 1234]
    with launcher.Mesh(spec) as mesh:
        ranks = {r.name: r for r in mesh.roles if r.name.startswith("expert-")}
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            request = gateway_pb2.GenerateRequest(request_id="long", input_ids=gateway_pb2.TokenIds(ids=prompt_ids),
                                                  sampling=greedy(n=120))
            stream = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
            token_ids = list(next(stream).token_ids)  # the group is generating
            os.kill(ranks["expert-1"].proc.pid, signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                deadline = stopped_at + COLLECTIVE_TIMEOUT_S * 4
                while not (failures := _read_failures(mesh.etcd_endpoint)):
                    assert time.monotonic() < deadline, "expert-0 did not report the failure"
                    time.sleep(0.2)
                elapsed = time.monotonic() - stopped_at
                assert ranks["expert-0"].proc.poll() is None, "expert-0 exited"
                assert _health(f"127.0.0.1:{ranks['expert-0'].port}") == health_pb2.HealthCheckResponse.NOT_SERVING
            finally:
                os.kill(ranks["expert-1"].proc.pid, signal.SIGCONT)
            for response in stream:
                token_ids += response.token_ids
        mesh.check_alive()
        group = asyncio.run(_group(mesh.etcd_endpoint))
    assert elapsed < COLLECTIVE_TIMEOUT_S * 3, f"expert-0 took {elapsed:.1f} s to give up"
    [failure] = [f for f in failures if f["member_id"] == "expert-0"]
    assert (failure["group_id"], failure["epoch"], failure["rank"]) == ("g0", 1, 0)
    assert "failed" in failure["reason"] and "Timed out" in failure["reason"], failure["reason"]
    assert token_ids == hf_greedy(hf_model, prompt_ids, 120)
    assert group.epoch > 1 and [r.member_id for r in group.ranks] == ["expert-0", "expert-1"]


async def _group(endpoint: str) -> GroupAssignment:
    async with ClusterClient(endpoint) as client:
        [group] = await client.list_groups()
        return group
