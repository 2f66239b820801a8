"""Running a rank's steps: plans in, results out, one per plan and in order.

`StepExecutor.run` drives a StepRunner (runner.py) on the rank's one model
thread, so the event loop stays responsive. Pipelined (a `reader` thread
given), a step is launched on the model thread and its tokens are read on
the reader thread; when the next plan has already arrived by then, it is
launched before the last step's tokens are read, so the GPU runs step k+1
while the host waits for step k's tokens, sends them and parses the next
plan (what vLLM calls async scheduling, SGLang its overlap scheduler). A
result never waits for a plan that has not arrived, and at most
MAX_STEPS_IN_FLIGHT steps are launched and unanswered. On the CPU the
forward runs inside launch, so each step is answered at once, as without
the pipeline.
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from expert_svc.runner import LaunchedStep, StepRunner
from services.step import StepPlan, StepResult

# The gateway plans one step ahead of the results it has read (gateway/engine.py),
# so a rank never has more than two unanswered plans anyway.
MAX_STEPS_IN_FLIGHT = 2


class StepFailedError(RuntimeError):
    """A step failed in the model or a collective, or overran its deadline: the
    rank is out of lockstep with its group and can run no further step."""


class StepExecutor:
    """Runs a StepRunner's steps on the rank's model thread, then an optional hook.

    `after_step(step_id)` runs on the model thread after every step that the
    runner accepted, in step order: pipelined, right after its launch (so
    the device counters the stats reporter reads hold that step and no
    later one); otherwise after its tokens are read. A bad plan raises
    ValueError (StalePlanError) and the rank carries on. Any other error, or
    a launch or a wait for a step's tokens still running after `deadline_s`
    (a collective that never returns, e.g. NCCL without a host-side
    timeout), fails the executor for good: `on_failure(reason)` is called
    once on the event loop, and every later step raises StepFailedError.
    """

    def __init__(self, runner: StepRunner, thread: concurrent.futures.ThreadPoolExecutor,
                 after_step: Callable[[int], None] | None = None, *,
                 reader: concurrent.futures.ThreadPoolExecutor | None = None,
                 on_failure: Callable[[str], None] | None = None, deadline_s: float | None = None):
        self.runner = runner
        self._thread = thread
        self._reader = reader  # None: not pipelined, each step one job on the model thread
        self._after_step = after_step
        self._on_failure = on_failure
        self._deadline_s = deadline_s
        self._last_read_at = 0.0  # time.perf_counter() when the last step's tokens were read
        self.failure: str | None = None  # why the executor failed, once it has
        # Cleared while the rank is fenced (expert_svc/fencing.py): plans wait, none is launched.
        self._released = asyncio.Event()
        self._released.set()

    async def run(self, plans: AsyncIterator[StepPlan]) -> AsyncIterator[StepResult]:
        """One result per plan, in order, until `plans` ends. At a bad plan
        (or a ValueError from `plans`) or a failed step: the results of the
        steps before it, then its error (ValueError, StalePlanError,
        StepFailedError), and nothing after it is launched."""
        next_plan = asyncio.ensure_future(_next(plans))
        steps: collections.deque[asyncio.Future[StepResult]] = collections.deque()
        try:
            while True:
                head = steps[0] if steps else None
                if head is None or (len(steps) < MAX_STEPS_IN_FLIGHT and not head.done()):
                    # The next plan or the oldest step's tokens, whichever comes first.
                    await asyncio.wait([next_plan] if head is None else [next_plan, head],
                                       return_when=asyncio.FIRST_COMPLETED)
                    if next_plan.done() and (head is None or not head.done()):
                        try:  # a plan that cannot be read or run answers in its turn
                            plan = next_plan.result()
                            if plan is None:
                                break
                            next_plan = asyncio.ensure_future(_next(plans))
                            steps.append(await self._start(plan))
                        except (ValueError, StepFailedError) as error:
                            while steps:
                                yield await steps.popleft()
                            raise error
                        continue
                yield await steps.popleft()
            while steps:
                yield await steps.popleft()
        finally:
            next_plan.cancel()
            for step in steps:
                step.cancel()

    async def _start(self, plan: StepPlan) -> "asyncio.Future[StepResult]":
        """Launches the plan's step: the future of its result, done unless its
        tokens are still to come from the device."""
        await self._released.wait()
        if self.failure is not None:
            raise StepFailedError(f"step {plan.step_id} refused: {self.failure}")
        loop = asyncio.get_running_loop()
        if self._reader is None:
            return _done(await self._guard(plan.step_id, loop.run_in_executor(self._thread, self._run_step, plan)))
        step = await self._guard(plan.step_id, loop.run_in_executor(self._thread, self._launch, plan))
        if step.ready is None:  # the tokens are on the host already
            return _done(self._read(step))
        return asyncio.ensure_future(self._guard(plan.step_id, loop.run_in_executor(self._reader, self._read, step)))

    def _run_step(self, plan: StepPlan) -> StepResult:
        result = self.runner.run_step(plan)
        if self._after_step is not None:
            self._after_step(plan.step_id)
        return result

    def _read(self, step: LaunchedStep) -> StepResult:
        """The step's result; its execute_seconds counted from its launch or, if it was
        launched ahead, from when the step before it was read (it ran after that one)."""
        result = self.runner.finish(step)
        read_at = time.perf_counter()
        busy_since, self._last_read_at = max(step.start, self._last_read_at), read_at
        return dataclasses.replace(result, execute_seconds=read_at - busy_since)

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        step = self.runner.launch(plan)
        if self._after_step is not None:
            self._after_step(plan.step_id)
        return step

    async def _guard(self, step_id: int, job: asyncio.Future):
        """The job's result within the deadline; a failure other than a bad plan fails the executor."""
        try:
            return await asyncio.wait_for(job, self._deadline_s)
        except ValueError:
            raise
        except TimeoutError as error:
            raise self._fail(f"step {step_id} did not finish within {self._deadline_s:g} s "
                             f"(stuck in a collective?)") from error
        except Exception as error:  # anything else leaves the group's collectives out of step
            raise self._fail(f"step {step_id} failed: {error}") from error

    def hold(self) -> None:
        """Launches no further step until release() or fail(): plans that arrive wait."""
        self._released.clear()

    def release(self) -> None:
        """Ends a hold: the waiting plans run."""
        self._released.set()

    @property
    def is_held(self) -> bool:
        return not self._released.is_set()

    def fail(self, reason: str) -> None:
        """Fails the executor from outside (a hold given up): waiting and later plans are refused."""
        self._fail(reason)
        self._released.set()

    def _fail(self, reason: str) -> StepFailedError:
        if self.failure is None:
            self.failure = reason
            if self._on_failure is not None:
                self._on_failure(reason)
        return StepFailedError(reason)

    async def reset(self) -> None:
        """Drops all sequence state, after any step still running.

        Cancelling the caller does not cancel the reset: it is queued on the model
        thread and still runs there before any later step (the thread runs jobs in
        order), so a new stream never sees the last stream's sequences.
        """
        await asyncio.shield(asyncio.wrap_future(self._thread.submit(self.runner.reset)))


async def _next(plans: AsyncIterator[StepPlan]) -> StepPlan | None:
    """The next plan, None once there is none."""
    return await anext(plans, None)


def _done(result: StepResult) -> "asyncio.Future[StepResult]":
    future = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future
