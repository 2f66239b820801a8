"""The HTTP endpoint served by uvicorn in this loop, over a Frontend and an engine of simulated ranks.

The official `openai` package is the client; raw HTTP where the SDK hides
what is checked (the SSE framing, a client that goes away).
"""

import asyncio
import contextlib
import json

import openai
import pytest

from gateway.frontend import Frontend
from gateway.http.app import make_app
from gateway.http.server import HttpServer
from gateway.requests import ErrorCode, GenerationError
from gateway.validation import RequestLimits
from tests.gateway.fakes import MODEL_INFO, FakeTokenizer, reference_tokens
from tests.gateway.test_engine import make_engine
from tests.gateway.test_engine_pipeline import QueuedEngine, output
from tests.services.test_telemetry import tracing  # noqa: F401 (a fixture)

TOKENIZER = FakeTokenizer()
LIMITS = RequestLimits(vocab_size=100, max_context=1000, max_new_tokens_default=8, max_new_tokens_limit=200)


@contextlib.asynccontextmanager
async def serving(*, has_engine=True, is_running=True, engine=None, **engine_args):
    """(the engine or None, the Frontend, an AsyncOpenAI client, the base URL) of a served endpoint:
    over `engine` (a fake) if given, else a new engine of simulated ranks (running unless not
    is_running), or none (has_engine False)."""
    loop_task = None
    if engine is None and has_engine:
        engine = make_engine(**engine_args)[0]
        loop_task = asyncio.create_task(engine.run()) if is_running else None
    frontend = Frontend(tokenizer=TOKENIZER, limits=LIMITS, model_info=MODEL_INFO, get_engine=lambda: engine)
    http = await HttpServer.start(make_app(frontend, lambda i: TOKENIZER.decode([i]).encode()), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{http.port}"
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        yield engine, frontend, client, url
    finally:
        await client.close()
        await http.stop()
        if loop_task is not None:
            loop_task.cancel()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def text_of(prompt: str, n: int) -> str:
    return TOKENIZER.decode(reference_tokens(TOKENIZER.encode(prompt), n))


def test_completions_and_chat_streaming_and_not_give_the_engine_tokens_and_usage():
    async def scenario():
        async with serving() as (_, _, client, _):
            models = await client.models.list()
            completion = await client.completions.create(model="fake", prompt="abc", max_tokens=6)
            stream = await client.completions.create(model="fake", prompt="abc", max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            chat = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4)
            chat_stream = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
            chat_chunks = [chunk async for chunk in chat_stream]
            return models, completion, chunks, chat, chat_chunks

    models, completion, chunks, chat, chat_chunks = run(scenario())
    assert [m.id for m in models.data] == ["fake"]
    expected = text_of("abc", 6)
    assert completion.choices[0].text == expected and completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) \
        == (3, 6, 9)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6 and all(c.usage is None for c in chunks[:-1])
    chat_prompt = "user" + "hi"  # FakeTokenizer's chat template
    assert chat.choices[0].message.content == text_of(chat_prompt, 4) and chat.choices[0].message.role == "assistant"
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chat_chunks) == text_of(chat_prompt, 4)
    assert chat_chunks[-1].choices[0].finish_reason == "length" and chat_chunks[-1].usage is None


def test_a_stop_string_ends_the_text_before_it():
    full = text_of("abc", 12)
    stop = full[5:7]

    async def scenario():
        async with serving() as (_, _, client, _):
            return await client.completions.create(model="fake", prompt="abc", max_tokens=12, stop=[stop])

    completion = run(scenario())
    assert completion.choices[0].text == full[:full.index(stop)]
    assert completion.choices[0].finish_reason == "stop"


def test_the_sse_framing_ends_with_done():
    async def scenario():
        async with serving() as (_, _, _, url):
            return await raw_request(url, "/v1/completions", {"prompt": "ab", "max_tokens": 3, "stream": True})

    status, headers, body = run(scenario())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "a", "temperature": 7}, 400, "temperature"),          # the Frontend's rule
    ({"prompt": "a", "max_tokens": 500}, 400, "max_tokens"),          # over the server's limit
    ({"prompt": "a", "stop": ["x", ""]}, 400, "stop"),
    ({"prompt": "a", "temperature": "warm"}, 400, "temperature"),     # a JSON type
    ({"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "a", "priority": "urgent"}, 400, "priority"),
    ({"prompt": "a", "priority": 1}, 400, "priority"),
])
def test_bad_input_gets_its_status_and_openai_error_naming_the_parameter(body, status, param):
    async def scenario():
        async with serving() as (_, _, _, url):
            return await raw_request(url, "/v1/completions", body)

    got, _, raw = run(scenario())
    error = json.loads(raw)["error"]
    assert got == status and error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert error["message"].startswith(param) or status == 404


@pytest.mark.parametrize("body", [
    b"[" * 50_000 + b"]" * 50_000,   # past the JSON parser's recursion limit
    # Read, but deeper than the schema's re-encoding goes.
    b'{"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema", '
    b'"json_schema": {"schema": ' + b'{"items": ' * 990 + b"{}" + b"}" * 990 + b"}}}",
])
def test_a_body_nested_too_deeply_is_a_400_not_a_500(body):
    async def scenario():
        async with serving() as (_, _, _, url):
            return await raw_request(url, "/v1/chat/completions", body)

    got, _, raw = run(scenario())
    assert got == 400 and json.loads(raw)["error"]["message"] == "the request body is nested too deeply"


def test_the_sdk_raises_bad_request_for_a_chat_error():
    async def scenario():
        async with serving() as (_, _, client, _):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="fake", messages=[{"role": "tool", "content": "x"}])
            return error.value

    error = run(scenario())
    assert error.status_code == 400 and error.body["param"] == "messages"
    assert error.body["message"].startswith("messages[0].role must be one of")


def test_no_ready_group_is_503_and_health_says_so():
    async def scenario():
        async with serving(has_engine=False) as (_, _, client, url):
            with pytest.raises(openai.InternalServerError) as error:
                await client.completions.create(model="fake", prompt="abc", max_tokens=3)
            with pytest.raises(openai.InternalServerError) as stream_error:
                await client.completions.create(model="fake", prompt="abc", max_tokens=3, stream=True)
            return error.value, stream_error.value, await raw_request(url, "/health", None)

    error, stream_error, (health, _, body) = run(scenario())
    assert error.status_code == stream_error.status_code == 503
    assert error.body == {"message": "no worker group is ready", "type": "server_error", "param": None,
                          "code": "service_unavailable"}
    assert health == 503 and json.loads(body)["error"]["code"] == "service_unavailable"


def test_a_full_queue_is_429_and_health_is_ok_with_a_group():
    async def scenario():
        async with serving(is_running=False, max_waiting_requests=1) as (engine, _, client, url):
            waiting = asyncio.create_task(client.completions.create(model="fake", prompt="abc", max_tokens=3))
            while not engine.batcher.num_waiting:
                await asyncio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as error:
                await client.completions.create(model="fake", prompt="abc", max_tokens=3)
            health = await raw_request(url, "/health", None)
            waiting.cancel()
            return error.value, health

    error, (health, _, body) = run(scenario())
    assert error.status_code == 429 and error.body["code"] == "rate_limit_exceeded"
    assert health == 200 and json.loads(body) == {"status": "ok"}


def test_a_stream_that_fails_after_its_first_chunk_ends_with_an_error_event_then_done():
    engine = QueuedEngine([output(1), output(2), GenerationError(ErrorCode.UNAVAILABLE, "the group failed")])

    async def scenario():
        async with serving(engine=engine) as (_, _, _, url):
            return await raw_request(url, "/v1/completions", {"prompt": "ab", "max_tokens": 5, "stream": True})

    status, _, body = run(scenario())
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "bc"
    assert json.loads(events[-2]) == {"error": {"message": "the group failed", "type": "server_error",
                                                "param": None, "code": "service_unavailable"}}


def test_a_passed_deadline_is_504_and_a_bad_timeout_header_400():
    async def scenario():
        async with serving() as (engine, _, _, url):
            # Past by the time the batcher first schedules it.
            late = await raw_request(url, "/v1/completions", {"prompt": "abc", "max_tokens": 100},
                                     headers={"X-Request-Timeout": "0.000001"})
            bad = await raw_request(url, "/v1/completions", {"prompt": "abc"}, headers={"X-Request-Timeout": "-1"})
            return late, bad, engine.batcher.num_waiting

    (late, _, late_body), (bad, _, bad_body), num_waiting = run(scenario())
    assert late == 504 and json.loads(late_body)["error"]["type"] == "timeout_error", late_body
    assert num_waiting == 0
    assert bad == 400 and "X-Request-Timeout" in json.loads(bad_body)["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_its_request(stream):
    async def scenario():
        async with serving() as (engine, frontend, _, url):
            reader, writer = await open_request(url, "/v1/completions",
                                                {"prompt": "abc", "max_tokens": 150, "stream": stream})
            while not engine.num_active:
                await asyncio.sleep(0.005)
            if stream:
                await reader.readuntil(b"data: ")  # the first chunk
            writer.close()
            for _ in range(500):
                if not engine.num_active:
                    break
                await asyncio.sleep(0.01)
            return engine.num_active, engine.num_steps

    num_active, num_steps = run(scenario())
    assert num_active == 0 and num_steps < 150


def test_a_traceparent_header_continues_the_callers_trace(tracing):  # noqa: F811
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"

    async def scenario():
        async with serving() as (_, _, _, url):
            return await raw_request(url, "/v1/completions", {"prompt": "ab", "max_tokens": 2},
                                     headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})

    status, _, _ = run(scenario())
    [span] = [s for s in tracing.get_finished_spans() if s.kind.name == "SERVER"]
    assert status == 200 and format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent_id
    assert span.attributes["moemesh.finish_reason"] == "length"
    assert span.attributes["moemesh.request_id"].startswith("cmpl-")


async def open_request(url: str, path: str, body, *, headers=None):
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close", f"Content-Length: {len(data)}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
    await writer.drain()
    return reader, writer


async def raw_request(url: str, path: str, body, *, headers=None) -> tuple[int, dict, bytes]:
    """(status, headers, the body with chunked framing removed) of one HTTP/1.1 request."""
    reader, writer = await open_request(url, path, body, headers=headers)
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    response_headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    if response_headers.get("transfer-encoding") == "chunked":
        body_parts = []
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            body_parts.append(rest[:int(size, 16)])
            rest = rest[int(size, 16) + 2:]
        rest = b"".join(body_parts)
    return int(status_line.split()[1]), response_headers, rest
