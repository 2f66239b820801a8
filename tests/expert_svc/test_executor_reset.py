"""StepExecutor.reset: a stream that ends while a step still runs drops its state for sure.

A gateway that dies mid-step cancels its ExecuteSteps handler twice over (the
stream's end, then the server's teardown); the reset queued behind the running
step must still run, or the next gateway's first plan meets the old stream's
step numbers ("step_id 1 does not follow step 7").
"""

import asyncio
import concurrent.futures
import threading

from expert_svc.executor import StepExecutor
from tests.expert_svc.conftest import plan_stream
from services.step import StepPlan, StepResult


class _BlockingRunner:
    """run_step blocks until `release`; reset() is recorded."""

    def __init__(self):
        self.release = threading.Event()
        self.num_resets = 0

    def run_step(self, plan: StepPlan) -> StepResult:
        assert self.release.wait(30)
        return StepResult(plan.step_id, (), 0.0)

    def reset(self) -> None:
        self.num_resets += 1


def test_a_cancelled_reset_still_runs_after_the_running_step():
    runner = _BlockingRunner()
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        executor = StepExecutor(runner, thread)

        async def body():
            step = asyncio.create_task(anext(executor.run(plan_stream(StepPlan(1, "g", 1)))))
            await asyncio.sleep(0.05)  # the step now holds the model thread
            reset = asyncio.create_task(executor.reset())
            await asyncio.sleep(0.05)
            reset.cancel()  # the reset waits behind the step: cancel the waiter
            await asyncio.gather(reset, return_exceptions=True)
            assert runner.num_resets == 0
            runner.release.set()
            await step

        asyncio.run(body())
        thread.submit(lambda: None).result(timeout=10)  # everything queued before has run
    assert runner.num_resets == 1
