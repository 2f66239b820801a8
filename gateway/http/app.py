"""The OpenAI-compatible HTTP endpoint: FastAPI routes over the gateway's Frontend.

POST /v1/completions and /v1/chat/completions translate their JSON
(openai_api.py) into a GenerateRequest and call the same Frontend as the
gRPC servicer: one set of validation rules, one engine, no extra hop.
GET /v1/models lists the served model, GET /health answers 200 while a
worker group takes requests (503 otherwise).

Errors are OpenAI's error object, mapped here and nowhere else: bad input is
400 naming the parameter, no ready group 503, a full queue 429, a passed
deadline 504 (an `X-Request-Timeout` header, in seconds, is the request's
deadline, as a gRPC call's is). A stream that fails after its first chunk (its status is sent)
ends with an error event, then `data: [DONE]`. The first output is awaited
before the response starts, so that errors of submission still get their
status.

A client that goes away aborts its request: a stream's body iterator is
cancelled by Starlette and closes the Frontend's iterator; a non-streaming
request races a watch of the connection (Starlette does not cancel those).

Each request is observed as a gRPC Generate call is (observability.py's
RequestObservation: the same metrics, labelled with the same status names, the
request's log context, and its root span: FastAPI's SERVER span, which
continues the caller's `traceparent` header).

With a key file (--api-keys) every /v1 route needs `Authorization: Bearer KEY`
(gateway/http/auth.py: the gRPC API's keys, checks and limits); /health stays
open. An unexpected exception is logged and answered 500 "internal error": no
exception class or stack ever reaches the client.
"""

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gateway.auth import ApiKey, AuthError, KeyStore
from gateway.auth_grpc import priority_name
from gateway.frontend import NO_GROUP_MESSAGE, Frontend
from gateway.http.auth import admit_stream, auth_error_response, key_dependency
from gateway.http import openai_api
from gateway.http.openai_api import ApiError, ApiRequest
from gateway.http.responses import ResponseState
from gateway.observability import RequestObservation
from gateway.requests import ErrorCode, GenerationError, RequestOutput
from gateway.step_budget import Overloaded
from gateway.validation import RequestError

log = logging.getLogger("gateway.http")

_ERRORS = {  # ErrorCode -> (HTTP status, OpenAI error type, code)
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}


def generation_error(error: GenerationError) -> ApiError:
    """The OpenAI error of a failed generation; one refused under load says when to retry
    (Retry-After in seconds, and retry-after-ms, which OpenAI's clients read first)."""
    status, kind, code = _ERRORS[error.code]
    headers = None
    if isinstance(error, Overloaded):
        headers = {"Retry-After": str(math.ceil(error.retry_after_ms / 1000)),
                   "retry-after-ms": str(error.retry_after_ms)}
    return ApiError(status, error.message, type_=kind, code=code, headers=headers)


def _deadline(request: Request) -> float | None:
    """time.monotonic() by which the request must be done: now plus its X-Request-Timeout, if any."""
    value = request.headers.get("x-request-timeout")
    if value is None:
        return None
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = math.nan
    if not 0 < timeout_s < math.inf:
        raise ApiError(400, f"the X-Request-Timeout header must be a positive number of seconds, got {value!r}")
    return time.monotonic() + timeout_s


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class HttpCall:
    """One HTTP generation as the observation of a gRPC call sees it: the caller's
    traceparent (invocation_metadata) and the outcome as a gRPC status (code).

    Its root span is FastAPI's SERVER span of the request (current while the
    route runs), which continues the caller's traceparent header; FastAPI makes
    it whenever a tracer provider is set, that is when tracing is on.
    """

    def __init__(self, request: Request, api: ApiRequest) -> None:
        self.traceparent = request.headers.get("traceparent", "")
        self._code: grpc.StatusCode | None = None
        self.observation = RequestObservation(api.request, self)

    def invocation_metadata(self):
        return (("traceparent", self.traceparent),)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def finish(self, error: BaseException | None) -> None:
        """Records the outcome (error None: the last output was sent)."""
        if isinstance(error, GenerationError):
            self._code = grpc.StatusCode[error.code.name]
        elif isinstance(error, ApiError):
            self._code = grpc.StatusCode.INVALID_ARGUMENT
        elif error is None:
            self._code = grpc.StatusCode.OK
        self.observation.finish(self, error)


async def _until_disconnect(request: Request, work):
    """Awaits `work` unless the client disconnects first (then cancels it and returns None)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (the server stops)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


class OpenAIEndpoint:
    """The routes' logic over one Frontend; token_bytes(id) gives a token's bytes for logprobs."""

    def __init__(self, frontend: Frontend, token_bytes: Callable[[int], bytes],
                 keys: KeyStore | None = None) -> None:
        self.frontend = frontend
        self.token_bytes = token_bytes
        self.keys = keys
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.frontend.model_info.model_name

    def models(self) -> dict:
        info = self.frontend.model_info
        return {"object": "list", "data": [{"id": info.model_name, "object": "model", "created": self.created,
                                            "owned_by": "moemesh", "max_model_len": info.context_length}]}

    async def generate(self, request: Request, route: str, key: ApiKey | None = None) -> Response:
        """One generation; holds one of the key's streams until its response ends."""
        is_chat = route.endswith("chat/completions")
        response_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            body = await request.json()
            api = (openai_api.parse_chat if is_chat else openai_api.parse_completion)(body, response_id)
        except RecursionError:  # from the JSON parser, or from walking or re-encoding what it read
            raise ApiError(400, "the request body is nested too deeply") from None
        except ApiError:
            raise
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if api.model and api.model != self.model_name:
            raise ApiError(404, f"The model `{api.model}` does not exist", param="model", code="model_not_found")
        deadline = _deadline(request)
        release = admit_stream(self.keys, key, priority_name(api.request))
        try:
            return await self._respond(request, api, response_id, deadline, release, key.name if key else None)
        except BaseException:
            release()
            raise

    async def _respond(self, request: Request, api: ApiRequest, response_id: str, deadline: float | None,
                       release: Callable[[], None], owner: str | None) -> Response:
        call = HttpCall(request, api)
        state = ResponseState(api, response_id, self.model_name, self.token_bytes)
        if not api.stream:
            result = await _until_disconnect(request, self._collect(call, api, state, deadline, owner))
            release()
            return Response(status_code=499) if result is None else JSONResponse(result)
        try:
            started = await _until_disconnect(request, self._start(api, deadline, owner))
        except GenerationError as error:
            call.finish(error)
            raise generation_error(error) from error
        except BaseException as error:
            call.finish(error)
            raise
        if started is None:
            call.finish(asyncio.CancelledError())
            return Response(status_code=499)
        outputs, first = started
        return StreamingResponse(self._events(call, state, first, outputs, release), media_type="text/event-stream")

    async def _start(self, api: ApiRequest, deadline: float | None,
                     owner: str | None) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Validates and submits as owner (the API key's name, None without keys): (the outputs'
        iterator, its first output); raises ApiError, GenerationError."""
        try:
            validated = await self.frontend.validate(api.request)
        except RequestError as error:
            raise openai_api.request_error(error.field, error.message, api) from error
        outputs = self.frontend.generate(validated, deadline=deadline, owner=owner)
        try:
            return outputs, await anext(outputs)
        except BaseException:
            await outputs.aclose()
            raise

    async def _collect(self, call: HttpCall, api: ApiRequest, state: ResponseState,
                       deadline: float | None, owner: str | None) -> dict:
        """The whole response of a non-streaming request; raises ApiError."""
        error = outputs = None
        try:
            outputs, output = await self._start(api, deadline, owner)
            while output is not None:
                call.observation.on_output(output)
                state.add(output)
                output = await anext(outputs, None)
            return state.body()
        except GenerationError as caught:
            error = caught
            raise generation_error(caught) from caught
        except BaseException as caught:
            error = caught
            raise
        finally:
            if outputs is not None:
                await outputs.aclose()
            call.finish(error)

    async def _events(self, call: HttpCall, state: ResponseState, first: RequestOutput,
                      outputs: AsyncIterator[RequestOutput], release: Callable[[], None]) -> AsyncIterator[bytes]:
        """The server-sent events of a stream, ending with `data: [DONE]`."""
        error = None
        try:
            output = first
            while output is not None:
                call.observation.on_output(output)
                for chunk in state.add(output):
                    yield _event(chunk)
                output = await anext(outputs, None)
            if state.api.include_usage:
                yield _event(state.usage_chunk())
        except GenerationError as caught:
            error = caught
            yield _event(generation_error(caught).body())
        except BaseException as caught:
            error = caught
            raise
        finally:
            release()
            await outputs.aclose()
            call.finish(error)
        yield b"data: [DONE]\n\n"


def make_app(frontend: Frontend, token_bytes: Callable[[int], bytes], *, keys: KeyStore | None = None) -> FastAPI:
    """The FastAPI application of the endpoint (served by gateway/http/server.py); with keys,
    the /v1 routes need an API key."""
    endpoint = OpenAIEndpoint(frontend, token_bytes, keys)
    require_key = Depends(key_dependency(keys))
    # No span per endpoint call: a stream outlives its endpoint's return, so the request's
    # root span (the observation's) is FastAPI's SERVER span of the whole request.
    app = FastAPI(title="moemesh", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"operation_spans": False})

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(AuthError)
    async def auth_error(request: Request, error: AuthError) -> JSONResponse:
        return auth_error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return JSONResponse(ApiError(500, "internal error", type_="server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if frontend.num_ranks:
            return JSONResponse({"status": "ok"})
        error = generation_error(GenerationError(ErrorCode.UNAVAILABLE, NO_GROUP_MESSAGE))
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/v1/models", dependencies=[require_key])
    async def models() -> dict:
        return endpoint.models()

    @app.post("/v1/completions")
    async def completions(request: Request, key: ApiKey | None = require_key) -> Response:
        return await endpoint.generate(request, "/v1/completions", key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, key: ApiKey | None = require_key) -> Response:
        return await endpoint.generate(request, "/v1/chat/completions", key)

    return app
