"""`moemesh.Client`: the blocking Python client of the gateway's GenerationService.

    with moemesh.Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_new_tokens=16).text)
        for chunk in client.stream("Hello", max_new_tokens=16, temperature=0.7, seed=1):
            print(chunk.text, end="")

Every call has a deadline (`timeout`, the client's by default), is retried
on UNAVAILABLE before its first token (client_retry.py says when), carries
the caller's trace context, and fails with a MoemeshError. With an API key
(`api_key`, else the environment variable MOEMESH_API_KEY) every call sends
`authorization: Bearer KEY` (docs/security.md). Keyword arguments
of generate/stream mirror SamplingParams (client_request.SamplingOptions).
AsyncClient (async_client.py) is the same over grpc.aio.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Unpack

import grpc

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import client_errors, client_request, client_types
from moemesh.client_request import Message, SamplingOptions
from moemesh.client_retry import Deadline, RetryPolicy, call_metadata

DEFAULT_TIMEOUT_S = 300.0
API_KEY_ENV = "MOEMESH_API_KEY"


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The `authorization` metadata of api_key, else of $MOEMESH_API_KEY; none if neither is set."""
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    return (("authorization", f"Bearer {key}"),) if key else ()


class ClientBase:
    """What Client and AsyncClient share: the channel's settings, the stub, and each call's preparation."""

    def __init__(self, target: str, channels, *, timeout: float | None, retry: RetryPolicy,
                 metadata: Sequence[tuple[str, str]], credentials: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, object]], api_key: str | None = None) -> None:
        self.target = target
        # Each call's deadline unless it passes its own; None: no deadline.
        self.timeout = timeout
        self.retry = retry
        self._metadata = (*metadata, *auth_metadata(api_key))
        # `channels` is grpc or grpc.aio.
        self._channel = (channels.secure_channel(target, credentials, options=list(options)) if credentials
                         else channels.insecure_channel(target, options=list(options)))
        self._stub = gateway_pb2_grpc.GenerationServiceStub(self._channel)

    def _call(self, timeout: float | None) -> tuple[Deadline, tuple[tuple[str, str], ...]]:
        """A call's deadline and metadata (with the trace context current now)."""
        return Deadline(self.timeout if timeout is None else timeout), call_metadata(self._metadata)


class Client(ClientBase):
    """A channel to one gateway (`target`, "host:port"); reuse it for many calls, close it when done."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, retry: RetryPolicy = RetryPolicy(),
                 metadata: Sequence[tuple[str, str]] = (), credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, object]] = (), api_key: str | None = None) -> None:
        super().__init__(target, grpc, timeout=timeout, retry=retry, metadata=metadata, credentials=credentials,
                         options=options, api_key=api_key)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
                 input_ids: Sequence[int] | None = None, request_id: str = "", timeout: float | None = None,
                 **options: Unpack[SamplingOptions]) -> client_types.GenerateResult:
        """The whole completion of one prompt (every sample of n), once it has finished."""
        builder = client_types.ResultBuilder()
        for chunk in self.stream(prompt, messages=messages, input_ids=input_ids, request_id=request_id,
                                 timeout=timeout, **options):
            builder.add(chunk)
        return builder.result()

    def stream(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
               input_ids: Sequence[int] | None = None, request_id: str = "", timeout: float | None = None,
               **options: Unpack[SamplingOptions]) -> Iterator[client_types.Chunk]:
        """The completion as it is generated, one Chunk per message; closing the iterator cancels the call.

        Builds the request and captures the trace context now, not at the first next().
        """
        request = client_request.generate_request(prompt, messages=messages, input_ids=input_ids,
                                                  request_id=request_id, **options)
        return self._stream(request, *self._call(timeout))

    def tokenize(self, text: str | None = None, *, messages: Iterable[Message] | None = None,
                 timeout: float | None = None) -> list[int]:
        """The token ids of a text, or of chat messages rendered with the chat template."""
        request = client_request.tokenize_request(text, messages=messages)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def abort(self, request_id: str, *, timeout: float | None = None) -> int:
        """Ends the live requests with this id (their streams end with finish_reason "abort"); how many.

        NotFoundError when none is live.
        """
        return self._unary(self._stub.Abort, gateway_pb2.AbortRequest(request_id=request_id), timeout).num_aborted

    def model_info(self, *, timeout: float | None = None) -> client_types.ModelInfo:
        """The served model and its worker group."""
        info = self._unary(self._stub.GetModelInfo, gateway_pb2.GetModelInfoRequest(), timeout)
        return client_types.model_info_from_proto(info)

    def _unary(self, method, request, timeout: float | None):
        deadline, metadata = self._call(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=deadline.remaining(), metadata=metadata)
            except grpc.RpcError as err:
                delay = self.retry.retry_delay(err.code(), attempt, deadline)
                if delay is None:
                    raise client_errors.from_rpc_error(err) from err
            time.sleep(delay)

    def _stream(self, request: gateway_pb2.GenerateRequest, deadline: Deadline,
                metadata: tuple[tuple[str, str], ...]) -> Iterator[client_types.Chunk]:
        attempt = 0
        while True:
            attempt += 1
            call = self._stub.Generate(request, timeout=deadline.remaining(), metadata=metadata)
            has_output = False
            try:
                for response in call:
                    has_output = True
                    yield client_types.chunk_from_proto(response)
                return
            except grpc.RpcError as err:
                delay = None if has_output else self.retry.retry_delay(err.code(), attempt, deadline)
                if delay is None:
                    raise client_errors.from_rpc_error(err, after_first_token=has_output) from err
            finally:
                # A no-op once the stream ended; otherwise the caller stopped reading.
                call.cancel()
            time.sleep(delay)
