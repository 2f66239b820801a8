"""StepExecutor.run, pipelined: the order of launches, token reads and results, with a fake
runner whose steps' tokens arrive when the test says (a stand-in for the CUDA event)."""

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

from expert_svc.executor import StepExecutor, StepFailedError
from expert_svc.runner import LaunchedStep, StepRunner
from tests.expert_svc.conftest import plan_stream
from services.step import StepPlan, StepResult

BAD_STEP_ERROR = "sequence 9 is unknown"


class _Ready:
    """A stand-in for the step's CUDA event: synchronize() blocks until the test sets it."""

    def __init__(self):
        self.is_set = threading.Event()

    def synchronize(self) -> None:
        assert self.is_set.wait(30)


class _FakeRunner:
    """Step k samples token 100 + k for sequence k. Records ("launch"|"idle"|"read", k) in order;
    `bad` plans raise ValueError after an idle step, `broken` ones RuntimeError."""

    def __init__(self, *, bad=(), broken=(), on_cpu=False):
        self.log: list[tuple[str, int]] = []
        self.ready: dict[int, _Ready] = {}
        self.bad, self.broken, self.on_cpu = set(bad), set(broken), on_cpu

    def launch(self, plan: StepPlan) -> LaunchedStep:
        if plan.step_id in self.bad:
            self.log.append(("idle", plan.step_id))
            raise ValueError(BAD_STEP_ERROR)
        if plan.step_id in self.broken:
            raise RuntimeError("Timed out waiting 5000ms for recv")
        self.log.append(("launch", plan.step_id))
        ready = None if self.on_cpu else self.ready.setdefault(plan.step_id, _Ready())
        return LaunchedStep(plan.step_id, time.perf_counter(), ((0, plan.step_id),),
                            torch.tensor([100 + plan.step_id]), ready)

    def finish(self, step: LaunchedStep) -> StepResult:
        result = StepRunner.finish(step)
        self.log.append(("read", step.step_id))
        return result

    def run_step(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def set_ready(self, step_id: int) -> None:
        self.ready.setdefault(step_id, _Ready()).is_set.set()


class _Stream:
    """A step stream the test feeds plan by plan; results and the final error are collected."""

    def __init__(self, executor: StepExecutor):
        self._plans: asyncio.Queue[StepPlan | None] = asyncio.Queue()
        self.results: list[StepResult] = []
        self.error: BaseException | None = None
        self._task = asyncio.create_task(self._consume(executor))

    async def _plan_iter(self):
        while (plan := await self._plans.get()) is not None:
            yield plan

    async def _consume(self, executor: StepExecutor) -> None:
        try:
            async for result in executor.run(self._plan_iter()):
                self.results.append(result)
        except (ValueError, StepFailedError) as error:
            self.error = error

    def send(self, *step_ids: int) -> None:
        for step_id in step_ids:
            self._plans.put_nowait(StepPlan(step_id, "g", 1))

    async def close(self) -> None:
        self._plans.put_nowait(None)
        await asyncio.wait_for(self._task, 10)


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _settle() -> None:
    """Gives the executor time to do what it would do next (it must not, in these tests)."""
    await asyncio.sleep(0.1)


@pytest.fixture()
def threads():
    with (concurrent.futures.ThreadPoolExecutor(1) as model_thread,
          concurrent.futures.ThreadPoolExecutor(1) as reader_thread):
        yield model_thread, reader_thread


def _executor(runner, threads, **kwargs) -> StepExecutor:
    model_thread, reader_thread = threads
    return StepExecutor(runner, model_thread, reader=reader_thread, **kwargs)


def test_a_plan_that_arrives_while_a_step_runs_is_launched_before_its_tokens_are_read(threads):
    runner = _FakeRunner()
    executor = _executor(runner, threads, after_step=lambda step_id: runner.log.append(("after", step_id)))

    async def body():
        stream = _Stream(executor)
        stream.send(1)
        await _until(lambda: ("after", 1) in runner.log)
        stream.send(2)  # step 1 still runs on the "device"
        await _until(lambda: ("after", 2) in runner.log)
        await _settle()
        assert stream.results == [] and ("read", 1) not in runner.log
        runner.set_ready(1)
        await _until(lambda: len(stream.results) == 1)
        runner.set_ready(2)
        await _until(lambda: len(stream.results) == 2)
        await stream.close()
        return stream

    stream = asyncio.run(body())
    assert runner.log == [("launch", 1), ("after", 1), ("launch", 2), ("after", 2), ("read", 1), ("read", 2)]
    assert [(r.step_id, r.tokens) for r in stream.results] == [(1, ((1, 101),)), (2, ((2, 102),))]
    assert stream.error is None
    # Step 2 ran once step 1 was done: its time counts from step 1's read, not its early launch.
    assert 0 < stream.results[1].execute_seconds < stream.results[0].execute_seconds / 2


def test_a_result_never_waits_for_the_next_plan(threads):
    runner = _FakeRunner()
    executor = _executor(runner, threads)

    async def body():
        stream = _Stream(executor)
        stream.send(1)
        await _until(lambda: ("launch", 1) in runner.log)
        runner.set_ready(1)
        await _until(lambda: len(stream.results) == 1)  # no plan 2 in sight
        stream.send(2)
        runner.set_ready(2)
        await stream.close()
        return stream

    stream = asyncio.run(body())
    assert [r.step_id for r in stream.results] == [1, 2]
    assert runner.log == [("launch", 1), ("read", 1), ("launch", 2), ("read", 2)]


def test_at_most_two_steps_are_in_flight_and_results_keep_plan_order(threads):
    runner = _FakeRunner()
    executor = _executor(runner, threads)

    async def body():
        stream = _Stream(executor)
        stream.send(1, 2, 3, 4)
        await _until(lambda: ("launch", 2) in runner.log)
        await _settle()
        assert ("launch", 3) not in runner.log
        for step_id in (2, 4, 3, 1):  # the device finishing out of order changes nothing
            runner.set_ready(step_id)
        await stream.close()
        return stream

    stream = asyncio.run(body())
    assert [r.step_id for r in stream.results] == [1, 2, 3, 4]
    assert runner.log.index(("read", 1)) < runner.log.index(("launch", 3))
    assert runner.log.index(("read", 2)) < runner.log.index(("launch", 4))


def test_a_bad_plan_behind_a_running_step_ends_the_stream_after_that_steps_result(threads):
    runner, reasons = _FakeRunner(bad={2}), []
    executor = _executor(runner, threads, on_failure=reasons.append,
                         after_step=lambda step_id: runner.log.append(("after", step_id)))

    async def body():
        stream = _Stream(executor)
        stream.send(1, 2, 3)
        await _until(lambda: ("idle", 2) in runner.log)
        await _settle()
        runner.set_ready(1)
        await asyncio.wait_for(stream._task, 10)
        return stream

    stream = asyncio.run(body())
    # The bad plan ran its idle step (peers' collectives line up), got no after_step, and
    # nothing after it was launched; the step before it was still answered.
    assert runner.log == [("launch", 1), ("after", 1), ("idle", 2), ("read", 1)]
    assert [r.step_id for r in stream.results] == [1]
    assert type(stream.error) is ValueError and str(stream.error) == BAD_STEP_ERROR
    assert executor.failure is None and reasons == []


def test_a_step_that_fails_behind_a_running_one_fails_the_executor_after_that_ones_result(threads):
    runner, reasons = _FakeRunner(broken={2}), []
    executor = _executor(runner, threads, on_failure=reasons.append)

    async def body():
        stream = _Stream(executor)
        stream.send(1, 2)
        await _until(lambda: executor.failure is not None)
        runner.set_ready(1)
        await asyncio.wait_for(stream._task, 10)
        refused = _Stream(executor)
        refused.send(3)
        await refused.close()
        return stream, refused

    stream, refused = asyncio.run(body())
    assert [r.step_id for r in stream.results] == [1]
    assert isinstance(stream.error, StepFailedError) and "step 2 failed: Timed out waiting" in str(stream.error)
    assert isinstance(refused.error, StepFailedError) and "step 3 refused" in str(refused.error)
    assert reasons == ["step 2 failed: Timed out waiting 5000ms for recv"]


def test_tokens_that_never_come_fail_the_executor_at_the_deadline(threads):
    runner, reasons = _FakeRunner(), []
    executor = _executor(runner, threads, on_failure=reasons.append, deadline_s=0.2)

    async def body():
        stream = _Stream(executor)
        stream.send(1)
        await asyncio.wait_for(stream._task, 10)
        return stream

    try:
        stream = asyncio.run(body())
    finally:
        runner.set_ready(1)  # frees the reader thread
    assert isinstance(stream.error, StepFailedError) and stream.results == []
    assert reasons == ["step 1 did not finish within 0.2 s (stuck in a collective?)"]


@pytest.mark.parametrize("mode", ["cpu", "not pipelined"])
def test_steps_whose_tokens_are_on_the_host_at_launch_or_unpipelined_are_answered_one_by_one(threads, mode):
    """The CPU (the forward ran in launch) and --no-pipeline-steps: each step is read and answered
    before the next one is launched, however many plans wait."""
    runner = _FakeRunner(on_cpu=mode == "cpu")
    if mode == "cpu":
        executor = _executor(runner, threads)
    else:
        executor = StepExecutor(runner, threads[0])
        for step_id in (1, 2, 3):
            runner.set_ready(step_id)

    async def body():
        return [r.step_id async for r in executor.run(plan_stream(*(StepPlan(i, "g", 1) for i in (1, 2, 3))))]

    assert asyncio.run(body()) == [1, 2, 3]
    assert runner.log == [("launch", 1), ("read", 1), ("launch", 2), ("read", 2), ("launch", 3), ("read", 3)]


def test_a_plan_that_cannot_be_read_ends_the_stream_after_the_running_steps_result(threads):
    runner = _FakeRunner()
    executor = _executor(runner, threads)

    async def plans():
        yield StepPlan(1, "g", 1)
        raise ValueError("temperature must not be negative, got -1.0")  # as plan_from_pb would

    async def body():
        step_ids = []
        with pytest.raises(ValueError, match="temperature"):
            async for result in executor.run(plans()):
                step_ids.append(result.step_id)
        return step_ids

    threading.Timer(0.2, runner.set_ready, (1,)).start()  # step 1 still runs when the error comes
    assert asyncio.run(body()) == [1]
    assert executor.failure is None
