"""One program run: its nodes as tasks on the runtime's event loop, and how a failure ends them all.

The program body runs on a worker thread and calls the submit methods here
(text_piece, gen, select, tool, ...), which start a task on the loop at once
and return its concurrent future: a node starts when it is submitted and
waits only for its own inputs, so independent nodes run side by side.

A node that raises fails the run: its ProgramError names it, the requests
still running at the gateway are ended with Abort (their streams end with
"abort", the requests are freed, not left to finish), and every other task
is cancelled. Each gen request gets an id of its own, `<run>-<seq>-<node>`,
which is what Abort names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import dataclasses
import functools
import inspect
import itertools
import json
import time
from typing import Any

from opentelemetry import trace
from prometheus_client import Histogram

from moemesh.client_types import ResultBuilder, Usage
from moemesh.program.lang import Bind, Gen, GenerationAborted, ProgramError, Select
from moemesh.program.partial import MISSING, PartialFields
from moemesh.program.state import NodeOutput, Piece, Ref, as_text

NODE_SECONDS = Histogram(
    "moemesh_program_node_seconds", "Seconds from a program node's submission to its output, inputs' wait included.",
    ["program", "node", "kind"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
# How long a failure waits for the aborted requests' streams to end before cancelling them.
ABORT_GRACE_S = 5.0



def tracer() -> trace.Tracer:
    """The programs' tracer, from the provider current now (tests install theirs after import)."""
    return trace.get_tracer("moemesh.program")


class Run:
    """The nodes of one run of a program; the submit methods are called from the program's thread."""

    def __init__(self, session, program: str, run_id: str, context) -> None:
        self.session = session
        self.program = program
        self.run_id = run_id
        # The run's span: every node's span is its child, and the client carries it to the gateway.
        self.context = context
        self.loop = asyncio.get_running_loop()
        self.failure: ProgramError | None = None
        self.is_closed = False
        self._futures: list[cf.Future] = []
        self._tasks: set[asyncio.Task] = set()
        # Request id -> node, while the request runs at the gateway.
        self._live: dict[str, str] = {}
        self._seq = itertools.count()
        # Every gen, select, tool and fork node's output, as it finished (any state of the run).
        self.outputs: list[NodeOutput] = []
        # A json_schema gen's node future -> its fields as they stream (partial.py).
        self._partials: dict[cf.Future, PartialFields] = {}

    # Submitted from the program thread.

    def text_piece(self, text: str) -> cf.Future:
        return self._submit("text", "text", lambda: self._text(text), observed=False)

    def ref_piece(self, ref: Ref) -> cf.Future:
        async def resolve() -> Piece:
            return await self._text(as_text(await self._resolve(ref)))
        return self._submit("ref", "text", resolve, observed=False)

    def message_piece(self, role: str, content: str) -> cf.Future:
        async def message() -> Piece:
            return Piece(tuple(await self.session.message_ids(role, content)), content)
        return self._submit(role, "message", message, observed=False)

    def role_markers(self, role: str) -> tuple[cf.Future, cf.Future]:
        async def marker(index: int) -> Piece:
            return Piece(tuple((await self.session.role_markers(role))[index]), "")
        return (self._submit(role, "message", lambda: marker(0), observed=False),
                self._submit(role, "message", lambda: marker(1), observed=False))

    def gen(self, step: Gen, pieces: list[cf.Future]) -> cf.Future:
        request_id = self._request_id(step.name)
        partial = PartialFields() if step.json_schema is not None else None
        future = self._submit(step.name, "gen", lambda: self._gen(step, pieces, request_id, partial))
        if partial is not None:
            # Before any Ref to the node can be submitted: the program thread submits in order.
            self._partials[future] = partial
        return future

    def select(self, step: Select, pieces: list[cf.Future]) -> cf.Future:
        request_ids = [self._request_id(f"{step.name}-{i}") for i in range(len(step.choices))]
        return self._submit(step.name, "select", lambda: self._select(step, pieces, request_ids))

    def tool(self, step: Bind) -> cf.Future:
        return self._submit(step.name, "tool", lambda: self._tool(step))

    def _request_id(self, name: str) -> str:
        return f"{self.run_id}-{next(self._seq)}-{name}"

    def _submit(self, name: str, kind: str, work, *, observed: bool = True) -> cf.Future:
        if self.failure is not None:
            raise self.failure
        if self.is_closed:
            raise RuntimeError(f"program {self.program!r}: the run has ended; a state cannot grow after it")
        future = asyncio.run_coroutine_threadsafe(self._node(name, kind, work, observed), self.loop)
        self._futures.append(future)
        return future

    # On the loop.

    async def _node(self, name: str, kind: str, work, observed: bool):
        if self.failure is not None:
            raise asyncio.CancelledError
        task = asyncio.current_task()
        self._tasks.add(task)
        start = time.monotonic()
        try:
            if not observed:
                return await work()
            with tracer().start_as_current_span(f"{kind} {name}", context=self.context) as span:
                output = await work()
                span.set_attribute("moemesh.node.request_ids", list(output.request_ids))
        except (asyncio.CancelledError, ProgramError):
            # Cancelled by a failure, or an input failed (that node failed the run).
            raise
        except Exception as error:
            failure = ProgramError(self.program, name, kind, error)
            await self.fail(failure)
            raise failure from error
        finally:
            self._tasks.discard(task)
        seconds = time.monotonic() - start
        NODE_SECONDS.labels(self.program, name, kind).observe(seconds)
        output = dataclasses.replace(output, seconds=seconds)
        self.outputs.append(output)
        return output

    async def fail(self, failure: ProgramError) -> None:
        """Fails the run with its first failure: aborts the live requests, then cancels every other node."""
        if self.failure is not None:
            return
        self.failure = failure
        live = dict(self._live)
        answers = await asyncio.gather(*(self.session.client.abort(request_id, timeout=ABORT_GRACE_S)
                                         for request_id in live), return_exceptions=True)
        failure.aborted = tuple(sorted({live[rid] for rid, n in zip(live, answers) if isinstance(n, int) and n}))
        # Let the aborted streams end with their "abort" message rather than cancel them mid-way.
        deadline = time.monotonic() + ABORT_GRACE_S
        while self._live.keys() & live.keys() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()

    async def finish(self) -> None:
        """Waits for every node (the body has returned); raises the run's failure if it has one."""
        while pending := [f for f in self._futures if not f.done()]:
            await asyncio.wait([_wrap(f) for f in pending])
        self.is_closed = True
        if self.failure is not None:
            raise self.failure
        for future in self._futures:
            future.result()

    async def _prompt(self, pieces: list[cf.Future]) -> list[int]:
        outputs = await asyncio.gather(*(_wrap(p) for p in pieces))
        return [token for output in outputs for token in output.token_ids]

    async def _text(self, text: str) -> Piece:
        return Piece(tuple(await self.session.tokenize(text)), text)

    async def _resolve(self, ref: Ref):
        """A Ref's value: a json_schema gen's field as soon as it is complete, else once its node is done."""
        node = _wrap(ref.future)
        partial = self._partials.get(ref.future)
        if partial is not None and ref.keys and isinstance(ref.keys[0], str):
            value = await partial.wait(ref.keys[0], node)
            if value is not MISSING:
                return ref.index(value, 1)
        return ref.resolve(await node)

    async def _generate(self, request_id: str, node: str, prompt: list[int], partial: PartialFields | None = None,
                        **options):
        self._live[request_id] = node
        try:
            if partial is None:
                return await self.session.client.generate(input_ids=prompt, request_id=request_id, **options)
            builder, text = ResultBuilder(), ""
            async for chunk in self.session.client.stream(input_ids=prompt, request_id=request_id, **options):
                builder.add(chunk)
                if chunk.text:
                    text += chunk.text
                    partial.update(text)
            return builder.result()
        finally:
            self._live.pop(request_id, None)

    async def _gen(self, step: Gen, pieces: list[cf.Future], request_id: str,
                   partial: PartialFields | None) -> NodeOutput:
        result = await self._generate(request_id, step.name, await self._prompt(pieces), partial, **step.sampling())
        if result.finish_reason == "abort":
            raise GenerationAborted(f"request {request_id} was aborted after {len(result.token_ids)} tokens")
        value = _parse_json(step, result) if step.json_schema is not None else result.text
        return NodeOutput(step.name, "gen", value, result.text, result.token_ids, result.usage,
                          request_ids=(request_id,))

    async def _select(self, step: Select, pieces: list[cf.Future], request_ids: list[str]) -> NodeOutput:
        prompt, choice_ids = await asyncio.gather(
            self._prompt(pieces), asyncio.gather(*(self.session.tokenize(c) for c in step.choices)))
        if not prompt:
            raise ValueError("select needs a prompt before it: the first token has no log-probability")
        # Every choice's request at once: the gateway prefills the uncached part of the shared prompt
        # once (a request waits a step for a block another is computing, then reuses it), and each
        # scores only its choice's tokens (prompt_logprobs_start), on the cached prompt before them.
        results = await asyncio.gather(*(
            self._generate(request_id, step.name, prompt + ids, max_new_tokens=1, prompt_logprobs=True,
                           prompt_logprobs_start=len(prompt))
            for request_id, ids in zip(request_ids, choice_ids)))
        scores = {}
        for choice, ids, result in zip(step.choices, choice_ids, results):
            # prompt_logprobs[j] is the choice's token j's, given the prompt and the tokens before it.
            logprobs = [lp.logprob for lp in result.prompt_logprobs]
            if len(logprobs) != len(ids):
                raise ValueError(f"choice {choice!r}: {len(ids)} tokens but {len(logprobs)} log-probabilities")
            scores[choice] = sum(logprobs) / (len(logprobs) if step.normalize == "mean" else 1)
        best = max(range(len(step.choices)), key=lambda i: scores[step.choices[i]])
        usage = Usage(sum(r.usage.prompt_tokens for r in results), sum(r.usage.completion_tokens for r in results),
                      sum(r.usage.cached_tokens for r in results))
        return NodeOutput(step.name, "select", step.choices[best], step.choices[best], tuple(choice_ids[best]),
                          usage, scores=scores, request_ids=tuple(request_ids))

    async def _tool(self, step: Bind) -> NodeOutput:
        args = {key: await self._resolve(value) if isinstance(value, Ref) else value
                for key, value in step.args.items()}
        if inspect.iscoroutinefunction(step.tool):
            value = await step.tool(**args)
        else:
            # On the runtime's thread pool, in this node's trace context.
            call = functools.partial(contextvars.copy_context().run, step.tool, **args)
            value = await self.loop.run_in_executor(self.session.tool_pool, call)
        piece = await self._text(as_text(value))
        return NodeOutput(step.name, "tool", value, piece.text, piece.token_ids)


def _wrap(future: cf.Future) -> asyncio.Future:
    """The node's future on the loop. Its failure is the run's (ProgramError, raised once by
    `finish`), so an await that ends first (a partial field, another input's failure) leaves
    nothing for asyncio to report as "never retrieved"."""
    wrapped = asyncio.wrap_future(future)
    wrapped.add_done_callback(lambda done: done.cancelled() or done.exception())
    return wrapped


def _parse_json(step: Gen, result) -> Any:
    """A json_schema gen's value; an output cut short says so rather than showing a parser's error."""
    try:
        return json.loads(result.text)
    except ValueError:
        if result.finish_reason == "length":
            raise ValueError(f"the output reached max_tokens={step.max_tokens} before its JSON was complete: "
                             f"{result.text[:200]!r}") from None
        raise
