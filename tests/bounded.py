"""asyncio.run with a deadline, for tests on a real etcd.

A test body that hangs fails after timeout_s with the await chain of every
task (where each one is stuck), instead of blocking the run until
pytest-timeout and leaving only a dump of an event loop idle in select().
Shutting the loop down is bounded too: a task that ignores its cancellation
is left behind (and listed) rather than waited for.
"""

import asyncio
import inspect
import io
import sys

_SHUTDOWN_S = 5.0


def describe_tasks(loop: asyncio.AbstractEventLoop) -> str:
    """Each task of loop and the chain of coroutines it is awaiting in."""
    out = io.StringIO()
    for task in asyncio.all_tasks(loop):
        print(f"--- {task!r}", file=out)
        coro, depth = task.get_coro(), 0
        while coro is not None and depth < 40:
            frame = (getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
                     or getattr(coro, "gi_frame", None))
            if frame is not None:
                print(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=out)
            else:
                print(f"    {coro!r}", file=out)
            coro = (getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
                    or getattr(coro, "gi_yieldfrom", None))
            depth += 1
    return out.getvalue()


def run(coro, timeout_s: float = 60.0):
    """Runs coro to completion on a new event loop, failing after timeout_s."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        main = loop.create_task(coro, name="test-body")
        loop.run_until_complete(asyncio.wait([main], timeout=timeout_s))
        if not main.done():
            tasks = describe_tasks(loop)
            print(f"test body still running after {timeout_s}s; its tasks:\n{tasks}", file=sys.stderr)
            raise AssertionError(f"test body still running after {timeout_s}s; its tasks:\n{tasks}")
        return main.result()
    finally:
        _shutdown(loop)


def _shutdown(loop: asyncio.AbstractEventLoop) -> None:
    try:
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=_SHUTDOWN_S))
            stuck = [t for t in tasks if not t.done()]
            if stuck:
                print(f"tasks ignoring cancellation, left behind:\n{describe_tasks(loop)}", file=sys.stderr)
        gens = loop.create_task(loop.shutdown_asyncgens())
        loop.run_until_complete(asyncio.wait([gens], timeout=_SHUTDOWN_S))
        executor = loop.create_task(loop.shutdown_default_executor())
        loop.run_until_complete(asyncio.wait([executor], timeout=_SHUTDOWN_S))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def eventually(predicate, timeout_s: float = 5.0):
    """Polls a predicate (plain or async) until it returns a truthy value; returns the last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.02)
