"""Fencing (expert_svc/fencing.py): a rank whose lease went a TTL without renewal holds its epoch's
steps; the same lease confirmed alive lifts the hold (the held plan runs), a new lease fails the
held executor; an executor of a newer epoch is never touched."""

import asyncio
import concurrent.futures
import time

from expert_svc import fencing
from expert_svc.observability import readiness
from expert_svc.executor import StepExecutor
from expert_svc.state import RankState
from services.cluster.session import Session
from tests.expert_svc.test_executor import _FakeRunner, _Stream, _until

TTL_S = 1


class _Rank:
    """The lease's session as the test sets it, and what the fence did to the rank."""

    def __init__(self, executor: StepExecutor):
        self.session = Session(lease_id=7, ttl=TTL_S)
        self.state = RankState(member_id="e0", model_name="m", executor=executor)
        self.serving: list[bool] = []
        self.failures: list[str] = []
        self.task: asyncio.Task | None = None

    async def set_serving(self, is_serving: bool) -> None:
        self.serving.append(is_serving)

    def start(self) -> None:
        self.task = fencing.start(self.state, self.set_serving, lambda: self.session)

    def go_quiet(self) -> None:
        """The keepalive fails from now on: last renewed a TTL ago, session lost."""
        self.session.lost.set()
        self.session.last_renewed = time.monotonic() - TTL_S

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def _rank(model_thread) -> tuple[_Rank, _FakeRunner]:
    runner = _FakeRunner(on_cpu=True)
    holder: list[_Rank] = []
    executor = StepExecutor(runner, model_thread, on_failure=lambda reason: holder[0].failures.append(reason))
    holder.append(_Rank(executor))
    return holder[0], runner


def test_a_quiet_lease_holds_the_steps_and_the_same_lease_confirmed_alive_runs_them():
    async def body(model_thread):
        rank, runner = _rank(model_thread)
        rank.start()
        stream = _Stream(rank.state.executor)
        stream.send(1)
        await _until(lambda: len(stream.results) == 1)
        rank.go_quiet()
        await _until(lambda: rank.state.executor.is_held)
        assert rank.serving == [False]
        assert {k: readiness(rank.state)()[k] for k in ("ready", "fenced")} == {"ready": False, "fenced": True}
        stream.send(2)
        await asyncio.sleep(0.3)
        assert ("launch", 2) not in runner.log  # fenced: the plan waits
        rank.session = Session(lease_id=7, ttl=TTL_S)  # etcd answers: the lease is alive
        await _until(lambda: len(stream.results) == 2)
        assert rank.serving == [False, True] and rank.failures == [] and not rank.state.executor.is_held
        assert readiness(rank.state)()["ready"]
        await stream.close()
        await rank.stop()
        assert stream.error is None

    with concurrent.futures.ThreadPoolExecutor(1) as model_thread:
        asyncio.run(body(model_thread))


def test_a_new_lease_fails_the_held_epoch_and_refuses_its_plans():
    async def body(model_thread):
        rank, runner = _rank(model_thread)
        rank.start()
        stream = _Stream(rank.state.executor)
        rank.go_quiet()
        await _until(lambda: rank.state.executor.is_held)
        stream.send(1)
        rank.session = Session(lease_id=8, ttl=TTL_S)  # the old lease expired: registered anew
        await _until(lambda: stream.error is not None)
        assert "fenced" in str(stream.error) and ("launch", 1) not in runner.log
        assert len(rank.failures) == 1 and "lease expired" in rank.failures[0]
        await rank.stop()

    with concurrent.futures.ThreadPoolExecutor(1) as model_thread:
        asyncio.run(body(model_thread))


def test_an_epoch_joined_during_the_hold_is_not_failed_by_it():
    async def body(model_thread):
        rank, _ = _rank(model_thread)
        rank.start()
        rank.go_quiet()
        await _until(lambda: rank.state.executor.is_held)
        newer = StepExecutor(_FakeRunner(on_cpu=True), model_thread)
        rank.state.executor = newer  # the watch rejoined a new epoch meanwhile
        rank.session = Session(lease_id=8, ttl=TTL_S)
        await asyncio.sleep(0.3)
        assert newer.failure is None and not newer.is_held and rank.failures == []
        await rank.stop()

    with concurrent.futures.ThreadPoolExecutor(1) as model_thread:
        asyncio.run(body(model_thread))


def test_a_renewed_lease_is_never_fenced():
    async def body(model_thread):
        rank, _ = _rank(model_thread)
        rank.start()
        for _ in range(6):  # renewed every third of the TTL, as the keepalive does
            rank.session.last_renewed = time.monotonic()
            await asyncio.sleep(TTL_S / 3)
        assert rank.serving == [] and not rank.state.executor.is_held
        await rank.stop()

    with concurrent.futures.ThreadPoolExecutor(1) as model_thread:
        asyncio.run(body(model_thread))


def test_a_quiet_lease_not_yet_marked_lost_stays_held_until_it_is_renewed():
    """The keepalive may be slow to fail (a starved event loop): only a renewal after the hold lifts it."""
    async def body(model_thread):
        rank, _ = _rank(model_thread)
        rank.start()
        rank.session.last_renewed = time.monotonic() - TTL_S  # quiet, but no refresh has failed yet
        await _until(lambda: rank.state.executor.is_held)
        await asyncio.sleep(0.3)
        assert rank.state.executor.is_held and rank.serving == [False]
        rank.session.last_renewed = time.monotonic()  # the keepalive got through: the same lease lives
        await _until(lambda: not rank.state.executor.is_held)
        assert rank.serving == [False, True] and rank.failures == []
        await rank.stop()

    with concurrent.futures.ThreadPoolExecutor(1) as model_thread:
        asyncio.run(body(model_thread))
