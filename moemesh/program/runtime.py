"""`moemesh.Runtime`: where programs run: one AsyncClient to a gateway, the thread pools, the chat template.

    runtime = moemesh.Runtime("127.0.0.1:50051")
    state = program.run(text="...", runtime=runtime)
    states = program.run_batch([{"text": t} for t in texts], runtime=runtime, max_concurrency=16)

Each `run`/`run_batch` call opens a session in its own event loop: an
AsyncClient, a thread pool for program bodies (one per concurrent run) and
one for sync tools. The session learns the chat template's token framing from
the gateway's Tokenize once (`message_ids`, `role_markers`) and caches the
ids of texts it has tokenized, so repeated pieces cost no round trip.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import functools
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace

from moemesh.async_client import AsyncClient
from moemesh.program.lang import Program, ProgramError
from moemesh.program.run import Run, tracer
from moemesh.program.state import State

# A content that no chat template renders into its framing (used to find where content goes).
_PROBE = "Z"


class Runtime:
    """The gateway (`target`, "host:port") programs run against; client_options go to AsyncClient."""

    def __init__(self, target: str, *, max_tool_workers: int = 16, **client_options: Any) -> None:
        if max_tool_workers < 1:
            raise ValueError(f"max_tool_workers must be >= 1, got {max_tool_workers}")
        self.target = target
        self.max_tool_workers = max_tool_workers
        self.client_options = client_options

    def run(self, program: Program, args: Sequence[Any], kwargs: Mapping[str, Any]) -> State:
        return asyncio.run(self.arun(program, args, kwargs))

    async def arun(self, program: Program, args: Sequence[Any], kwargs: Mapping[str, Any]) -> State:
        async with Session(self, max_bodies=1) as session:
            return await session.run(program, args, kwargs)

    def run_batch(self, program: Program, batch: Sequence[Mapping[str, Any]], *, max_concurrency: int,
                  progress: bool, return_exceptions: bool) -> list:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        results = asyncio.run(self._batch(program, batch, max_concurrency, progress))
        if not return_exceptions:
            for result in results:
                if isinstance(result, ProgramError):
                    raise result
        return results

    async def _batch(self, program: Program, batch: Sequence[Mapping[str, Any]], max_concurrency: int,
                     progress: bool) -> list:
        limit = asyncio.Semaphore(max_concurrency)
        bar = _progress(len(batch), program.name) if progress else None

        async def one(kwargs: Mapping[str, Any]):
            async with limit:
                try:
                    return await session.run(program, (), kwargs)
                except ProgramError as error:
                    return error
                finally:
                    if bar is not None:
                        bar.update(1)

        async with Session(self, max_bodies=max_concurrency) as session:
            try:
                return list(await asyncio.gather(*(one(kwargs) for kwargs in batch)))
            finally:
                if bar is not None:
                    bar.close()


class Session:
    """A runtime's connection within one event loop."""

    def __init__(self, runtime: Runtime, *, max_bodies: int) -> None:
        self.runtime = runtime
        self.client = AsyncClient(runtime.target, **runtime.client_options)
        self.body_pool = cf.ThreadPoolExecutor(max_bodies, thread_name_prefix="moemesh-program")
        self.tool_pool = cf.ThreadPoolExecutor(runtime.max_tool_workers, thread_name_prefix="moemesh-tool")
        self._tokens: dict[tuple, asyncio.Future] = {}

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        self.body_pool.shutdown(wait=False)
        self.tool_pool.shutdown(wait=False)

    async def run(self, program: Program, args: Sequence[Any], kwargs: Mapping[str, Any]) -> State:
        """Runs the body on a worker thread, its nodes on this loop; the State once every node is done."""
        with tracer().start_as_current_span(f"program {program.name}") as span:
            run = Run(self, program.name, uuid.uuid4().hex[:12], trace.set_span_in_context(span))
            span.set_attribute("moemesh.program.run_id", run.run_id)
            state = State(run)
            body = functools.partial(contextvars.copy_context().run, program.body, state, *args, **kwargs)
            try:
                await asyncio.get_running_loop().run_in_executor(self.body_pool, body)
            except (ProgramError, cf.CancelledError, asyncio.CancelledError):
                # A node failed (the body read its value, or submitted after the failure).
                if run.failure is None:
                    raise
            except Exception as error:
                failure = ProgramError(program.name, program.name, "program", error)
                failure.__cause__ = error
                await run.fail(failure)
            try:
                await run.finish()
            except ProgramError as failure:
                span.record_exception(failure)
                span.set_status(trace.StatusCode.ERROR, str(failure))
                raise
            return state

    async def tokenize(self, text: str) -> list[int]:
        return list(await self._cached(("text", text), lambda: self.client.tokenize(text)))

    async def message_ids(self, role: str, content: str) -> list[int]:
        """A chat message's ids as the template renders it among others (without the generation prompt)."""
        generation_prompt = await self._generation_prompt()
        ids = await self._cached(("message", role, content), lambda: self.client.tokenize(messages=[(role, content)]))
        if generation_prompt and list(ids[-len(generation_prompt):]) != generation_prompt:
            raise ValueError(f"the chat template does not end a {role} message with its generation prompt")
        return list(ids[:len(ids) - len(generation_prompt)])

    async def role_markers(self, role: str) -> tuple[list[int], list[int]]:
        """The ids the template puts before and after a message's content, so that steps can go between."""
        empty, probe = await asyncio.gather(self.message_ids(role, ""), self.message_ids(role, _PROBE))
        opening = _common_prefix(empty, probe)
        closing = _common_prefix(empty[len(opening):][::-1], probe[len(opening):][::-1])[::-1]
        if len(opening) + len(closing) != len(empty):
            raise ValueError(f"cannot find where the chat template puts a {role} message's content")
        return opening, closing

    async def _generation_prompt(self) -> list[int]:
        # Templates render each message by itself, then the generation prompt: two messages minus one is one.
        one, two = await asyncio.gather(
            self._cached(("message", "user", _PROBE), lambda: self.client.tokenize(messages=[("user", _PROBE)])),
            self._cached(("two",), lambda: self.client.tokenize(messages=[("user", _PROBE)] * 2)))
        message_length = len(two) - len(one)
        if list(two[:message_length]) != list(one[:message_length]):
            raise ValueError("the chat template does not render messages one after another")
        return list(one[message_length:])

    def _cached(self, key: tuple, call) -> asyncio.Future:
        if key not in self._tokens:
            self._tokens[key] = asyncio.ensure_future(call())
        return self._tokens[key]


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class _Counter:
    """A progress line on stderr, where tqdm is not installed."""

    def __init__(self, total: int, name: str) -> None:
        self.total, self.name, self.done = total, name, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\r{self.name}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def _progress(total: int, name: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, name)
    return tqdm(total=total, desc=name)
