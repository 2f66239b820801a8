"""`moemesh.AsyncClient`: the asyncio Python client of the gateway's GenerationService, over grpc.aio.

    async with moemesh.AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate("Hello", max_new_tokens=16)
        async for chunk in client.stream("Hello", max_new_tokens=16):
            print(chunk.text, end="")

The same calls, values, errors, deadlines, retries and trace context as
Client (client.py); create it inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Unpack

import grpc

from moe.gateway.v1 import gateway_pb2
from moemesh import client_errors, client_request, client_types
from moemesh.client import DEFAULT_TIMEOUT_S, ClientBase
from moemesh.client_request import Message, SamplingOptions
from moemesh.client_retry import Deadline, RetryPolicy


class AsyncClient(ClientBase):
    """A grpc.aio channel to one gateway (`target`, "host:port"); reuse it for many calls, close it when done."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, retry: RetryPolicy = RetryPolicy(),
                 metadata: Sequence[tuple[str, str]] = (), credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, object]] = (), api_key: str | None = None) -> None:
        super().__init__(target, grpc.aio, timeout=timeout, retry=retry, metadata=metadata,
                         credentials=credentials, options=options, api_key=api_key)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
                       input_ids: Sequence[int] | None = None, request_id: str = "", timeout: float | None = None,
                       **options: Unpack[SamplingOptions]) -> client_types.GenerateResult:
        """The whole completion of one prompt (every sample of n), once it has finished."""
        builder = client_types.ResultBuilder()
        async for chunk in self.stream(prompt, messages=messages, input_ids=input_ids, request_id=request_id,
                                       timeout=timeout, **options):
            builder.add(chunk)
        return builder.result()

    def stream(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
               input_ids: Sequence[int] | None = None, request_id: str = "", timeout: float | None = None,
               **options: Unpack[SamplingOptions]) -> AsyncIterator[client_types.Chunk]:
        """The completion as it is generated, one Chunk per message; closing the iterator cancels the call.

        Builds the request and captures the trace context now, not at the first iteration.
        """
        request = client_request.generate_request(prompt, messages=messages, input_ids=input_ids,
                                                  request_id=request_id, **options)
        return self._stream(request, *self._call(timeout))

    async def tokenize(self, text: str | None = None, *, messages: Iterable[Message] | None = None,
                       timeout: float | None = None) -> list[int]:
        """The token ids of a text, or of chat messages rendered with the chat template."""
        request = client_request.tokenize_request(text, messages=messages)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> int:
        """Ends the live requests with this id (their streams end with finish_reason "abort"); how many.

        NotFoundError when none is live.
        """
        answer = await self._unary(self._stub.Abort, gateway_pb2.AbortRequest(request_id=request_id), timeout)
        return answer.num_aborted

    async def model_info(self, *, timeout: float | None = None) -> client_types.ModelInfo:
        """The served model and its worker group."""
        info = await self._unary(self._stub.GetModelInfo, gateway_pb2.GetModelInfoRequest(), timeout)
        return client_types.model_info_from_proto(info)

    async def _unary(self, method, request, timeout: float | None):
        deadline, metadata = self._call(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=deadline.remaining(), metadata=metadata)
            except grpc.RpcError as err:
                delay = self.retry.retry_delay(err.code(), attempt, deadline)
                if delay is None:
                    raise client_errors.from_rpc_error(err) from err
            await asyncio.sleep(delay)

    async def _stream(self, request: gateway_pb2.GenerateRequest, deadline: Deadline,
                      metadata: tuple[tuple[str, str], ...]) -> AsyncIterator[client_types.Chunk]:
        attempt = 0
        while True:
            attempt += 1
            call = self._stub.Generate(request, timeout=deadline.remaining(), metadata=metadata)
            has_output = False
            try:
                async for response in call:
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
            await asyncio.sleep(delay)
